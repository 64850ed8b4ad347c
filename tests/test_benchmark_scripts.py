"""The measurement scripts under benchmarks/ that no other test runs, each end to end at tiny sizes against today's
algorithm files: they rot silently otherwise (two did: a field added to a NamedTuple, a header the reader came to
verify), and the committed results say how to re-run them. Each test also checks one thing the script exists to
show, so that a script that runs but measures the wrong thing fails too."""
import json
import math
import os
import runpy
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO_ROOT, "benchmarks")
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, BENCH)


def run_script(name: str, argv: list[str], monkeypatch) -> None:
    """Runs benchmarks/<name> as `python benchmarks/<name> *argv` does, in this process (compiled code and the
    imported packages shared with the other tests)."""
    monkeypatch.setattr(sys, "argv", [os.path.join(BENCH, name), *argv])
    runpy.run_path(os.path.join(BENCH, name), run_name="__main__")


def read(path) -> dict | list:
    with open(path) as f:
        return json.load(f)


def test_random_floor_runs_whole_episodes_of_either_policy(tmp_path):
    """random_floor.py: CartpoleBalance never terminates, so every episode lasts the time limit and its return (a
    reward in [0, 1] per step) lies in [0, L]; uniform random actions and zero actions give different returns."""
    import random_floor
    rows = {}
    for policy in ("uniform", "zero"):
        out = tmp_path / f"{policy}.json"
        random_floor.main(random_floor.Args(envs=("CartpoleBalance",), episodes=4, episode_length=12, policy=policy,
                                            json=str(out)))
        (row,) = read(out)
        prefix = "random" if policy == "uniform" else "zero_action"
        assert row["env"] == "CartpoleBalance" and row["episodes"] == 4 and row["command"] and row["jax"]
        assert row[f"{prefix}_length_mean"] == 12
        assert 0 <= row[f"{prefix}_return_mean"] <= 12 and row[f"{prefix}_return_std"] >= 0
        rows[policy] = row[f"{prefix}_return_mean"]
    assert rows["uniform"] != rows["zero"]


def test_eval_early_stop_matches_the_fixed_length_scan_it_replaced(tmp_path, monkeypatch):
    """eval_early_stop.py: the evaluation that stops once every episode ended and the former fixed-length scan give
    the same returns and lengths (here no episode ends early: both step the whole time limit)."""
    out = tmp_path / "early_stop.json"
    run_script("eval_early_stop.py", ["--env", "CartpoleBalance", "--episodes", "3", "--episode-length", "10",
                                      "--json", str(out)], monkeypatch)
    res = read(out)
    for new, old in zip(res["stops_when_all_ended"]["runs"], res["fixed_length_scan"]["runs"]):
        assert new["length"] == old["length"] == 10
        assert math.isclose(new["return"], old["return"], rel_tol=1e-5)
    assert res["stops_when_all_ended"]["runs"][0]["return"] != res["stops_when_all_ended"]["runs"][1]["return"]


def test_seed_axis_times_the_four_layouts_it_names(tmp_path, monkeypatch):
    """seed_axis.py: one row per layout, each stepping seeds x envs_per_seed environments at a positive rate."""
    import seed_axis
    out = tmp_path / "seed_axis.json"
    monkeypatch.setattr(sys, "argv", ["seed_axis.py", "--env", "CartpoleBalance", "--num-envs", "2", "--num-seeds",
                                      "3", "--steps", "2", "--repeats", "1", "--json", str(out)])
    seed_axis.main()
    rows = read(out)["results"]
    assert [(r["seeds"], r["envs_per_seed"], r["seed_vmap"]) for r in rows] == [
        (1, 2, False), (1, 2, True), (1, 6, False), (3, 2, True)]
    assert all(r["steps_per_sec"] > 0 and len(r["steps_per_sec_rounds"]) == 1 for r in rows)
    monkeypatch.setattr(sys, "argv", ["seed_axis.py", "--repeats", "0"])
    with pytest.raises(SystemExit, match="must be positive"):
        seed_axis.main()


