"""Sharding overhead and agreement: the same training on 1 and on N forced host (CPU) devices.

    python benchmarks/devices.py --devices 1 2 --json benchmarks/results/cpu/devices.json

Each device count runs in its own process (XLA_FLAGS=--xla_force_host_platform_device_count=N must be set
before JAX starts); the environments are split across the devices, parameters replicated (see
`state_shardings` in the algorithm files). Reports steps/s (median over log points, compile excluded)
and the largest difference of every logged metric between the runs.
"""
import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = """
import json, sys
import jax
import {algo}
sys.path.insert(0, "benchmarks")
import devices
cfg = devices.make_config({algo}, json.loads(sys.argv[1]))
rows = {algo}.train(cfg, log=lambda line: print(line, file=sys.stderr))
print(json.dumps({{"devices": jax.device_count(), "rows": rows}}))
"""
TIMING = ("wall_s", "steps_per_sec", "env_steps", "seed")


def make_config(module, overrides: dict):
    """The cpu preset for overrides["env"] with the overrides; the run writes into its own out_dir, replacing
    what an earlier measurement left there."""
    return dataclasses.replace(module.preset_config("cpu", overrides["env"]), overwrite=True, **overrides)


def run(algo: str, devices: int, config: dict) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", RUN.format(algo=algo), json.dumps(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == devices
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["ppo_jax", "trudi_jax"])
    parser.add_argument("--devices", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--env", default="CartpoleBalance")
    parser.add_argument("--iterations", type=int, default=12, help="training iterations per run")
    parser.add_argument("--num-evals", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = []
    for algo in args.algos:
        batch = 64 * 32  # cpu preset: 64 envs x 32 steps
        config = {"env": args.env, "total_steps": args.iterations * batch, "num_evals": args.num_evals, "plot": False,
                  "out_dir": f"/tmp/devices_{algo}"}
        runs = {n: run(algo, n, config | {"out_dir": f"/tmp/devices_{algo}_{n}"}) for n in args.devices}
        base = runs[args.devices[0]]["rows"]
        for n, result in runs.items():
            rows = result["rows"]
            diffs = {}
            for k in base[0]:
                if k in TIMING:
                    continue
                pairs = [(a[k], b[k]) for a, b in zip(base, rows) if not (math.isnan(a[k]) and math.isnan(b[k]))]
                abs_diff = max((abs(a - b) for a, b in pairs), default=0.0)
                rel_diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in pairs), default=0.0)
                diffs[k] = {"max_abs": abs_diff, "max_rel": rel_diff}
            worst = max(diffs.items(), key=lambda kv: kv[1]["max_rel"])
            first = {k: abs(base[0][k] - rows[0][k]) / max(abs(base[0][k]), 1e-12) for k in diffs
                     if not (math.isnan(base[0][k]) and math.isnan(rows[0][k]))}
            entry = {"algo": algo, "devices": n, "steps_per_sec": statistics.median(r["steps_per_sec"] for r in rows),
                     "max_rel_diff": worst[1]["max_rel"], "worst_metric": worst[0],
                     "max_rel_diff_first_log_point": max(first.values()), "diffs": diffs,
                     "eval_return": [r["eval_return"] for r in rows]}
            report.append(entry)
            print(f"{algo:9s} {n} device(s): {entry['steps_per_sec']:,.0f} steps/s | max relative metric difference "
                  f"vs {args.devices[0]} device(s): {entry['max_rel_diff']:.2e} ({worst[0]}), "
                  f"first log point {entry['max_rel_diff_first_log_point']:.2e} | eval {entry['eval_return']}")
    if args.json:
        info = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{platform.node()} {os.cpu_count()} cores", "config": config, "results": report}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
