"""Learning curves and a final-return table from reproduce.py's long-format CSVs.

    python benchmarks/plot.py benchmarks/results/cpu/reproduce.csv --out benchmarks/results/cpu/reproduce

writes <out>.png (one panel per task, one colour per algorithm, mean +- std over seeds) and <out>.md: per task and
algorithm the final evaluation return and the area under the curve (AUC: the mean evaluation return over the
run's evaluation points, i.e. the area divided by the run's length), mean +- std over seeds, whether TruDi >= REPPO
on each, next to the published REPPO / Brax-PPO numbers at 50M steps (benchmarks/reference/dmc_returns.csv); and
below it the normalised summary: per algorithm the mean over tasks of the final return / 1000 (DM Control's
maximum) with a 95 % bootstrap interval over seeds (seeds resampled within each task; only tasks every algorithm
ran), drawn in <out>_aggregate.png when there are 2+ tasks. Failed runs are listed, not averaged.
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


def runs(rows: list[dict]):
    """({(env, algo): {seed: [(steps, return), ...] by steps}} of the rows with status ok,
    {(env, algo): {status, ...}} of the others)."""
    points = defaultdict(lambda: defaultdict(list))
    failed = defaultdict(set)
    for r in rows:
        key = (r["env"], r["algo"])
        if r["status"] != "ok":
            failed[key].add(r["status"])
            continue
        points[key][r["seed"]].append((int(r["env_steps"]), float(r["eval_return"])))
    return {k: {seed: sorted(p) for seed, p in v.items()} for k, v in points.items()}, failed


def final_and_auc(curve: list[tuple[int, float]]) -> tuple[int, float, float]:
    """(last env steps, final return, AUC = mean return over the evaluation points) of one seed's curve."""
    return curve[-1][0], curve[-1][1], float(np.mean([r for _, r in curve]))


def mean_std(values) -> str:
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def final_table(rows: list[dict]) -> str:
    """Markdown: final eval return and AUC (mean +- std over seeds) per task and algorithm, TruDi >= REPPO per task,
    reference numbers; then the normalised summary."""
    by_run, failed = runs(rows)
    last = defaultdict(dict)  # (env, algo) -> seed -> (steps, final, auc)
    for key, seeds in by_run.items():
        for seed, curve in seeds.items():
            last[key][seed] = final_and_auc(curve)
    reference = {}
    if os.path.exists(REFERENCE):
        with open(REFERENCE) as f:
            reference = {r["task"]: r for r in csv.DictReader(f)}
    algos = sorted({a for _, a in list(last) + list(failed)})
    envs = sorted({e for e, _ in list(last) + list(failed)})
    compare = "trudi" in algos and "reppo" in algos
    header = (["task"] + [f"{a} (final)" for a in algos] + [f"{a} (AUC)" for a in algos]
              + (["TruDi >= REPPO (final; AUC)"] if compare else []) + ["steps", "REPPO 32k @50M", "Brax PPO @50M"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for env in envs:
        cells, aucs, steps = [env], [], set()
        for algo in algos:
            held = last.get((env, algo), {})
            if held:
                steps |= {s for s, _, _ in held.values()}
                cell = f"{mean_std([f for _, f, _ in held.values()])} (n={len(held)})"
                aucs.append(mean_std([a for _, _, a in held.values()]))
            else:
                cell = "–"
                aucs.append("–")
            if failed.get((env, algo)):
                cell += " (failed runs)"
            cells.append(cell)
        cells += aucs
        if compare:
            trudi, reppo = last.get((env, "trudi")), last.get((env, "reppo"))
            if trudi and reppo:
                verdicts = []
                for i in (1, 2):  # final, AUC
                    diff = np.mean([v[i] for v in trudi.values()]) - np.mean([v[i] for v in reppo.values()])
                    verdicts.append(f"{'yes' if diff >= 0 else 'no'} ({diff:+.0f})")
                cells.append("; ".join(verdicts))
            else:
                cells.append("–")
        ref = reference.get(env, {})
        cells.append(", ".join(f"{s:,}" for s in sorted(steps)))
        cells.append(f"{ref['reppo_32k_batch_at_50M']} ± {ref['reppo_32k_batch_std']}" if ref else "–")
        cells.append(f"{ref['brax_ppo_at_50M']} ± {ref['brax_ppo_std']}" if ref else "–")
        lines.append("| " + " | ".join(cells) + " |")
    failures = sorted({f"{e}/{a}: {s}" for (e, a), ss in failed.items() for s in ss})
    lines += [""] + ["Failed runs:"] + [f"- {f}" for f in failures] if failures else []
    summary = normalised_summary(by_run)
    if summary:
        tasks, algos_, table = summary
        lines += ["", f"Normalised final return (mean over {len(tasks)} tasks of final / 1000, 95 % bootstrap interval "
                  f"over seeds; tasks: {', '.join(tasks)}):", "", "| algorithm | normalised final | 95 % interval |",
                  "|---|---|---|"] + [f"| {a} | {p:.3f} | {lo:.3f} – {hi:.3f} |" for a, (p, lo, hi) in table.items()]
    return "\n".join(lines)


def normalised_summary(by_run, resamples: int = 10_000, seed: int = 0):
    """(tasks, algorithms, {algo: (mean over tasks of final / 1000, 2.5 %, 97.5 % bootstrap quantiles)}) over the
    tasks every algorithm ran; the bootstrap resamples each task's seeds with replacement. None if no such task."""
    algos = sorted({a for _, a in by_run})
    tasks = sorted(e for e in {e for e, _ in by_run} if all((e, a) in by_run for a in algos))
    if not tasks:
        return None
    rng = np.random.default_rng(seed)
    table = {}
    for algo in algos:
        finals = [np.array([c[-1][1] for c in by_run[(e, algo)].values()]) / 1000.0 for e in tasks]
        boot = np.mean([f[rng.integers(0, len(f), (resamples, len(f)))].mean(axis=1) for f in finals], axis=0)
        table[algo] = (float(np.mean([f.mean() for f in finals])), *np.quantile(boot, [0.025, 0.975]).tolist())
    return tasks, algos, table


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
    summary = normalised_summary(runs(rows)[0])
    if summary and len(summary[0]) >= 2:
        tasks, algos, table = summary
        fig, ax = plt.subplots(figsize=(1.3 * len(algos) + 2, 3.2))
        points = np.array([table[a][0] for a in algos])
        errors = np.array([[table[a][0] - table[a][1], table[a][2] - table[a][0]] for a in algos]).T
        ax.bar(algos, points, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(algos))])
        ax.set(ylabel="final return / 1000", ylim=(0, 1.05), title=f"mean over {len(tasks)} tasks, 95 % bootstrap CI")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(args.out + "_aggregate.png", dpi=110)
    table = final_table(rows)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
