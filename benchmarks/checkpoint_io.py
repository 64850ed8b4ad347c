"""Checkpoint write/read time and size of the full train state, for a preset on a task.

    python benchmarks/checkpoint_io.py --env HumanoidWalk --preset paper --json benchmarks/results/cpu/checkpoint_io.json

Builds the train state of each algorithm (1 seed) exactly as `train` does and times `save_checkpoint`
(device -> host copy + msgpack + sha256 + fsync + rename) and the way back (read + verify + restore onto the
devices). The state of a trained run has the same arrays, so the same size and times.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_jax  # noqa: E402
import trudi_jax  # noqa: E402


def header(module, cfg) -> dict:
    """The header `train` writes at its first log point (a run's rows add a few hundred bytes per log point)."""
    return {"config": module.config_dict(cfg), "chunks_done": 1, "env_steps": cfg.num_envs * cfg.rollout_steps,
            "wall_s": 0.0, "rows": [], "wandb_id": None}


def measure(module, env_name: str, preset: str, repeats: int) -> dict:
    cfg = module.preset_config(preset, env_name)
    env = module.make_env(cfg.env, cfg.backend)
    init, _, _ = module.make_train(cfg, env)
    keys = jax.random.PRNGKey(0)[None]
    mesh = module.Mesh(np.array(jax.devices()), ("envs",))
    shardings = module.state_shardings(mesh)
    ts = jax.block_until_ready(jax.jit(module.over_seeds(init), out_shardings=shardings)(keys))
    leaves = jax.tree.leaves(ts)
    parts = {"env states + reset pool": jax.tree.leaves((ts.env_state, ts.reset_pool))}
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.msgpack")
        for _ in range(repeats):
            start = time.perf_counter()
            size = module.save_checkpoint(path, module.host_copy(ts), header(module, cfg))
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            meta, payload = module.read_checkpoint(path)
            restored = jax.block_until_ready(module.restore_state(path, meta, payload, ts, shardings))
            reads.append(time.perf_counter() - start)
        assert all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f") for a, b in zip(jax.tree.leaves(restored), leaves))
    return {"algo": module.__name__, "env": env_name, "preset": preset, "num_envs": cfg.num_envs,
            "arrays": len(leaves), "size_mib": size / 2**20,
            "env_state_mib": sum(x.nbytes for x in parts["env states + reset pool"]) / 2**20,
            "write_s_median": statistics.median(writes), "read_s_median": statistics.median(reads),
            "write_s": writes, "read_s": reads}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="HumanoidWalk")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [measure(m, args.env, args.preset, args.repeats) for m in (trudi_jax, ppo_jax)]
    for r in results:
        print(f"{r['algo']:9s} {r['env']} --preset {r['preset']} ({r['num_envs']} envs): {r['size_mib']:.1f} MiB "
              f"({r['env_state_mib']:.1f} MiB env states + reset pool), {r['arrays']} arrays; "
              f"write {r['write_s_median']:.2f} s, read+restore {r['read_s_median']:.2f} s (median of {args.repeats})")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        info = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.node()} {os.cpu_count()} cores, {jax.devices()[0].platform}",
                "jax": jax.__version__, "results": results}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
