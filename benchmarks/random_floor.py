"""The return of a uniformly random policy (actions ~ U[-1, 1]^d each step) on a task: the floor a learning curve must
rise above. `--policy zero` holds every action at 0 instead (a locomotion robot's default pose): the floor of a
deterministic evaluation whose untrained actions are near 0, as TruDi's noise-free chain from x0 = 0 is. Uses the
same environment layer and evaluation as training (trudi_jax.run_episodes: fresh episodes, summed reward until the
first end, the time limit of --episode-length).

    python benchmarks/random_floor.py --envs G1JoystickFlatTerrain HumanoidWalk humanoid --episodes 32 \
        --json benchmarks/results/cpu/random_floor.json
    python benchmarks/random_floor.py --envs G1JoystickFlatTerrain HumanoidWalk humanoid --policy zero \
        --json benchmarks/results/cpu/zero_action_floor.json
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    envs: tuple[str, ...] = ("G1JoystickFlatTerrain",)  # tasks (any name trudi_jax.py takes)
    episodes: int = 32  # fresh episodes per task
    episode_length: int = 1000  # time limit, as in training
    seed: int = 0
    policy: Literal["uniform", "zero"] = "uniform"  # uniform random actions, or every action 0
    domain_randomization: bool = True  # as in training (where the task has a randomiser)
    json: str | None = None  # also write the results to this file


def main(args: Args) -> list[dict]:
    rows = []
    for name in args.envs:
        start = time.perf_counter()
        env = trudi_jax.make_env(name, randomize=args.domain_randomization)
        if args.policy == "uniform":
            act = lambda obs, key: jax.random.uniform(key, (obs.shape[0], env.action_size), minval=-1.0, maxval=1.0)
        else:
            act = lambda obs, key: jnp.zeros((obs.shape[0], env.action_size))
        run = jax.jit(lambda key: trudi_jax.run_episodes(env, act, key, args.episodes, args.episode_length))
        mean, std, length = jax.device_get(run(jax.random.PRNGKey(args.seed)))
        prefix = "random" if args.policy == "uniform" else "zero_action"
        row = {"env": name, "policy": args.policy, f"{prefix}_return_mean": float(mean),
               f"{prefix}_return_std": float(std), f"{prefix}_length_mean": float(length), "episodes": args.episodes,
               "episode_length": args.episode_length, "seconds": round(time.perf_counter() - start, 1)}
        print(f"[{args.policy} floor] {name}: {mean:.2f} ± {std:.2f} over {args.episodes} episodes of {length:.0f} steps "
              f"on average ({row['seconds']} s)", flush=True)
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
