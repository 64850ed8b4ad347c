"""The reproduction scripts: a dying run is recorded, and the table reports failures and reference numbers."""
import math
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import plot  # noqa: E402
import reproduce  # noqa: E402


def test_reproduce_records_a_run_that_dies_instead_of_dropping_it():
    rows = reproduce.run_task("ppo", "NoSuchTask", seeds=2, preset="cpu", extra=[], log=lambda line: None)
    assert [r["seed"] for r in rows] == [0, 1]
    assert all(r["status"].startswith("failed: SystemExit: error: unknown env") for r in rows)
    assert all(math.isnan(r["eval_return"]) for r in rows)


def test_final_table_averages_last_points_over_seeds_and_lists_failures():
    rows = [dict(algo="trudi", env="CartpoleBalance", seed="0", env_steps="100", eval_return="500", status="ok"),
            dict(algo="trudi", env="CartpoleBalance", seed="0", env_steps="200", eval_return="900", status="ok"),
            dict(algo="trudi", env="CartpoleBalance", seed="1", env_steps="200", eval_return="1000", status="ok"),
            dict(algo="ppo", env="CartpoleBalance", seed="0", env_steps="0", eval_return="nan", status="failed: boom")]
    table = plot.final_table(rows)
    line = next(line for line in table.splitlines() if line.startswith("| CartpoleBalance"))
    assert "950.0 ± 50.0 (n=2)" in line  # the last point of each seed, not the earlier 500
    assert "999.5 ± 0.7" in line  # REPPO's published number, from benchmarks/reference/dmc_returns.csv
    assert "(failed runs)" in line and "failed: boom" in table


def curve_rows(algo, env, seed, returns, step=100):
    return [dict(algo=algo, env=env, seed=str(seed), env_steps=str(step * (i + 1)), eval_return=str(r), status="ok")
            for i, r in enumerate(returns)]


