"""What a seed axis costs the physics: MJX steps unmapped vs under a vmap over seeds.

    python benchmarks/seed_axis.py --json benchmarks/results/cpu/seed_axis.json

Times 32 zero-action steps of a task's physics (vmapped over environments, as in training) in four layouts:
one seed of E envs called plainly and under a vmap over a size-1 seed axis, and S seeds of E envs under
vmap next to one seed of S*E envs called plainly. This is why `over_seeds` in the algorithm files calls a
single seed without vmap. Median of --repeats timed calls after one warm-up call; compile excluded.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_jax  # noqa: E402


def measure(env_name: str, num_envs: int, num_seeds: int, steps: int, repeats: int) -> list[dict]:
    env = ppo_jax.make_env(env_name)

    def roll(sim):
        actions = jnp.zeros((jax.tree.leaves(sim)[0].shape[0], env.action_size))
        return jax.lax.scan(lambda s, _: (jax.vmap(env.step)(s, actions), None), sim, None, length=steps)[0]

    def layout(name, seeds, envs_per_seed, mapped):
        sim = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), seeds * envs_per_seed))
        if mapped:
            sim = jax.tree.map(lambda x: x.reshape((seeds, envs_per_seed) + x.shape[1:]), sim)
        compiled = jax.jit(jax.vmap(roll) if mapped else roll).lower(sim).compile()
        sim = jax.block_until_ready(compiled(sim))
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            sim = jax.block_until_ready(compiled(sim))
            rates.append(seeds * envs_per_seed * steps / (time.perf_counter() - start))
        row = {"layout": name, "seeds": seeds, "envs_per_seed": envs_per_seed, "seed_vmap": mapped,
               "steps_per_sec": statistics.median(rates), "steps_per_sec_rounds": rates}
        print(f"{name:<36} {row['steps_per_sec']:>10,.0f} steps/s", flush=True)
        return row

    return [layout(f"1 seed x {num_envs} envs, plain", 1, num_envs, False),
            layout(f"1 seed x {num_envs} envs, seed vmap", 1, num_envs, True),
            layout(f"1 seed x {num_seeds * num_envs} envs, plain", 1, num_seeds * num_envs, False),
            layout(f"{num_seeds} seeds x {num_envs} envs, seed vmap", num_seeds, num_envs, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CheetahRun")
    parser.add_argument("--num-envs", type=int, default=128)
    parser.add_argument("--num-seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if min(args.num_envs, args.num_seeds, args.steps, args.repeats) < 1:
        raise SystemExit("error: --num-envs, --num-seeds, --steps and --repeats must be positive")
    rows = measure(args.env, args.num_envs, args.num_seeds, args.steps, args.repeats)
    if args.json:
        out = {"command": "python benchmarks/seed_axis.py " + " ".join(sys.argv[1:]),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}",
               "jax": jax.__version__, "env": args.env, "steps": args.steps, "results": rows}
        with open(args.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
