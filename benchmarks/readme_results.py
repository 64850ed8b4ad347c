"""Regenerate the README's Results section from the files under benchmarks/results/.

    python benchmarks/readme_results.py          # rewrites README.md between the results markers

Sources: cpu/reproduce.csv (benchmarks/reproduce.py, one row per evaluation and seed), cpu/reproduce.md (+ .png;
benchmarks/plot.py), cpu/suite.csv / suite.md (+ .png, _aggregate.png: the CPU suite), cpu/throughput_*.json and cpu/flops_paper.json (benchmarks/throughput.py) and gpu/*.json
(benchmarks/gpu_check.sh), each with the command that produced it.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
START, END = "<!-- results:start (benchmarks/readme_results.py) -->", "<!-- results:end -->"
ALGO_LABELS = {"trudi": "TruDi", "trudi_reverse": "TruDi, `--kl-direction reverse`", "reppo": "REPPO (`--actor gaussian`)",
               "ppo": "PPO (`ppo_jax.py`)"}


def seed_table(path: str) -> list[str]:
    """Per algorithm on each task of a reproduce.py CSV: per seed, the first evaluation >= 950 and the final one."""
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    lines = ["| task | algorithm | seeds >= 950 | first eval >= 950, per seed (env steps) | lowest eval after it | "
             "final eval, per seed | median per-iteration KL | wall s per seed (median) |", "|---|---|---|---|---|---|---|---|"]
    for env in sorted({r["env"] for r in rows}):
        for algo in ALGO_LABELS:
            runs = {}
            for r in rows:
                if r["env"] == env and r["algo"] == algo:
                    runs.setdefault(r["seed"], []).append(r)
            if not runs:
                continue
            firsts, lows, finals, kls, walls = [], [], [], [], []
            for seed in sorted(runs, key=int):
                run = sorted(runs[seed], key=lambda r: int(r["env_steps"]))
                first = next((int(r["env_steps"]) for r in run if float(r["eval_return"]) >= 950), None)
                firsts.append(f"{first // 1000}k" if first else "never")
                after = [float(r["eval_return"]) for r in run if first and int(r["env_steps"]) >= first]
                lows.append(f"{min(after):.0f}" if after else "–")
                finals.append(f"{float(run[-1]['eval_return']):.0f}")
                kls += [float(r["kl_median"]) for r in run if r.get("kl_median")]
                walls.append(float(run[-1]["wall_s"]))
            reached = sum(f != "never" for f in firsts)
            budget = max(int(r["env_steps"]) for seed in runs for r in runs[seed])
            kl = f"{statistics.median(kls):.3f}" if kls else "–"
            lines.append(f"| {env} | {ALGO_LABELS[algo]} | {reached} of {len(runs)} (budget {budget // 1000}k) | "
                         f"{', '.join(firsts)} | {', '.join(lows)} | {', '.join(finals)} | {kl} | "
                         f"{statistics.median(walls):.0f} |")
    return lines


FLOP_FILES = (("flops_paper.json", "trudi", "TruDi (K = 4)"), ("flops_paper_K1.json", "trudi", "TruDi K = 1"),
              ("flops_paper_reverse.json", "trudi", "TruDi reverse KL"), ("flops_paper.json", "reppo", "REPPO"),
              ("flops_paper_ppo.json", "ppo_jax", "PPO"))


def flops_table(folder: str) -> list[str]:
    """FLOPs per env step at --preset paper, one column per (file, runner) of FLOP_FILES that exists."""
    columns, commands = [], []
    for name, runner, label in FLOP_FILES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = {row["env"]: row for row in json.load(f)}
        if f"{runner}_flops_per_step" in next(iter(rows.values())):
            columns.append((label, runner, rows))
            first = next(iter(rows.values()))
            if (first["command"], first["date"]) not in commands:
                commands.append((first["command"], first["date"]))
    if not columns:
        return []
    reppo = next((rows for label, runner, rows in columns if runner == "reppo"), None)
    lines = ["FLOPs per environment step of one iteration at `--preset paper`: XLA's cost analysis of each piece "
             "compiled alone with its scans unrolled; the physics' solver loops count once, so the environment share "
             "is a lower bound. In brackets: the update's share; for TruDi, × REPPO's count. Commands: "
             + "; ".join(f"`{c}` ({d})" for c, d in commands) + ".", "",
             "| task | " + " | ".join(label for label, _, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for env in columns[0][2]:
        cells = []
        for label, runner, rows in columns:
            flops = rows[env][f"{runner}_flops_per_step"]
            note = f"{rows[env][f'{runner}_flops_per_step_pieces']['update'] / flops:.0%}"
            if runner == "trudi" and reppo:
                note += f", {flops / reppo[env]['reppo_flops_per_step']:.2f}×"
            cells.append(f"{flops / 1e6:,.1f} M ({note})")
        lines.append(f"| {env} | " + " | ".join(cells) + " |")
    before = os.path.join(folder, "flops_paper_3f8fe32.json")
    if os.path.exists(before):  # the code before the old chains were drawn once per iteration
        with open(before) as f:
            rows = json.load(f)
        lines += ["", "Before the trust region's old samples were drawn once per iteration (commit 3f8fe32: K fresh old "
                  "chains per minibatch, a second Gaussian pass; `flops_paper_3f8fe32.json`): " + "; ".join(
                      f"{r['env']} TruDi {r['trudi_flops_per_step'] / 1e6:,.1f} M, REPPO "
                      f"{r['reppo_flops_per_step'] / 1e6:,.1f} M ({r['trudi_flops_per_step_vs_reppo']:.2f}×)"
                      for r in rows) + "."]
    return lines + [""]


def throughput_tables(folder: str) -> list[str]:
    lines = []
    for path in sorted(glob.glob(os.path.join(RESULTS, folder, "throughput*.json"))):
        with open(path) as f:
            rows = [row for row in json.load(f) if not row.get("partial")]  # partial: cut short by a time limit
        if not rows:
            continue
        names = [n for n in ("ppo_jax", "brax_ppo", "trudi", "trudi_plain", "trudi_gated", "trudi_gated_f32", "trudi_k1", "reppo",
                             "ppo_jax_rollout", "brax_rollout") if f"{n}_sps" in rows[0]]
        extra = rows[0]
        if extra.get("preset") in ("paper", "cpu"):
            shape = f"each runner at its {extra['preset']} preset: " + "; ".join(
                f"{n} {c['num_envs']} envs x {c['rollout_steps']} steps, {c['num_minibatches']} minibatches, "
                f"{c['num_epochs']} epochs" for n in names if (c := extra.get(f"{n}_config")))
            shape += f", median of {extra['repeats']} blocks of {extra['iterations_per_block']} iteration(s)"
        else:
            shape = (f"{extra['num_envs']} envs x {extra['rollout_steps']} steps, {extra['num_minibatches']} "
                     f"minibatches, {extra['num_epochs']} epochs, median of {extra['repeats']} blocks of "
                     f"{extra['steps_per_block']:,} steps")
        lines += [f"`{extra['command']}` ({extra['date']}, {extra['device']}, jax {extra['jax']}, brax {extra['brax']}; "
                  f"{shape}):", ""]
        header = ["task"] + [f"{n} steps/s" for n in names] + [f"{n} compile s" for n in names]
        ratios = []
        if "ratio" in rows[0]:
            ratios.append(("ratio", "ppo_jax / Brax PPO"))
        if "rollout_ratio" in rows[0]:
            ratios.append(("rollout_ratio", "rollout alone: ppo_jax / Brax"))
        if "trudi_time_per_step_vs_reppo" in rows[0]:
            ratios.append(("trudi_time_per_step_vs_reppo", "TruDi time per step / REPPO's"))
        for variant, label in (("plain", "plain gradient"), ("gated", "gated gradient"),
                               ("gated_f32", "gated gradient, float32 gates"), ("k1", "K = 1")):
            if f"trudi_{variant}_time_per_step_vs_reppo" in rows[0]:
                ratios.append((f"trudi_{variant}_time_per_step_vs_reppo", f"TruDi, {label}, time per step / REPPO's"))
        gates = [(f"{n}_gate_frac_blocks", n) for n in ("trudi", "trudi_gated", "trudi_gated_f32")
                 if f"{n}_gate_frac_blocks" in rows[0]]
        split = [(f"{n}_{part}_us_per_step", f"{label} {part} µs/step") for n, label in
                 (("ppo_jax", "ppo_jax"), ("brax_ppo", "Brax")) for part in ("rollout", "update")
                 if f"{n}_{part}_us_per_step" in rows[0]]
        ratios += split
        header += [label for _, label in ratios] + [f"{n} closed gates, per block (the first: warm-up)" for _, n in gates]
        per_million = extra.get("preset") == "cpu"  # a task's cost in the CPU suite
        header += [f"{n} min per 1M steps" for n in names if per_million]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = ([row["env"]] + [f"{row[f'{n}_sps']:,.0f}" for n in names]
                     + [f"{row[f'{n}_compile_s']:.1f}" for n in names] + [f"{row[key]:.2f}" for key, _ in ratios]
                     + [", ".join(f"{g:.2f}" for g in row[key]) for key, _ in gates]
                     + [f"{1e6 / row[f'{n}_sps'] / 60:.1f}" for n in names if per_million])
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def run_management() -> list[str]:
    lines = []
    for folder in ("cpu", "gpu"):
        path = os.path.join(RESULTS, folder, "checkpoint_io.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            info = json.load(f)
        lines += [f"Checkpoints (`{info['command']}`; {info['date']}, {info['machine']}, jax {info['jax']}): the whole "
                  "train state, median of 3 writes (device -> host, msgpack, sha256, fsync, rename) and reads "
                  "(read, verify, restore onto the devices).", "",
                  "| algorithm | task, preset | envs | size | of which env states + reset pool | write | read |",
                  "|---|---|---|---|---|---|---|"]
        for r in info["results"]:
            lines.append(f"| {r['algo']} | {r['env']}, {r['preset']} | {r['num_envs']} | {r['size_mib']:.1f} MiB | "
                         f"{r['env_state_mib']:.1f} MiB | {r['write_s_median']:.2f} s | {r['read_s_median']:.2f} s |")
        lines.append("")
    path = os.path.join(RESULTS, "cpu", "devices.json")
    if os.path.exists(path):
        with open(path) as f:
            info = json.load(f)
        lines += [f"Environments split across 2 forced CPU devices vs 1 (`{info['command']}`; {info['date']}, "
                  f"{info['machine']}; `--preset cpu` on {info['config']['env']}, "
                  f"{info['config']['total_steps']:,} steps). Both device counts share the same 2 cores, so this "
                  "measures the cost of partitioning, not a speed-up.", "",
                  "| algorithm | devices | steps/s | vs 1 device | max relative metric difference, first log point | "
                  "over the run (worst metric) |", "|---|---|---|---|---|---|"]
        base = {r["algo"]: r["steps_per_sec"] for r in info["results"] if r["devices"] == 1}
        for r in info["results"]:
            lines.append(f"| {r['algo']} | {r['devices']} | {r['steps_per_sec']:,.0f} | "
                         f"{r['steps_per_sec'] / base[r['algo']]:.2f}x | {r['max_rel_diff_first_log_point']:.1e} | "
                         f"{r['max_rel_diff']:.1e} ({r['worst_metric']}) |")
        lines += ["", "At the first log point the runs differ by float32 rounding carried through a few updates; later they",
                  "drift apart as any two runs with a different order of floating-point sums do (the training dynamics",
                  "are chaotic), and relative differences of quantities near zero (entropy) look large. The tests",
                  "compare 1 and 2 devices over a short run with rtol 1e-4.", ""]
    for png in sorted(glob.glob(os.path.join(RESULTS, "cpu", "video", "*.png"))):
        rel = os.path.relpath(png, ROOT)
        lines += [f"A frame of `{rel[:-4]}.mp4` (`--video`, one evaluation episode rendered headless):", "",
                  f"![video frame]({rel})", ""]
        log = png[:-4] + "_eval_only.log"
        if os.path.exists(log):
            with open(log) as f:
                lines += ["```", f.read().strip(), "```", "",
                          "(the output of the date in its first line; since 2026-12-07 the line also gives the "
                          "episodes' mean length, `over 100 episodes of L steps on average`)", ""]
    return lines


def section() -> str:
    out = ["Generated by `python benchmarks/readme_results.py` from `benchmarks/results/` (raw metrics, logs and",
           "JSON there, each with its command, date, machine and versions). CPU: a 2-core x86-64 machine without",
           "accelerator, Python 3.11, JAX 0.10.2, Playground 0.2.0, MJX 3.17.0 (`requirements.txt`).", ""]
    seeds_csv = os.path.join(RESULTS, "cpu", "reproduce.csv")
    if os.path.exists(seeds_csv):
        out += ["### Learning on CPU: `--preset cpu`, one run per seed", "",
                "None of the seeds the preset was chosen on: PPO 100-103, REPPO 100-103 and 200-203, TruDi 300-303 and",
                "400-403 (run 2026-12-06 with its defaults, the floor of beta 1e-2 and the annealed learning rate; its",
                "earlier rows are in `reproduce_03ff26f_trudi_constant_lr.csv` (constant rate, seeds 200-203 and 300-303)",
                "and `reproduce_3bb3e98_trudi_beta_min_1e-3.csv`; the `--kl-direction reverse` rows predate both, commit",
                "e39b58b), each the single-seed command, e.g.",
                "`python trudi_jax.py --env CartpoleBalance --preset cpu --seed 100` (`--actor gaussian` for REPPO;",
                "`python ppo_jax.py ... --seed 100`). A constant zero action scores about 697 on CartpoleBalance",
                "(random: 250-300), so only returns well above 700 show learning.", ""] + seed_table(seeds_csv) + [""]
    reproduction = os.path.join(RESULTS, "cpu", "reproduce.md")
    if os.path.exists(reproduction):
        with open(reproduction) as f:
            table = f.read().strip()
        out += ["### CPU reproduction: TruDi, REPPO, PPO (`benchmarks/reproduce.py`, commands in "
                "`benchmarks/results/cpu/README.md`)", "",
                "Final evaluation return, mean ± std over seeds, next to the published numbers at 50M steps (the runs "
                "of the table above; wall time per seed there).",
                "", "![reproduction curves](benchmarks/results/cpu/reproduce.png)", "", table, ""]
    suite = os.path.join(RESULTS, "cpu", "suite.md")
    if os.path.exists(suite):
        with open(suite) as f:
            table = f.read().strip()
        with open(os.path.join(RESULTS, "cpu", "suite.csv")) as f:
            parts = {(r["algo"], r["env"]) for r in csv.DictReader(f)}
        tasks = {env for _, env in parts}
        done = ", ".join(f"{algo} {sum(a == algo for a, _ in parts)}" for algo in sorted({a for a, _ in parts}))
        complete = len(parts) == len(tasks) * len({a for a, _ in parts})  # every algorithm on every task
        count = f"{len(tasks)} tasks" if complete else f"{len(tasks)} tasks so far; tasks per algorithm: {done}"
        out += [f"### CPU suite: TruDi, REPPO and PPO on DM Control tasks, 3 seeds each ({count})", "",
                "`python benchmarks/reproduce.py --algo A --tasks T --seeds 3 --out benchmarks/results/cpu/suite.csv` "
                "per algorithm and task (the three seeds vmapped in one program, `--preset cpu`, the same 1.2M env "
                "steps per seed for every algorithm); figures and table by `python benchmarks/plot.py "
                "benchmarks/results/cpu/suite.csv --out benchmarks/results/cpu/suite`. Curves: mean ± std over "
                "seeds. The published numbers are at 50M steps with 1024 envs, ours at 1.2M with 64.", "",
                "![suite curves](benchmarks/results/cpu/suite.png)", ""]
        if os.path.exists(os.path.join(RESULTS, "cpu", "suite_aggregate.png")):
            out += ["![suite summary](benchmarks/results/cpu/suite_aggregate.png)", ""]
        out += [table, ""]
    cpu = throughput_tables("cpu")
    if cpu:
        out += ["### Speed on CPU (`benchmarks/throughput.py`)", "",
                "Identical settings per table; compile time reported separately; runners timed alternately.", ""] + cpu
    out += flops_table(os.path.join(RESULTS, "cpu"))
    managed = run_management()
    if managed:
        out += ["### Checkpoints, devices, video", ""] + managed
    gpu = throughput_tables("gpu")
    if gpu:
        gpu = ["One NVIDIA H200 (details, the FLOP comparison and what did not fit: "
               "`benchmarks/results/gpu/README.md`).", ""] + gpu
    out += ["### GPU", ""] + (gpu or ["Not measured yet: no accelerator was available to the sessions so far. "
                                      "`benchmarks/gpu_check.sh` is ready (one H200, < 8 minutes).", ""])
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"error: README.md lacks the markers {START!r} ... {END!r}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as f:
        f.write(head + START + "\n" + section() + END + tail)
    print(f"updated {path}")


if __name__ == "__main__":
    main()
