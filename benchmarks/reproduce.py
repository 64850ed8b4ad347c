"""Run an algorithm over a task set and seeds; write one long-format CSV of evaluation returns.

    python benchmarks/reproduce.py --algo trudi --tasks cpu --seeds 3
    python benchmarks/reproduce.py --algo reppo --tasks CartpoleBalance --seeds 4 --first-seed 100 --separate-seeds
    python benchmarks/reproduce.py --algo reppo --tasks dmc --seeds 5 --preset paper
    python benchmarks/reproduce.py --algo trudi --label trudi_reverse --kl-direction reverse --out kl.csv
    python benchmarks/reproduce.py --algo ppo --tasks brax --preset paper --out benchmarks/results/gpu/ppo_brax.csv

Algorithms: `trudi` (trudi_jax.py), `reppo` (trudi_jax.py --actor gaussian), `ppo` (ppo_jax.py). The seeds of
one task train together in one compiled program (`--num-seeds`, vmap). Each row of the CSV is
`algo, env, seed, env_steps, eval_return, wall_s, status, kl_median`; a run that dies (an exception, or a non-finite
evaluation return) is recorded with its status instead of being dropped, and the next task still runs.
Rows are appended as each task finishes, so an interrupted run keeps what it measured, and a task whose rows for
this algorithm (label) and number of seeds are already in the CSV is skipped: running the same command again
continues an interrupted suite with the next task (`--rerun` runs it anyway). At `--preset cpu` every algorithm
gets the same budget, CPU_BUDGET env steps per seed, unless `--total-steps` is given.

The CPU suite, one part per algorithm and task (each part about 5 to 25 minutes on 2 cores: PPO ~5, TruDi ~15,
FingerSpin the slowest):

    for task in CartpoleBalance CartpoleSwingup PointMass ReacherEasy FingerSpin; do
      for algo in trudi reppo ppo; do
        python benchmarks/reproduce.py --algo $algo --tasks $task --seeds 3 --out benchmarks/results/cpu/suite.csv
      done
    done
    python benchmarks/plot.py benchmarks/results/cpu/suite.csv --out benchmarks/results/cpu/suite
"""
from __future__ import annotations

import csv
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_jax  # noqa: E402
import trudi_jax  # noqa: E402

TASK_SETS = {
    # the CPU suite: DM Control tasks whose cost at the cpu preset is about the same (the networks, not the physics,
    # set the time at 64 envs: throughput_cpu_preset_tasks.json), about 30 minutes per task for 3 algorithms x 3 seeds
    "cpu": ("CartpoleBalance", "CartpoleSwingup", "PointMass", "ReacherEasy", "FingerSpin"),
    "dmc": ("AcrobotSwingup", "BallInCup", "CartpoleBalance", "CartpoleBalanceSparse", "CartpoleSwingup",
            "CartpoleSwingupSparse", "CheetahRun", "FingerSpin", "FingerTurnEasy", "FingerTurnHard", "FishSwim",
            "HopperHop", "HopperStand", "PendulumSwingup", "ReacherEasy", "ReacherHard", "WalkerRun",
            "WalkerStand", "WalkerWalk"),
    "humanoid": ("HumanoidStand", "HumanoidWalk", "HumanoidRun"),
    "brax": ("humanoid", "ant", "halfcheetah", "hopper", "walker2d"),
}
# The env steps every algorithm gets per seed at --preset cpu unless --total-steps is given: one budget for the three,
# so that curves and areas compare step for step (each file then rounds it up to its own whole iterations).
CPU_BUDGET = 1_200_000
ALGOS = {"trudi": (trudi_jax, []), "reppo": (trudi_jax, ["--actor", "gaussian"]), "ppo": (ppo_jax, [])}
FIELDS = ["algo", "env", "seed", "env_steps", "eval_return", "wall_s", "status", "kl_median"]


