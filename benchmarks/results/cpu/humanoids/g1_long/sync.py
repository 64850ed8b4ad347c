"""Brings a running G1 long run's outputs into this folder and redraws what is drawn from them (run from anywhere):
its metrics.csv, config.json and newest checkpoint into run2/ (so that a new machine can resume it: the checkpoint
outside git was lost once, with run 1), the progress tables of README.md from both runs' metrics.csv, and curves.png.

    python benchmarks/results/cpu/humanoids/g1_long/sync.py --run-dir /work/g1_run2 --log /work/g1_run2_logs/part2.log

Without --run-dir it only redraws the tables and curves from what is committed here.
"""
import argparse
import csv
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, *[".."] * 5))
RUNS = {"run 1": os.path.join(HERE, "metrics.csv"), "run 2": os.path.join(HERE, "run2", "metrics.csv")}
COLUMNS = [("eval_return", "eval return", 2), ("eval_length", "eval length (steps)", 1),
           ("train_return", "training return", 2), ("train_length", "training length (steps)", 1)]


def table(path: str) -> str:
    """The progress table of one metrics.csv: a row per log point, '-' where a metric was not logged yet."""
    lines = ["| env steps | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    with open(path) as f:
        for row in csv.DictReader(f):
            cells = [f"{float(row[k]):.{digits}f}" if row.get(k) not in (None, "", "nan") else "-"
                     for k, _, digits in COLUMNS]
            lines.append(f"| {int(row['env_steps']):,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def redraw() -> None:
    readme = os.path.join(HERE, "README.md")
    with open(readme) as f:
        text = f.read()
    for name, path in RUNS.items():
        if os.path.exists(path):
            start, end = f"<!-- {name} table -->", f"<!-- end {name} table -->"
            text, n = re.subn(re.escape(start) + ".*?" + re.escape(end), f"{start}\n{table(path)}\n{end}", text,
                              flags=re.S)
            if n != 1:
                raise SystemExit(f"error: {readme} has no '{start}' ... '{end}' section")
    with open(readme, "w") as f:
        f.write(text)
    runs = [f"--run=TruDi {name}={path}" for name, path in RUNS.items() if os.path.exists(path)]
    floors = ["eval_return=-3.01=zero actions", "eval_return=-5.23=uniform random actions",
              "eval_length=54=zero actions", "eval_length=42=uniform random actions", "train_length=54=zero actions"]
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plot_curves.py"), *runs,
                    *[f"--y={y}" for y, _, _ in COLUMNS], *[f"--floor={f}" for f in floors],
                    "--title", "G1JoystickFlatTerrain (TruDi, cpu preset)", "--out", os.path.join(HERE, "curves.png")],
                   check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", help="the running run's --out-dir (its metrics.csv, config.json, checkpoint)")
    parser.add_argument("--log", action="append", default=[], help="a log of it to copy here (repeatable)")
    args = parser.parse_args()
    if args.run_dir:
        dest = os.path.join(HERE, "run2")
        os.makedirs(dest, exist_ok=True)
        for name in ("metrics.csv", "config.json", "checkpoint.msgpack"):
            shutil.copyfile(os.path.join(args.run_dir, name), os.path.join(dest, name + ".tmp"))
            os.replace(os.path.join(dest, name + ".tmp"), os.path.join(dest, name))
        for log in args.log:
            shutil.copyfile(log, os.path.join(dest, os.path.basename(log)))
    redraw()


if __name__ == "__main__":
    main()
