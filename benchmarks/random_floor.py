"""The return of a uniformly random policy (actions ~ U[-1, 1]^d each step) on a task: the floor a learning curve must
rise above. Uses the same environment layer and evaluation as training (trudi_jax.run_episodes: fresh episodes,
summed reward until the first end, the time limit of --episode-length).

    python benchmarks/random_floor.py --envs G1JoystickFlatTerrain HumanoidWalk humanoid --episodes 32 \
        --json benchmarks/results/cpu/random_floor.json
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    envs: tuple[str, ...] = ("G1JoystickFlatTerrain",)  # tasks (any name trudi_jax.py takes)
    episodes: int = 32  # fresh episodes per task
    episode_length: int = 1000  # time limit, as in training
    seed: int = 0
    domain_randomization: bool = True  # as in training (where the task has a randomiser)
    json: str | None = None  # also write the results to this file


def main(args: Args) -> list[dict]:
    rows = []
    for name in args.envs:
        start = time.perf_counter()
        env = trudi_jax.make_env(name, randomize=args.domain_randomization)
        act = lambda obs, key: jax.random.uniform(key, (obs.shape[0], env.action_size), minval=-1.0, maxval=1.0)
        run = jax.jit(lambda key: trudi_jax.run_episodes(env, act, key, args.episodes, args.episode_length))
        mean, std = jax.device_get(run(jax.random.PRNGKey(args.seed)))
        row = {"env": name, "random_return_mean": float(mean), "random_return_std": float(std),
               "episodes": args.episodes, "episode_length": args.episode_length,
               "seconds": round(time.perf_counter() - start, 1)}
        print(f"[random floor] {name}: {mean:.2f} ± {std:.2f} over {args.episodes} episodes ({row['seconds']} s)", flush=True)
        rows.append(row)
    if args.json:
        meta = {"command": "python " + " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "device": f"{jax.devices()[0].platform} x{len(jax.devices())} ({os.cpu_count()} CPU cores)",
                "jax": jax.__version__}
        with open(args.json, "w") as f:
            json.dump([row | meta for row in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