def test_table_reports_area_under_curve_and_whether_trudi_reaches_reppo():
    rows = (curve_rows("trudi", "PointMass", 0, [100, 500, 900]) + curve_rows("trudi", "PointMass", 1, [300, 700, 700])
            + curve_rows("reppo", "PointMass", 0, [200, 800, 850]) + curve_rows("reppo", "PointMass", 1, [200, 800, 850]))
    line = next(line for line in plot.final_table(rows).splitlines() if line.startswith("| PointMass"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # columns: task, reppo final, trudi final, reppo AUC, trudi AUC, verdict, steps, references
    assert cells[1] == "850.0 ± 0.0 (n=2)" and cells[2] == "800.0 ± 100.0 (n=2)"
    assert cells[3] == "616.7 ± 0.0"  # (200 + 800 + 850) / 3
    assert cells[4] == "533.3 ± 33.3"  # seeds 500 and 566.7
    assert cells[5] == "no (-50); no (-83)"
    assert cells[7] == "–"  # PointMass has no published number


def test_normalised_summary_bootstraps_over_seeds_within_tasks():
    rows = (curve_rows("ppo", "A", 0, [400]) + curve_rows("ppo", "A", 1, [600]) + curve_rows("ppo", "B", 0, [1000])
            + curve_rows("ppo", "B", 1, [1000]) + curve_rows("trudi", "A", 0, [800]) + curve_rows("trudi", "A", 1, [800])
            + curve_rows("trudi", "B", 0, [200]) + curve_rows("trudi", "B", 1, [200])
            + curve_rows("trudi", "C", 0, [1000]))  # C: only TruDi ran it, so it stays out of the summary
    tasks, algos, table = plot.normalised_summary(plot.runs(rows)[0], resamples=2000)
    assert tasks == ["A", "B"] and algos == ["ppo", "trudi"]
    point, low, high = table["ppo"]
    assert point == 0.75  # mean over tasks of (500, 1000) / 1000
    assert 0.7 - 1e-9 <= low < point < high <= 0.8 + 1e-9  # A's seed mean ranges over 400..600
    assert table["trudi"] == (0.5, 0.5, 0.5)  # identical seeds: no spread


def test_reproduce_skips_parts_already_done_and_gives_every_algorithm_one_budget(tmp_path, monkeypatch):
    calls = []

    def fake_run_task(algo, env, seeds, preset, extra, log=print, first_seed=0, separate=False):
        calls.append((algo, env, extra))
        return [dict(algo=algo, env=env, seed=s, env_steps=10, eval_return=1.0, wall_s=0.0, status="ok")
                for s in range(seeds)]

    monkeypatch.setattr(reproduce, "run_task", fake_run_task)
    out = str(tmp_path / "suite.csv")
    reproduce.main(["--algo", "ppo", "--tasks", "A,B", "--seeds", "2", "--out", out])
    reproduce.main(["--algo", "trudi", "--tasks", "A", "--seeds", "2", "--out", out])
    assert [c[:2] for c in calls] == [("ppo", "A"), ("ppo", "B"), ("trudi", "A")]
    assert all(c[2][-2:] == ["--total-steps", str(reproduce.CPU_BUDGET)] for c in calls)
    reproduce.main(["--algo", "ppo", "--tasks", "A,B,C", "--seeds", "2", "--out", out])  # continues with C only
    reproduce.main(["--algo", "ppo", "--tasks", "A", "--seeds", "3", "--out", out])  # seed 2 is missing: runs
    reproduce.main(["--algo", "ppo", "--tasks", "A", "--seeds", "2", "--out", out, "--rerun", "--total-steps", "50"])
    assert [c[:2] for c in calls[3:]] == [("ppo", "C"), ("ppo", "A"), ("ppo", "A")]
    assert calls[-1][2] == ["--total-steps", "50"]  # a given budget is kept, not doubled
    with open(out) as f:
        assert sum(1 for _ in f) == 1 + 2 + 2 + 2 + 2 + 3 + 2  # one header, every run's rows appended


def test_curves_draw_one_panel_per_column_and_skip_rows_without_a_value(tmp_path):
    """plot_curves.py --y A --y B: a panel each; rows written before a metric existed (empty) are left out of its
    panel, not read as 0; a column no row has is a one-line error."""
    import matplotlib.pyplot as plt
    import plot_curves
    path = tmp_path / "metrics.csv"
    path.write_text("env_steps,seed,eval_return,eval_length\n100,0,-3.5,\n200,0,-3.0,60\n300,0,-2.5,276\n")
    assert [list(v) for v in plot_curves.load_curve(str(path), "env_steps", "eval_length")] == [
        [200.0, 300.0], [60.0, 276.0], [0.0, 0.0]]
    out = tmp_path / "curves.png"
    plot_curves.main(["--run", f"TruDi={path}", "--y", "eval_return", "--y", "eval_length",
                      "--floor", "eval_length=54=zero actions", "--out", str(out)])
    image = plt.imread(out)
    assert image.shape[1] > 1.8 * image.shape[0] and image[..., :3].std() > 0.01  # two panels side by side
    with pytest.raises(SystemExit, match="has no column 'train_length'"):
        plot_curves.main(["--run", f"TruDi={path}", "--y", "train_length", "--out", str(out)])


def test_throughput_json_keeps_what_a_run_cut_short_measured(tmp_path, monkeypatch):
    """A GPU part stopped by its time limit: the JSON holds the finished task and, marked partial, the next task's
    warm-ups and finished rounds; the README tables leave the partial row out."""
    import readme_results
    import throughput
    blocks = {"n": 0}

    def fake(bench, env_name):
        def run_block():
            blocks["n"] += 1
            if blocks["n"] == 2 * 2 + 2 + 1:  # task A: 2 rounds x 2 runners; task B: round 1, then the limit
                raise KeyboardInterrupt
            return 0.5
        return throughput.Runner(1.0, 2.0, run_block, lambda: {}, 100)
    monkeypatch.setitem(throughput.RUNNERS, "ppo_jax", fake)
    monkeypatch.setitem(throughput.RUNNERS, "brax_ppo", fake)
    path = tmp_path / "gpu" / "throughput_cut.json"
    path.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        throughput.main(["--envs", "A", "B", "--runners", "ppo_jax", "brax_ppo", "--repeats", "2", "--no-flops",
                         "--json", str(path)])
    import json
    rows = json.loads(path.read_text())
    assert [r["env"] for r in rows] == ["A", "B"] and not rows[0].get("partial") and rows[1]["partial"]
    assert rows[0]["ppo_jax_sps"] == 200 and rows[0]["ratio"] == 1.0
    assert rows[1]["ppo_jax_sps_rounds"] == [200] and rows[1]["brax_ppo_sps_rounds"] == [200]
    assert rows[1]["ppo_jax_compile_s"] == 1.0 and "ppo_jax_sps" not in rows[1] and "command" in rows[1]
    monkeypatch.setattr(readme_results, "RESULTS", str(tmp_path))
    table = "\n".join(readme_results.throughput_tables("gpu"))
    assert "| A | 200 | 200 |" in table and "| B |" not in table


def test_gpu_check_commands_parse_and_write_under_out(tmp_path):
    """benchmarks/gpu_check.sh, both parts, with python3 and timeout replaced by recorders: every command it would
    run on a lent GPU parses with the current flags (a typo would waste the machine), names a known task and
    runner, writes under $OUT, and a part's time limits add up to at most 8 minutes."""
    import json
    import subprocess
    import throughput
    import trudi_jax
    from mujoco_playground import registry
    stubs, record = tmp_path / "bin", tmp_path / "commands.jsonl"
    stubs.mkdir()
    (stubs / "python3").write_text(  # `python3 -c ...` (the imports, machine.txt) runs; anything else is recorded
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
        f'exec {sys.executable} -c "import json, sys; open(\'{record}\', \'a\').write(json.dumps(sys.argv[1:]) + \'\\\\n\')" "$@"\n')
    (stubs / "timeout").write_text(f'#!/bin/sh\necho "$1" >> {tmp_path}/limits_$PART\nshift\nexec "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    for part in ("speed", "humanoid"):
        env = os.environ | {"PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out), "PART": part}
        done = subprocess.run(["bash", os.path.join(REPO_ROOT, "benchmarks", "gpu_check.sh"), part], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        limits = [int(x) for x in (tmp_path / f"limits_{part}").read_text().split()]
        assert len(limits) >= 2 and sum(limits) <= 8 * 60, (part, limits)
    commands = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(commands) == 4
    for argv in commands:
        script, args = argv[0], argv[1:]
        if script == "trudi_jax.py":
            cfg = trudi_jax.parse_config(args)
            trudi_jax.validate(cfg)
            assert cfg.preset == "paper" and cfg.env in registry.ALL_ENVS
            assert os.path.commonpath([cfg.out_dir, str(out)]) == str(out)
        else:
            assert script == "benchmarks/throughput.py"
            bench = throughput.parse_bench(args)
            assert bench.preset == "paper" and set(bench.runners) <= set(throughput.RUNNERS)
            assert all(e in registry.ALL_ENVS for e in bench.envs)
            assert os.path.dirname(bench.json) == str(out)
    assert (out / "machine.txt").exists()


def test_flop_count_of_trudi_grows_with_its_old_chains_and_exceeds_reppos():
    """throughput.py's FLOPs per env step (XLA's cost analysis of each piece of one iteration), at tiny sizes: the
    update's count grows with K (each old chain adds kernel evaluations), TruDi's diffusion actor costs more than
    REPPO's Gaussian one, and the pieces add up to the total."""
    import dataclasses
    import throughput
    import trudi_jax
    cfg = trudi_jax.Config(env="CartpoleBalance", num_envs=8, rollout_steps=4, num_minibatches=2, num_epochs=1,
                           actor_hidden=(16,), critic_hidden=(16,), num_bins=11, num_diffusion_steps=2,
                           num_old_chains=1, episode_length=50)
    k1 = throughput.flop_count(trudi_jax, cfg)
    k2 = throughput.flop_count(trudi_jax, dataclasses.replace(cfg, num_old_chains=2))
    reppo = throughput.flop_count(trudi_jax, dataclasses.replace(cfg, actor="gaussian"))
    assert k2["update_minibatch_flops"] > k1["update_minibatch_flops"] > reppo["update_minibatch_flops"] > 0
    assert k1["flops_per_step"] > reppo["flops_per_step"]
    assert math.isclose(sum(k1["flops_per_step_pieces"].values()), k1["flops_per_step"])


@pytest.mark.parametrize("name", ["ppo_jax", "trudi_jax"])
def test_checkpoint_and_device_benchmarks_build_what_the_files_accept(name, tmp_path):
    """benchmarks/checkpoint_io.py writes a header that read_checkpoint verifies, and benchmarks/devices.py a config
    that train takes (both were refused for a while: fields the algorithm files came to require)."""
    import importlib

    import numpy as np

    import checkpoint_io
    import devices
    module = importlib.import_module(name)
    cfg = module.preset_config("cpu", "CartpoleBalance")
    path = str(tmp_path / "checkpoint.msgpack")
    module.save_checkpoint(path, {"w": np.arange(3.0)}, checkpoint_io.header(module, cfg))
    meta, _ = module.read_checkpoint(path)
    assert module.config_from_dict(meta["config"], path) == cfg
    overrides = {"env": "CartpoleBalance", "total_steps": 4096, "num_evals": 2, "plot": False,
                 "out_dir": str(tmp_path / "run")}
    run_cfg = devices.make_config(module, overrides)
    module.validate(run_cfg)
    assert run_cfg.overwrite and run_cfg.num_envs == cfg.num_envs and run_cfg.total_steps == 4096
    assert module.config_from_dict(module.config_dict(run_cfg), "devices.py") == run_cfg