def run_task(algo: str, env: str, seeds: int, preset: str, extra: list[str], log=print, first_seed: int = 0,
             separate: bool = False) -> list[dict]:
    """Train `seeds` seeds of one algorithm on one task; rows for the CSV (a failure is one row per seed).
    Together: one program with the seeds vmapped (seed index 0..seeds-1 of --seed first_seed). Separate: one run per
    seed, --seed first_seed + i without vmap, i.e. the program a user's single-seed command runs."""
    if separate:
        return [row for s in range(first_seed, first_seed + seeds)
                for row in run_task(algo, env, 1, preset, extra + ["--seed", str(s)], log, s)]
    module, algo_args = ALGOS[algo]
    with tempfile.TemporaryDirectory() as out_dir:
        argv = ["--env", env, "--preset", preset, "--num-seeds", str(seeds), "--out-dir", out_dir, "--no-plot",
                "--seed", str(first_seed), *algo_args, *extra]
        start = time.perf_counter()
        try:
            cfg = module.parse_config(argv)
            rows = module.train(cfg, log=lambda line: log(f"  {line}"))
        except (Exception, SystemExit) as error:  # recorded, not dropped; the next task still runs
            message = f"failed: {type(error).__name__}: {error}".replace("\n", " ")[:300]
            wall = round(time.perf_counter() - start, 1)
            return [dict(algo=algo, env=env, seed=first_seed + s if seeds == 1 else s, env_steps=0,
                         eval_return=math.nan, wall_s=wall, status=message) for s in range(seeds)]
    out = []
    for row in rows:
        finite = math.isfinite(row["eval_return"])
        out.append(dict(algo=algo, env=env, seed=row["seed"], env_steps=row["env_steps"],
                        eval_return=row["eval_return"], wall_s=row["wall_s"], status="ok" if finite else "nan",
                        kl_median=row.get("kl_median", "")))
    return out


def has_rows(path: str, label: str, env: str, seeds: list[int]) -> bool:
    """Whether the CSV at `path` already holds rows with status ok of `label` on `env` for every one of `seeds` (the
    seed column: --seed of a separate run, the index of a vmapped one)."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        held = {int(r["seed"]) for r in csv.DictReader(f) if r["algo"] == label and r["env"] == env and r["status"] == "ok"}
    return set(seeds) <= held


def main(argv: list[str]) -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", required=True, choices=sorted(ALGOS))
    parser.add_argument("--tasks", default="cpu", help=f"a task set ({', '.join(TASK_SETS)}) or comma-separated names")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="--seed of the first run (default 0)")
    parser.add_argument("--separate-seeds", action="store_true",
                        help="one run per seed (--seed S, no vmap) instead of one program with the seeds vmapped")
    parser.add_argument("--preset", default="cpu", choices=["cpu", "paper"])
    parser.add_argument("--label", default=None, help="the CSV's algo column (default --algo), e.g. for a variant "
                        "given by extra flags: --algo trudi --label trudi_reverse --kl-direction reverse")
    parser.add_argument("--rerun", action="store_true", help="run a task even if the CSV already holds its rows")
    parser.add_argument("--out", default=None, help="CSV to append to (default benchmarks/results/<preset>/reproduce.csv)")
    args, extra = parser.parse_known_args(argv)  # anything else goes to the algorithm's own CLI
    if args.seeds < 1:
        raise SystemExit("error: --seeds must be positive")
    tasks = TASK_SETS.get(args.tasks) or tuple(t for t in args.tasks.split(",") if t)
    if args.preset == "cpu" and not any(a == "--total-steps" or a.startswith("--total-steps=") for a in extra):
        extra = extra + ["--total-steps", str(CPU_BUDGET)]
    if args.separate_seeds:  # the runs of a task compile the same program: compile it once
        import jax
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jax_cache_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", args.preset, "reproduce.csv")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    new_file = not os.path.exists(out)
    label = args.label or args.algo
    seeds = [args.first_seed + i if args.separate_seeds else i for i in range(args.seeds)]  # the CSV's seed column
    for env in tasks:
        if not args.rerun and has_rows(out, label, env, seeds):
            print(f"[reproduce] {label} on {env}: seeds {seeds} already in {out}, skipped (--rerun to run them again)")
            continue
        print(f"[reproduce] {args.algo} on {env}, {args.seeds} seeds, preset {args.preset}")
        rows = run_task(args.algo, env, args.seeds, args.preset, extra, first_seed=args.first_seed,
                        separate=args.separate_seeds)
        rows = [r | {"algo": args.label} for r in rows] if args.label else rows
        with open(out, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new_file:
                writer.writeheader()
                new_file = False
            writer.writerows(rows)
        statuses = sorted({r["status"] for r in rows})
        print(f"[reproduce] {args.algo} on {env}: {', '.join(statuses)} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