def test_bf16_matmul_gradient_error_is_small_and_bf16_gate_c_grows_with_the_parameter_distance(tmp_path, monkeypatch):
    """bf16_matmul.py: bfloat16 products with float32 accumulation change a 3 x 512 MLP's gradient by well under
    5 % per layer. bf16_gate.py: the gates' c(s) grows with the distance between new and old parameters (the scales),
    its bfloat16 error stays a small fraction of c (smaller where c is larger), and the counts of closed gates are
    fractions of the states."""
    out = tmp_path / "matmul.json"
    run_script("bf16_matmul.py", ["--rows", "16", "--json", str(out)], monkeypatch)
    res = read(out)
    assert len(res["grad_rel_err"]) == 4 and all(0 < e < 0.05 for e in res["grad_rel_err"])
    assert all(res[n]["ms"] > 0 for n in ("grad_f32", "grad_bf16", "fwd_f32", "fwd_bf16"))

    out = tmp_path / "gate.json"
    run_script("bf16_gate.py", ["--rows", "32", "--scales", "0.01", "0.1", "--repeats", "1", "--json", str(out)],
               monkeypatch)
    res = read(out)
    small, large = res["errors"]
    assert res["K"] == 4 and res["N"] == 8 and res["actor_hidden"] == [512, 512, 512]  # the paper preset's actor
    assert 0 < small["c_median"] < large["c_median"]
    assert all(0 <= row["closed_frac"] <= 1 and 0 <= row["gate_flips"] <= 32 for row in res["errors"])
    # relative error of c: 2.5 % and 0.19 % median at these scales in the committed run (2,048 states)
    assert small["rel_err_median"] < 0.1 and large["rel_err_median"] < 0.02
    assert res["ms_f32"] > 0 and res["ms_bf16"] > 0


def test_profile_update_counts_more_flops_for_trudi_than_reppo(tmp_path):
    """profile_update.py at the cpu preset with tiny networks, batch and chain (flags after --), the whole update
    only: both runners timed and FLOP-counted, TruDi's update needs more FLOPs than REPPO's (its chain and trust
    region), and the ratios it reports are those of the rows it wrote."""
    import profile_update
    out = tmp_path / "profile.json"
    res = profile_update.main(["--env", "CartpoleBalance", "--preset", "cpu", "--repeats", "1", "--warm-steps", "0",
                               "--pieces", "update", "--json", str(out), "--", "--num-envs", "8", "--rollout-steps",
                               "4", "--num-minibatches", "2", "--actor-hidden", "16", "16", "--critic-hidden", "16",
                               "--num-bins", "11", "--num-diffusion-steps", "2"])
    assert read(out) == json.loads(json.dumps(res))
    t, r = res["trudi"]["update"], res["reppo"]["update"]
    assert t["seconds"] > 0 and r["seconds"] > 0 and t["flops"] > r["flops"] > 0
    assert math.isclose(res["update_flop_ratio"], t["flops"] / r["flops"])
    assert math.isclose(res["update_time_ratio"], t["seconds"] / r["seconds"])
    assert 0 <= res["trudi"]["gate_frac"] <= 1


def test_profile_ppo_update_floor_is_a_part_of_ppo_jax_and_brax_does_the_same_work(tmp_path):
    """profile_ppo_update.py: the floor (the same networks forward and backward, Adam) counts fewer FLOPs than
    ppo_jax's PPO step, one epoch's step adds its permutation and gather to the step, and Brax's step with networks
    of the same widths lands within 1.5x of ppo_jax's FLOPs (the same dense layers; GAE and normalisation inside)."""
    import profile_ppo_update
    out = tmp_path / "ppo_profile.json"
    res = profile_ppo_update.main(["--env", "CartpoleBalance", "--steps", "8", "--repeats", "1", "--json", str(out)])
    p = read(out)["pieces"]
    assert 0 < p["floor"]["flops_per_minibatch_step"] < p["ppo_jax"]["flops_per_minibatch_step"]
    assert p["ppo_jax_epoch"]["flops_per_minibatch_step"] >= p["ppo_jax"]["flops_per_minibatch_step"]
    assert 1 / 1.5 < res["brax_over_ppo_jax_flops"] < 1.5
    assert all(row["ms_per_minibatch_step"] > 0 for row in p.values())
