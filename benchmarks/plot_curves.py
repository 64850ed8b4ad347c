"""Learning curves (mean +- std over seeds) from one or more metrics.csv files, one colour per run.

    python benchmarks/plot_curves.py --run TruDi=runs/trudi/metrics.csv --run PPO=runs/ppo/metrics.csv \
        --title CartpoleBalance --out benchmarks/results/cartpole_cpu.png
"""
import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load_curve(path: str, x_key: str):
    """{x: [eval_return per seed]} from a metrics.csv."""
    points = defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            points[float(row[x_key])].append(float(row["eval_return"]))
    xs = sorted(points)
    return np.array(xs), np.array([np.mean(points[x]) for x in xs]), np.array([np.std(points[x]) for x in xs])


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="LABEL=path/to/metrics.csv")
    parser.add_argument("--x", default="env_steps", choices=["env_steps", "wall_s"])
    parser.add_argument("--title", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in args.run:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"error: --run expects LABEL=path, got {spec!r}")
        x, mean, std = load_curve(path, args.x)
        ax.plot(x, mean, marker="o", label=label)
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.set(xlabel="environment steps" if args.x == "env_steps" else "wall-clock seconds",
           ylabel="evaluation return", title=args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
