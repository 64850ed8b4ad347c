"""Learning curves and a final-return table from reproduce.py's long-format CSVs.

    python benchmarks/plot.py benchmarks/results/cpu/reproduce.csv --out benchmarks/results/cpu/reproduce

writes <out>.png (one panel per task, one colour per algorithm, mean +- std over seeds) and <out>.md (final
evaluation return per algorithm and task, mean +- std over seeds, next to the published REPPO / Brax-PPO
numbers at 50M steps from benchmarks/reference/dmc_returns.csv). Failed runs are listed, not averaged.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference", "dmc_returns.csv")


def load(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def curves(rows: list[dict]):
    """{env: {algo: (steps, mean, std)}} over the seeds with status ok."""
    points = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r["status"] == "ok":
            points[r["env"]][r["algo"]][int(r["env_steps"])].append(float(r["eval_return"]))
    out = {}
    for env, by_algo in points.items():
        out[env] = {}
        for algo, by_step in by_algo.items():
            steps = sorted(by_step)
            out[env][algo] = (np.array(steps), np.array([np.mean(by_step[s]) for s in steps]),
                              np.array([np.std(by_step[s]) for s in steps]))
    return out


def final_table(rows: list[dict]) -> str:
    """Markdown: final eval return (mean +- std over seeds) per task and algorithm, with reference numbers."""
    last = defaultdict(dict)  # (env, algo) -> seed -> (steps, return)
    failed = defaultdict(set)
    for r in rows:
        key = (r["env"], r["algo"])
        if r["status"] != "ok":
            failed[key].add(r["status"])
            continue
        seed, steps = r["seed"], int(r["env_steps"])
        if steps >= last[key].get(seed, (-1, 0))[0]:
            last[key][seed] = (steps, float(r["eval_return"]))
    reference = {}
    if os.path.exists(REFERENCE):
        with open(REFERENCE) as f:
            reference = {r["task"]: r for r in csv.DictReader(f)}
    algos = sorted({a for _, a in list(last) + list(failed)})
    envs = sorted({e for e, _ in list(last) + list(failed)})
    header = ["task"] + [f"{a} (final)" for a in algos] + ["steps", "REPPO 32k @50M", "Brax PPO @50M"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for env in envs:
        cells, steps = [env], set()
        for algo in algos:
            runs = last.get((env, algo), {})
            if runs:
                values = [v for _, v in runs.values()]
                steps |= {s for s, _ in runs.values()}
                cell = f"{np.mean(values):.1f} ± {np.std(values):.1f} (n={len(values)})"
            else:
                cell = "–"
            if failed.get((env, algo)):
                cell += " (failed runs)"
            cells.append(cell)
        ref = reference.get(env, {})
        cells.append(", ".join(f"{s:,}" for s in sorted(steps)))
        cells.append(f"{ref['reppo_32k_batch_at_50M']} ± {ref['reppo_32k_batch_std']}" if ref else "–")
        cells.append(f"{ref['brax_ppo_at_50M']} ± {ref['brax_ppo_std']}" if ref else "–")
        lines.append("| " + " | ".join(cells) + " |")
    failures = sorted({f"{e}/{a}: {s}" for (e, a), ss in failed.items() for s in ss})
    return "\n".join(lines + ([""] + ["Failed runs:"] + [f"- {f}" for f in failures] if failures else []))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="reproduce.py output files")
    parser.add_argument("--out", required=True, help="path prefix for <out>.png and <out>.md")
    args = parser.parse_args(argv)
    rows = load(args.csv)
    if not rows:
        raise SystemExit("error: no rows in " + ", ".join(args.csv))
    data = curves(rows)
    envs = sorted(data)
    if envs:
        cols = min(3, len(envs))
        fig, axes = plt.subplots(math.ceil(len(envs) / cols), cols, figsize=(4.5 * cols, 3.3 * math.ceil(len(envs) / cols)),
                                 squeeze=False)
        for ax, env in zip(axes.flat, envs):
            for algo, (x, mean, std) in sorted(data[env].items()):
                ax.plot(x, mean, label=algo)
                ax.fill_between(x, mean - std, mean + std, alpha=0.2)
            ax.set(title=env, xlabel="environment steps", ylabel="evaluation return")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(envs):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    table = final_table(rows)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
