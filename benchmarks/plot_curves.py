"""Learning curves (mean +- std over seeds) from one or more metrics.csv files, one colour per run; one panel per
--y column (default eval_return; rows where a column is empty or NaN, e.g. a metric added after they were
written, are left out of its panel).

    python benchmarks/plot_curves.py --run TruDi=runs/trudi/metrics.csv --run PPO=runs/ppo/metrics.csv \
        --title CartpoleBalance --out benchmarks/results/cartpole_cpu.png
    python benchmarks/plot_curves.py --run TruDi=benchmarks/results/cpu/humanoids/g1_long/metrics.csv \
        --y eval_return --y eval_length --floor "eval_length=54=zero actions" --title G1JoystickFlatTerrain \
        --out benchmarks/results/cpu/humanoids/g1_long/curves.png
"""
import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


LABELS = {"eval_return": "evaluation return", "eval_length": "evaluation episode length (steps)",
          "train_return": "training episodes' return", "train_length": "training episode length (steps)"}


def load_curve(path: str, x_key: str, y_key: str = "eval_return"):
    """x, mean and std over seeds of column y_key of a metrics.csv, at each x where it has a value."""
    points = defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            if y_key not in row:
                raise SystemExit(f"error: {path} has no column {y_key!r}")
            if row[y_key] not in ("", "nan"):
                points[float(row[x_key])].append(float(row[y_key]))
    xs = sorted(points)
    return np.array(xs), np.array([np.mean(points[x]) for x in xs]), np.array([np.std(points[x]) for x in xs])


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="LABEL=path/to/metrics.csv")
    parser.add_argument("--x", default="env_steps", choices=["env_steps", "wall_s"])
    parser.add_argument("--y", action="append", help="metrics.csv column, one panel each (default eval_return)")
    parser.add_argument("--floor", action="append", default=[],
                        help="COLUMN=VALUE=LABEL: a dashed reference line in that column's panel (e.g. a random policy's)")
    parser.add_argument("--title", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    columns = args.y or ["eval_return"]
    runs = [spec.partition("=")[::2] for spec in args.run]
    for spec, (_, path) in zip(args.run, runs):
        if not path:
            raise SystemExit(f"error: --run expects LABEL=path, got {spec!r}")
    floors = [spec.split("=", 2) for spec in args.floor]
    if any(len(f) != 3 for f in floors):
        raise SystemExit(f"error: --floor expects COLUMN=VALUE=LABEL, got {args.floor}")
    fig, axes = plt.subplots(1, len(columns), figsize=(6 * len(columns), 4), squeeze=False)
    for ax, column in zip(axes[0], columns):
        for label, path in runs:
            x, mean, std = load_curve(path, args.x, column)
            ax.plot(x, mean, marker="o", label=label)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        for i, (_, value, label) in enumerate(f for f in floors if f[0] == column):
            ax.axhline(float(value), color="grey", linestyle=("--", ":", "-.")[i % 3], label=label)
        ax.set(xlabel="environment steps" if args.x == "env_steps" else "wall-clock seconds",
               ylabel=LABELS.get(column, column), title=args.title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
