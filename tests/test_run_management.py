"""Checkpoints, resume, evaluation of a saved policy, video, failure handling, devices and logging sinks.

Run-management code is duplicated in ppo_jax.py and trudi_jax.py (each file stands alone): test both copies.
One short CartpoleBalance run per algorithm (checkpoint every log point) is shared by most tests.
"""
import csv
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import types

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_jax
import trudi_jax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = pytest.mark.parametrize("algo", [ppo_jax, trudi_jax], ids=["ppo", "trudi"])
# the runs whose resume is checked bit for bit: PPO, TruDi, and REPPO (TruDi's Gaussian actor) with 2 seeds
RUNS = pytest.mark.parametrize("kind", ["ppo", "trudi", "reppo"])
TIMING = ("wall_s", "steps_per_sec")  # the only columns allowed to differ between identical runs


def tiny(algo, out_dir, **overrides):
    """A CartpoleBalance run of 3 log points x 2 iterations that compiles in well under a minute on CPU. Without
    evaluation episodes (--num-eval-envs 0), which would add a third copy of the physics to the program (init,
    rollout, evaluation: ~35 % of its compile time); the tests of evaluation turn them on."""
    common = dict(env="CartpoleBalance", num_envs=8, rollout_steps=8, num_minibatches=2, num_epochs=1,
                  total_steps=8 * 8 * 2 * 3, num_evals=3, num_eval_envs=0, episode_length=50, out_dir=str(out_dir),
                  plot=False, checkpoint_every=1, keep_checkpoints=2)
    if algo is trudi_jax:
        common.update(actor_hidden=(16,), critic_hidden=(16,), num_bins=11, num_diffusion_steps=2)
    else:
        common.update(policy_hidden=(16,), value_hidden=(16,))
    return algo.Config(**(common | overrides))


KINDS = {"ppo": (ppo_jax, {}), "trudi": (trudi_jax, {}),
         "reppo": (trudi_jax, dict(actor="gaussian", num_seeds=2, num_eval_envs=2))}  # with evaluation episodes


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted reference run of an algorithm (or a kind of KINDS): (config, rows); its checkpoints
    (the newest and the one before, keep_checkpoints=2) are in cfg.out_dir."""
    runs = {}

    def get(kind):
        kind = kind if isinstance(kind, str) else kind.__name__[:-len("_jax")]
        if kind not in runs:
            algo, overrides = KINDS[kind]
            cfg = tiny(algo, tmp_path_factory.mktemp(kind + "_full"), **overrides)
            runs[kind] = cfg, algo.train(cfg, log=lambda line: None)
            with open(os.path.join(cfg.out_dir, "metrics.csv")) as f:  # the file holds what train returned
                saved = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
            assert [list(r) for r in saved] == [list(r) for r in runs[kind][1]]
            assert all(a[k] == b[k] or math.isnan(a[k]) and math.isnan(b[k])
                       for a, b in zip(saved, runs[kind][1], strict=True) for k in a)
        return runs[kind]
    return get


def resign(algo, path, new_path, edit_meta=None, edit_payload=None, header=None, magic=None):
    """Copy a checkpoint with its header (or payload) changed and a valid checksum: a crafted file."""
    with open(path, "rb") as f:
        old_magic, old_header, _, payload = f.readline(), f.readline(), f.readline(), f.read()
    if header is None:
        meta = json.loads(old_header)
        header = json.dumps(edit_meta(meta) if edit_meta else meta).encode() + b"\n"
    if edit_payload:
        payload = edit_payload(payload)
    digest = hashlib.sha256(header + payload).hexdigest().encode() + b"\n"
    with open(new_path, "wb") as f:
        f.write((magic or old_magic) + header + digest + payload)
    return str(new_path)


def strip_timing(rows):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def assert_rows_equal(a, b):
    """Exactly equal (NaN == NaN), timing columns aside."""
    assert len(a) == len(b)
    for x, y in zip(strip_timing(a), strip_timing(b)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), (k, x[k], y[k])


def assert_ends_as_reference(algo, cfg, reference, run_dir, rows):
    """A continued run in run_dir: the reference's rows (returned and in metrics.csv) and, array by array, its
    final train state."""
    assert_rows_equal(rows, reference)
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(reference)
    _, a = algo.read_checkpoint(os.path.join(cfg.out_dir, "checkpoint.msgpack"))
    _, b = algo.read_checkpoint(os.path.join(run_dir, "checkpoint.msgpack"))
    assert a == b


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume
# ---------------------------------------------------------------------------------------------
@RUNS
def test_resumed_run_reproduces_uninterrupted_run_bit_exactly(kind, full_run, tmp_path, monkeypatch):
    """Interrupted after its 2nd log point and resumed: the same metric rows and the same final train state, for
    PPO, TruDi and the Gaussian actor with 2 seeds; the resumed run continues the same W&B run."""
    algo, overrides = KINDS[kind]
    cfg, reference = full_run(kind)
    inits, logged = [], []
    fake_run = types.SimpleNamespace(id="run-abc123", log=lambda row, step: logged.append(row), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: inits.append(kw) or fake_run))
    interrupted = tiny(algo, tmp_path / "run", wandb=True, **overrides)

    def ctrl_c_after_second_log_point(line):
        if f"steps {2 * 8 * 8 * 2:,} " in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        algo.train(interrupted, log=ctrl_c_after_second_log_point)
    meta, _ = algo.read_checkpoint(str(tmp_path / "run" / "checkpoint.msgpack"))
    assert meta["chunks_done"] == 2 and meta["wandb_id"] == "run-abc123"

    resumed_cfg = algo.parse_config(["--resume", str(tmp_path / "run"), "--checkpoint-every", "1", "--wandb"])
    assert resumed_cfg.out_dir == str(tmp_path / "run") and resumed_cfg.num_envs == 8  # the saved config
    lines = []
    rows = algo.train(resumed_cfg, log=lines.append)
    assert any(f"resuming {tmp_path / 'run' / 'checkpoint.msgpack'} after {2 * 8 * 8 * 2:,} env steps" in line
               for line in lines)
    progress = [line for line in lines if " steps/s " in line]  # only the third log point was trained again
    assert len(progress) == 1 and f"steps {3 * 8 * 8 * 2:,} " in progress[0]
    assert rows[:2 * cfg.num_seeds] == meta["rows"]  # the rows before the interruption, timings included
    assert len(rows) == len(reference) == 3 * cfg.num_seeds
    assert_ends_as_reference(algo, cfg, reference, str(tmp_path / "run"), rows)
    assert inits[0].get("id") is None and inits[1]["id"] == "run-abc123" and inits[1]["resume"] == "allow"
    keys = {k for row in logged for k in row}  # W&B keys: each seed's under its own prefix where there are several
    if cfg.num_seeds > 1:
        assert {k.split("/")[0] for k in keys} == {"seed0", "seed1"} and "seed1/eval_return" in keys
    else:
        assert "eval_return" in keys and not any("/" in k for k in keys)


def test_gaussian_actor_rows_are_finite_and_per_seed(full_run):
    cfg, rows = full_run("reppo")
    assert [(r["env_steps"], r["seed"]) for r in rows] == [(s, i) for s in (128, 256, 384) for i in (0, 1)]
    for key in ("eval_return", "eval_length", "steps_per_sec", "kl", "entropy", "alpha", "beta", "critic_loss", "q_mean"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[-2]["eval_return"] != rows[-1]["eval_return"]  # two seeds, not one copied


@ALGOS
def test_curve_of_a_run_is_written_as_png(algo, full_run, tmp_path):
    _, rows = full_run(algo)
    algo.plot_curve(rows, str(tmp_path / "curve.png"), "title")
    with open(tmp_path / "curve.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@ALGOS
def test_last_checkpoints_are_kept(algo, full_run):
    """--keep-checkpoints 2: the newest as checkpoint.msgpack, the one before as checkpoint_<env steps>.msgpack."""
    cfg, _ = full_run(algo)
    files = sorted(f for f in os.listdir(cfg.out_dir) if f.endswith(".msgpack"))
    assert files == ["checkpoint.msgpack", "checkpoint_000000000256.msgpack"]
    older, _ = algo.read_checkpoint(os.path.join(cfg.out_dir, files[1]))
    newest, _ = algo.read_checkpoint(os.path.join(cfg.out_dir, files[0]))
    assert (older["chunks_done"], older["env_steps"], newest["chunks_done"]) == (2, 256, 3)


@ALGOS
def test_checkpoint_holds_the_whole_train_state(algo, full_run):
    cfg, _ = full_run(algo)
    path = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    meta, payload = algo.read_checkpoint(path)
    env = algo.make_env(cfg.env)
    init, _, _ = algo.make_train(cfg, env)
    template = jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32))
    state = algo.restore_state(path, meta, payload, template)
    assert int(state.iteration[0]) == 3 * 2  # counters
    assert float(state.norm.count[0]) == 3 * 2 * 8 * 8  # observation normaliser
    assert state.env_state.t.shape == (1, 8) and state.reset_pool.t.shape == (1, 8)  # environments, pool
    if algo is trudi_jax:
        assert float(state.actor_params["log_beta"][0]) != math.log(cfg.kl_start)  # dual variables moved
    # the optimisers' states: Adam's step count is the number of updates (6 iterations x 2 minibatches x 1 epoch)
    opt_states = [state.actor_opt_state, state.critic_opt_state] if algo is trudi_jax else [state.opt_state]
    for opt_state in opt_states:
        counts = [int(leaf[0]) for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
                  if "count" in jax.tree_util.keystr(path)]
        assert counts and set(counts) == {3 * 2 * 2}, counts
    older = os.path.join(cfg.out_dir, f"checkpoint_{2 * 2 * 8 * 8:012d}.msgpack")  # the 2nd log point's
    earlier = algo.restore_state(older, *algo.read_checkpoint(older), template)
    assert not np.array_equal(state.key, earlier.key)  # the RNG key is saved as it moved on
    assert meta["env_steps"] == 3 * 2 * 8 * 8 and len(meta["rows"]) == 3


@ALGOS
def test_corrupt_or_foreign_checkpoints_are_refused(algo, full_run, tmp_path):
    cfg, _ = full_run(algo)
    good = open(os.path.join(cfg.out_dir, "checkpoint.msgpack"), "rb").read()
    cases = {"flipped.msgpack": (good[:-100] + bytes([good[-100] ^ 1]) + good[-99:], "corrupt checkpoint"),
             "truncated.msgpack": (good[: len(good) // 2], "corrupt checkpoint"),
             "foreign.msgpack": (b"\x80\x04not a checkpoint", "is not a"),
             "empty.msgpack": (b"", "is not a")}
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SystemExit, match=message):
            algo.read_checkpoint(str(tmp_path / name))
    other = trudi_jax if algo is ppo_jax else ppo_jax  # the other algorithm's checkpoint
    with pytest.raises(SystemExit, match=f"is not a {other.__name__} checkpoint"):
        other.read_checkpoint(os.path.join(cfg.out_dir, "checkpoint.msgpack"))
    with pytest.raises(SystemExit, match="cannot read checkpoint"):
        algo.read_checkpoint(str(tmp_path / "missing.msgpack"))


def test_replay_chunk_reproduces_the_logged_chunk(full_run, tmp_path):
    """benchmarks/replay_chunk.py on the checkpoint before the last log point replays that chunk: its
    per-iteration metrics average to the run's logged ones, seed by seed; --set-beta changes beta alone."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    import replay_chunk
    cfg, rows = full_run("reppo")
    before_last = os.path.join(cfg.out_dir, f"checkpoint_{2 * 8 * 8 * 2:012d}.msgpack")
    assert os.path.exists(before_last), sorted(os.listdir(cfg.out_dir))
    runs = {}
    for name, extra in (("plain", []), ("beta", ["--set-beta", "0.5"])):
        replay_chunk.main([before_last, str(tmp_path / f"{name}.csv")] + extra)
        with open(tmp_path / f"{name}.csv") as f:
            runs[name] = list(csv.DictReader(f))
    assert len(runs["plain"]) == cfg.num_seeds * 2  # 2 iterations per chunk
    for seed in range(cfg.num_seeds):
        logged = next(r for r in rows if r["seed"] == seed and r["env_steps"] == cfg.total_steps)
        replayed = [r for r in runs["plain"] if int(r["seed"]) == seed]
        assert [int(r["env_steps"]) for r in replayed] == [cfg.total_steps - 8 * 8, cfg.total_steps]
        for k in ("kl", "critic_loss", "beta", "entropy"):
            np.testing.assert_allclose(np.mean([float(r[k]) for r in replayed]), logged[k], rtol=1e-4, atol=1e-7)
        betas = [float(r["beta"]) for r in runs["beta"] if int(r["seed"]) == seed]
        assert abs(betas[0] - 0.5) < 0.05 and logged["beta"] < 0.1


@ALGOS
def test_resume_refuses_corrupt_or_different_run_before_writing(algo, full_run, tmp_path):
    cfg, _ = full_run(algo)
    run = tmp_path / "run"
    shutil.copytree(cfg.out_dir, run)
    before = {p: (run / p).read_bytes() for p in os.listdir(run)}
    for flags, message in [(["--learning-rate", "0.5"], "different task/config: learning_rate"),
                           (["--env", "CheetahRun"], "different task/config: env 'CartpoleBalance' != 'CheetahRun'"),
                           (["--num-envs", "16"], "num_envs 8 != 16")]:
        with pytest.raises(SystemExit, match=message):
            algo.train(algo.parse_config(["--resume", str(run)] + flags), log=lambda line: None)
    data = bytearray(before["checkpoint.msgpack"])
    data[-1] ^= 0xFF
    (run / "checkpoint.msgpack").write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="corrupt checkpoint"):
        algo.train(algo.parse_config(["--resume", str(run)]), log=lambda line: None)
    (run / "checkpoint.msgpack").write_bytes(before["checkpoint.msgpack"])
    assert {p: (run / p).read_bytes() for p in os.listdir(run)} == before  # nothing was written


@ALGOS
def test_checkpoint_of_other_shapes_is_refused(algo, full_run):
    cfg, _ = full_run(algo)
    path = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    meta, payload = algo.read_checkpoint(path)
    wider = dict(actor_hidden=(32,)) if algo is trudi_jax else dict(policy_hidden=(32,))
    init, _, _ = algo.make_train(tiny(algo, cfg.out_dir, **wider), algo.make_env(cfg.env))
    with pytest.raises(SystemExit, match="does not fit this configuration's train state"):
        algo.restore_state(path, meta, payload, jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32)))


@ALGOS
def test_checkpoint_write_is_atomic(algo, tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.msgpack")
    meta = {"config": {}, "chunks_done": 1, "env_steps": 1, "wall_s": 0.0, "rows": []}
    algo.save_checkpoint(path, {"w": np.arange(3.0)}, meta)
    good = open(path, "rb").read()

    def crash(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(algo.os, "replace", crash)
    with pytest.raises(OSError):
        algo.save_checkpoint(path, {"w": np.arange(3.0) + 1}, meta | {"chunks_done": 2})
    assert open(path, "rb").read() == good  # the previous checkpoint survived
    monkeypatch.undo()
    assert algo.read_checkpoint(path)[0]["chunks_done"] == 1


class Evil:
    """Unpickling this writes a marker file: the proof that a loader ran pickle."""
    marker = ""

    def __reduce__(self):
        return (open, (Evil.marker, "w"))


@ALGOS
def test_loading_a_checkpoint_never_unpickles(algo, full_run, tmp_path):
    """Checkpoints whose payload (or one array) is a pickle, with valid checksums: refused, and nothing executed."""
    cfg, _ = full_run(algo)
    good = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    Evil.marker = str(tmp_path / "executed")
    evil = pickle.dumps(Evil())
    from flax import serialization
    files = [resign(algo, good, tmp_path / "pickled_payload.msgpack", edit_payload=lambda p: evil),
             resign(algo, good, tmp_path / "pickled_array.msgpack", edit_payload=lambda p: serialization.msgpack_serialize(
                 {k: (evil if k == "0" else v) for k, v in serialization.msgpack_restore(p).items()}))]
    init, _, _ = algo.make_train(cfg, algo.make_env(cfg.env))
    template = jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32))
    for path in files:
        meta, payload = algo.read_checkpoint(path)
        with pytest.raises(SystemExit, match="corrupt checkpoint"):
            algo.restore_state(path, meta, payload, template)
    assert not os.path.exists(Evil.marker)
    pickle.loads(evil)  # the marker works
    assert os.path.exists(Evil.marker)


@ALGOS
def test_metrics_csv_keeps_rows_logged_before_a_metric_existed(algo, tmp_path):
    """A run resumed by newer code appends rows with a metric the older rows lack (eval_length, added 2026-12-07):
    metrics.csv gets every column, the older rows an empty cell there."""
    path = str(tmp_path / "metrics.csv")
    algo.write_csv(path, [{"env_steps": 1, "eval_return": -3.5}, {"env_steps": 2, "eval_return": -3.0,
                                                                   "eval_length": 212.5}])
    with open(path) as f:
        assert list(csv.DictReader(f)) == [{"env_steps": "1", "eval_return": "-3.5", "eval_length": ""},
                                           {"env_steps": "2", "eval_return": "-3.0", "eval_length": "212.5"}]


@ALGOS
def test_a_checkpoint_from_before_a_field_existed_keeps_what_it_ran(algo):
    """A saved config without a field added later (ADDED_FIELDS: --beta-min, --kl-stop, --anneal-lr, --gate-chunk,
    --gate-bf16) reads as the value the older code ran (no floor, no stop, a constant rate, the plain gradient), not
    as today's default, and --resume accepts it as such; any other missing field is still refused."""
    saved = algo.config_dict(algo.Config())
    assert algo.ADDED_FIELDS or algo is ppo_jax
    for name, value in algo.ADDED_FIELDS.items():
        older = {k: v for k, v in saved.items() if k != name}
        assert algo.config_from_dict(older) == dataclasses.replace(algo.Config(), **{name: value})
        algo.check_same_run("older.msgpack", older, algo.config_from_dict(older))  # --resume accepts it
        if saved[name] != value:  # but not with today's default where that differs
            with pytest.raises(SystemExit, match=f"different task/config: {name}"):
                algo.check_same_run("older.msgpack", older, algo.config_from_dict(older | {name: saved[name]}))
    with pytest.raises(SystemExit, match="missing fields num_envs"):
        algo.config_from_dict({k: v for k, v in saved.items() if k != "num_envs"})


@ALGOS
def test_crafted_headers_are_refused_before_use(algo, full_run, tmp_path, monkeypatch):
    """The checksum and the format version are verified before any header field is read; a header with a
    valid checksum but missing or mistyped fields, or absurd nesting, is one line, not a traceback."""
    cfg, _ = full_run(algo)
    good = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    cases = {
        "empty_header": (dict(header=b"{}\n"), "header lacks or mistypes: config, chunks_done"),
        "list_header": (dict(header=b"[1, 2]\n"), "header lacks or mistypes"),
        "nested": (dict(header=b"[" * 100_000 + b"]" * 100_000 + b"\n"), "unreadable header"),
        "rows_text": (dict(edit_meta=lambda m: m | {"rows": "x"}), "mistypes: rows"),
        "bad_config_type": (dict(edit_meta=lambda m: m | {"config": m["config"] | {"num_envs": "8"}}), None),
        "unknown_config_field": (dict(edit_meta=lambda m: m | {"config": m["config"] | {"x": 1}}), None),
        "other_version": (dict(magic=algo.CHECKPOINT_MAGIC.replace(b"v1", b"v7")), "another format version"),
    }
    for name, (edit, message) in cases.items():
        run = tmp_path / name
        run.mkdir()
        path = resign(algo, good, run / "checkpoint.msgpack", **edit)
        with pytest.raises(SystemExit) as error:
            algo.parse_config(["--resume", str(run)])
        assert "\n" not in str(error.value) and str(error.value).startswith("error: "), name
        assert message is None or message in str(error.value), (name, str(error.value))
        if message is None:
            assert "holds no valid configuration" in str(error.value), name
        assert os.listdir(run) == ["checkpoint.msgpack"]


@ALGOS
def test_resume_takes_a_run_directory_or_a_checkpoint_file(algo, full_run, tmp_path):
    """--resume DIR and --resume DIR/checkpoint.msgpack continue in DIR; an older kept checkpoint continues only
    where --out-dir says (in DIR it would replace the later checkpoints and metrics), refused before anything is
    written otherwise."""
    cfg, _ = full_run(algo)
    for path in (cfg.out_dir, os.path.join(cfg.out_dir, "checkpoint.msgpack")):
        resumed = algo.parse_config(["--resume", path])
        assert resumed.out_dir == cfg.out_dir and algo.run_directory(resumed, "x") == cfg.out_dir
    older = os.path.join(cfg.out_dir, "checkpoint_000000000256.msgpack")
    with pytest.raises(SystemExit, match="older checkpoint of .* pass --out-dir NEW_DIR"):
        algo.parse_config(["--resume", older])
    fork = algo.parse_config(["--resume", older, "--out-dir", str(tmp_path / "fork")])
    assert algo.run_directory(fork, "x") == str(tmp_path / "fork") and not (tmp_path / "fork").exists()
    with pytest.raises(SystemExit, match="already holds a run"):  # continuing it in its own run is refused
        algo.run_directory(algo.parse_config(["--resume", older, "--out-dir", cfg.out_dir + "/"]), "x")


def test_older_checkpoint_continues_in_a_new_directory_as_the_original_run_did(full_run, tmp_path):
    """--resume DIR/checkpoint_<steps>.msgpack --out-dir NEW trains on from that point in NEW: the same rows and the
    same final train state as the uninterrupted run, and DIR untouched. Run-management text, the same in both files
    (a test checks it): PPO stands for both."""
    algo = ppo_jax
    cfg, reference = full_run(algo)
    before = {p: open(os.path.join(cfg.out_dir, p), "rb").read() for p in os.listdir(cfg.out_dir)}
    older = os.path.join(cfg.out_dir, "checkpoint_000000000256.msgpack")
    lines = []
    rows = algo.train(algo.parse_config(["--resume", older, "--out-dir", str(tmp_path / "fork")]), log=lines.append)
    assert any(f"resuming {older} after 256 env steps" in line for line in lines)
    assert len([line for line in lines if " steps/s " in line]) == 1  # only the third log point trained
    assert_ends_as_reference(algo, cfg, reference, str(tmp_path / "fork"), rows)
    assert {p: open(os.path.join(cfg.out_dir, p), "rb").read() for p in os.listdir(cfg.out_dir)} == before


def test_checkpoints_every_n_log_points_and_at_the_end_and_the_curve_is_plotted(monkeypatch, tmp_path):
    """--checkpoint-every 2 over 3 log points writes at the 2nd and the 3rd (the end), the 2nd kept beside the newest
    (--keep-checkpoints 2); --plot draws curve.png from the rows; the rows name --seed; episodes that run to the time
    limit (10) are 10 steps long, a length the progress line leaves out. Run-management text, the same in both files (a
    test checks it): PPO stands for both."""
    algo = ppo_jax
    monkeypatch.setattr(algo, "make_env", lambda name, *options: point_env(algo, lambda sim, nxt, action: nxt))
    cfg = tiny(algo, tmp_path / "run", checkpoint_every=2, plot=True, num_eval_envs=2, seed=7, episode_length=10)
    lines = []
    rows = algo.train(cfg, log=lines.append)
    assert [r["seed"] for r in rows] == [7, 7, 7]  # a single seed's rows carry --seed, not its index 0
    assert [(r["eval_length"], r["train_length"]) for r in rows[1:]] == [(10.0, 10.0)] * 2  # the time limit:
    assert not any("length" in line for line in lines if " steps/s " in line)  # not shown in the progress line
    assert sorted(f for f in os.listdir(cfg.out_dir) if f.startswith("checkpoint")) == [
        "checkpoint.msgpack", f"checkpoint_{2 * 8 * 8 * 2:012d}.msgpack"]
    assert sum("checkpoint " in line for line in lines) == 2
    meta, _ = algo.read_checkpoint(os.path.join(cfg.out_dir, "checkpoint.msgpack"))
    assert meta["chunks_done"] == 3
    import matplotlib.pyplot as plt
    image = plt.imread(os.path.join(cfg.out_dir, "curve.png"))
    assert image.shape[0] > 100 and image[..., :3].std() > 0.01  # a drawing, not a blank image


@ALGOS
def test_run_fields_never_come_from_the_checkpoint(algo, full_run, tmp_path, monkeypatch):
    """A resumed run takes --distributed, its coordinator, --video, --wandb, ... from the command line only (it
    keeps --checkpoint-every and --keep-checkpoints unless the command line gives them); a header with a wrong
    checksum is refused before any of it is read, so no connection is ever opened."""
    cfg, _ = full_run(algo)
    good = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    connect = dict(distributed=True, coordinator_address="203.0.113.1:1234", num_processes=2, process_id=1,
                   video=str(tmp_path / "v.mp4"), wandb=True, eval_only=True, checkpoint="/x", out_dir="/elsewhere")

    def no_connection(*args, **kwargs):
        raise AssertionError("jax.distributed.initialize called")
    monkeypatch.setattr(jax.distributed, "initialize", no_connection)
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    resign(algo, good, crafted / "checkpoint.msgpack", edit_meta=lambda m: m | {"config": m["config"] | connect})
    resumed = algo.parse_config(["--resume", str(crafted)])
    assert not resumed.distributed and resumed.coordinator_address is None and resumed.video is None
    assert not resumed.wandb and not resumed.eval_only and resumed.checkpoint is None
    assert resumed.out_dir == str(crafted) and resumed.num_envs == cfg.num_envs
    # but it checkpoints as the run it continues did, unless told otherwise
    assert (resumed.checkpoint_every, resumed.keep_checkpoints) == (cfg.checkpoint_every, cfg.keep_checkpoints)
    assert cfg.checkpoint_every > 0
    assert algo.parse_config(["--resume", str(crafted), "--checkpoint-every", "0"]).checkpoint_every == 0
    data = bytearray((crafted / "checkpoint.msgpack").read_bytes())
    data[-1] ^= 0xFF  # the checksum no longer matches
    (crafted / "checkpoint.msgpack").write_bytes(bytes(data))
    for call in (lambda: algo.parse_config(["--resume", str(crafted)]),
                 lambda: algo.train(dataclasses.replace(cfg, resume=str(crafted), out_dir=str(crafted)))):
        with pytest.raises(SystemExit, match="checksum mismatch"):
            call()


@ALGOS
def test_restored_arrays_are_checked_against_the_train_state(algo, full_run, tmp_path):
    """A header that agrees with the train state but an array of another shape (or dtype) in the payload."""
    cfg, _ = full_run(algo)
    good = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    from flax import serialization
    meta, payload = algo.read_checkpoint(good)
    index = next(i for i, (shape, _) in enumerate(meta["leaves"]) if shape)  # the first array that is not a scalar

    def other(array):
        return lambda p: serialization.msgpack_serialize(
            {k: (array(v) if k == str(index) else v) for k, v in serialization.msgpack_restore(p).items()})
    init, _, _ = algo.make_train(cfg, algo.make_env(cfg.env))
    template = jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32))
    for name, change in [("longer", lambda v: np.concatenate([v.ravel(), v.ravel()])),
                         ("float64", lambda v: v.astype(np.float64))]:
        path = resign(algo, good, tmp_path / f"{name}.msgpack", edit_payload=other(change))
        m, p = algo.read_checkpoint(path)
        with pytest.raises(SystemExit, match=f"array {index} has another shape or dtype"):
            algo.restore_state(path, m, p, template)


# ---------------------------------------------------------------------------------------------
# Evaluation of a saved policy, video
# ---------------------------------------------------------------------------------------------
@ALGOS
def test_eval_only_reports_mean_and_std_of_fresh_episodes(algo, full_run):
    cfg, _ = full_run(algo)
    lines = []
    results = algo.evaluate_checkpoint(algo.parse_config(
        ["--eval-only", "--checkpoint", os.path.join(cfg.out_dir, "checkpoint.msgpack"), "--eval-episodes", "5"]),
        log=lines.append)
    assert len(results) == 1 and results[0]["env_steps"] == 3 * 2 * 8 * 8
    assert 0 < results[0]["eval_return"] <= cfg.episode_length and results[0]["eval_return_std"] >= 0
    assert results[0]["eval_length"] == cfg.episode_length  # CartpoleBalance never ends an episode early
    assert "±" in lines[0] and f"over 5 episodes of {cfg.episode_length} steps" in lines[0]
    earlier = algo.evaluate_checkpoint(algo.parse_config(  # the kept checkpoint of the 2nd log point
        ["--eval-only", "--checkpoint", os.path.join(cfg.out_dir, "checkpoint_000000000256.msgpack"),
         "--eval-episodes", "5"]), log=lambda line: None)
    assert earlier[0]["env_steps"] == 2 * 2 * 8 * 8 and earlier[0]["eval_return"] != results[0]["eval_return"]


@ALGOS
def test_video_of_an_evaluation_episode(algo, full_run, tmp_path):
    cfg, _ = full_run(algo)
    video = tmp_path / "episode.mp4"
    proc = subprocess.run([sys.executable, f"{algo.__name__}.py", "--eval-only", "--checkpoint",
                           os.path.join(cfg.out_dir, "checkpoint.msgpack"), "--eval-episodes", "2",
                           "--video", str(video)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert video.stat().st_size > 1000 and video.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    import matplotlib.pyplot as plt
    frame = plt.imread(tmp_path / "episode.png")
    assert frame.shape[:2] == (240, 320) and frame[..., :3].std() > 0.01  # a picture, not a blank frame


def test_video_without_a_working_renderer_is_refused_before_compiling(tmp_path):
    """MuJoCo's GLFW backend without a display aborts the process when the renderer starts (CI saw it, after a
    whole training run): --video probes the renderer in a child process first. One file stands for both."""
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"} | {"MUJOCO_GL": "glfw"}
    proc = subprocess.run([sys.executable, "trudi_jax.py", "--video", str(tmp_path / "v.mp4"), "--out-dir",
                           str(tmp_path / "run")], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "compiling" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "error: --video: MuJoCo cannot render headless here with MUJOCO_GL=glfw" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "v.mp4").exists()


@ALGOS
def test_video_needs_a_renderer_and_an_encoder(algo, monkeypatch):
    """--video on a task without a renderer, or without imageio-ffmpeg: one line before anything compiles."""
    env = point_env(algo, lambda sim, nxt, action: nxt)
    with pytest.raises(SystemExit, match="^error: --video: this task has no renderer$"):
        algo.check_video_support(env._replace(render=None))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"--video needs the imageio-ffmpeg package \(pip install imageio-ffmpeg\)"):
        algo.check_video_support(env._replace(render=lambda states, height, width: None))


@ALGOS
def test_eval_only_refuses_a_checkpoint_of_another_task(algo, full_run):
    cfg, _ = full_run(algo)
    path = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    other = dataclasses.replace(algo.parse_config(["--eval-only", "--checkpoint", path]), env="CheetahRun")
    with pytest.raises(SystemExit, match=f"checkpoint {path} is from env 'CartpoleBalance'.*not 'CheetahRun'"):
        algo.evaluate_checkpoint(other, log=lambda line: None)


BRAX_VIDEO = """
import os, sys
os.environ["MUJOCO_GL"] = "egl"
import jax, numpy as np, matplotlib.pyplot as plt
import ppo_jax, trudi_jax
for algo in (ppo_jax, trudi_jax):
    env = algo.make_env("inverted_pendulum")
    act = lambda obs, *key: np.full((obs.shape[0], env.action_size), 0.5)  # PPO's acts without a key
    states = algo.record_episode(env, act, jax.random.key(0), 6)
    path = os.path.join(sys.argv[1], algo.__name__ + ".mp4")
    algo.write_video(env, states, path)
    frame = plt.imread(path[:-4] + ".png")
    print(algo.__name__, len(states), os.path.getsize(path), open(path, "rb").read(8)[4:].decode(),
          frame.shape[0], frame.shape[1], float(frame[..., :3].std()))
"""


def test_brax_task_renders_to_video(tmp_path):
    """The Brax render path (pipeline states through brax.io.image) of both files, without training."""
    proc = subprocess.run([sys.executable, "-c", BRAX_VIDEO, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert [line[0] for line in lines] == ["ppo_jax", "trudi_jax"]
    for _, num_states, size, box, height, width, std in lines:
        assert int(num_states) >= 2 and int(size) > 1000 and box == "ftyp"
        assert (int(height), int(width)) == (240, 320) and float(std) > 0.01


# ---------------------------------------------------------------------------------------------
# Failures: physics blow-ups, non-finite numbers
# ---------------------------------------------------------------------------------------------
@flax.struct.dataclass
class PointSim:
    obs: jax.Array  # [steps since reset, position]
    reward: jax.Array
    done: jax.Array


def point_env(algo, step_fn, reset_obs=(0.0, 0.0)):
    """A 1-D point moved by its action, reward -x^2; step_fn(sim, next_sim, action) may break it."""
    def reset(key):
        return PointSim(jnp.array(reset_obs) + jnp.array([0.0, 0.1]) * jax.random.normal(key), jnp.zeros(()),
                        jnp.zeros(()))

    def step(sim, action):
        obs = sim.obs + jnp.array([1.0, 0.1 * action[0]])
        return step_fn(sim, sim.replace(obs=obs, reward=-obs[1] ** 2, done=jnp.zeros(())), action)

    return algo.Env(reset, step, 2, 1)


@ALGOS
def test_no_evaluation_changes_nothing_but_the_evaluation(algo):
    """--num-eval-envs 0 drops the evaluation episodes from the program (eval_return NaN) and nothing else: the
    train state after a chunk is the same, bit for bit (the evaluation key is drawn either way)."""
    env = point_env(algo, lambda sim, nxt, action: nxt)
    states = []
    for num_eval_envs in (2, 0):
        init, chunk, _ = algo.make_train(tiny(algo, None, num_eval_envs=num_eval_envs), env)
        ts, metrics = jax.jit(chunk)(jax.jit(init)(jax.random.PRNGKey(0)))
        assert np.isfinite(metrics["eval_return"]) == (num_eval_envs > 0)
        states.append(jax.device_get(ts))
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_array_equal(a, b)


@ALGOS
def test_blown_up_environment_is_reset_and_masked(algo):
    def blow_up_env_1(sim, nxt, action):
        return nxt.replace(obs=jnp.where(sim.obs[1] > 100, jnp.nan, nxt.obs))
    env = point_env(algo, blow_up_env_1)
    state = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(0), 3))
    state = state._replace(sim=state.sim.replace(obs=state.sim.obs.at[1, 1].set(500.0)), ret=jnp.array([1., 2., 3.]))
    pool = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(1), 3))
    new, step = algo.env_step(env, state, jnp.zeros((3, 1)), pool, episode_length=1000)
    np.testing.assert_array_equal(step.blown_up, [0.0, 1.0, 0.0])
    np.testing.assert_array_equal(step.truncated, [0.0, 1.0, 0.0])  # ends like a time limit: bootstrapped
    np.testing.assert_array_equal(step.terminated, [0.0, 0.0, 0.0])
    assert float(step.reward[1]) == 0.0 and np.isfinite(step.final_obs).all()
    np.testing.assert_array_equal(step.final_obs[1], state.sim.obs[1])  # the last finite observation
    assert np.isnan(step.episode_return[1])  # not reported as an episode return
    np.testing.assert_array_equal(new.sim.obs[1], pool.sim.obs[1])  # continues from a fresh initial state
    assert np.isfinite(new.sim.obs).all()


def run_point(algo, monkeypatch, env, tmp_path, **overrides):
    monkeypatch.setattr(algo, "make_env", lambda name, *options: env)
    cfg = tiny(algo, tmp_path, episode_length=1000, num_evals=4, total_steps=8 * 8 * 2 * 4, **overrides)
    lines = []
    return cfg, lines, (lambda: algo.train(cfg, log=lines.append))


@ALGOS
def test_physics_blow_ups_are_counted_and_never_reach_the_update(algo, monkeypatch, tmp_path):
    def blow_up_on_large_actions(sim, nxt, action):
        bad = action[0] > 0.7
        return nxt.replace(obs=jnp.where(bad, jnp.nan, nxt.obs), reward=jnp.where(bad, jnp.inf, nxt.reward))
    # the logging sinks are exercised here too, with stand-in tensorboardX / wandb modules
    scalars, logged = [], []
    writer = types.SimpleNamespace(add_scalar=lambda k, v, step: scalars.append((k, v, step)), flush=lambda: None,
                                   close=lambda: None)
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=lambda path: writer))
    wandb_run = types.SimpleNamespace(id="w1", log=lambda row, step: logged.append((row, step)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: wandb_run))
    cfg, lines, run = run_point(algo, monkeypatch, point_env(algo, blow_up_on_large_actions), tmp_path,
                                tensorboard=True, wandb=True)
    rows = run()
    resets = sum(r["physics_resets"] for r in rows)
    assert resets > 0 and any("physics resets" in line for line in lines)
    losses = [k for k in rows[0] if k.endswith("loss")]
    assert all(np.isfinite(r[k]) for r in rows for k in losses)  # the update never saw a NaN or Inf
    assert sum(v for k, v, _ in scalars if k == "physics_resets") == resets
    assert [step for _, step in logged] == [r["env_steps"] for r in rows] and "eval_return" in logged[0][0]


@ALGOS
def test_progress_line_shows_the_episode_lengths_where_episodes_end_early(algo, monkeypatch, tmp_path):
    """Every episode terminates at its 7th step (time limit 1000): each progress line says "eval length 7" and
    "train length 7" (the training episodes that ended: those cut by the desynchronised clocks are not counted),
    as metrics.csv does. Where episodes run to the time limit, the line leaves them out (the checkpoint test)."""
    def terminate_at_step_7(sim, nxt, action):
        return nxt.replace(done=(nxt.obs[0] >= 7).astype(jnp.float32))
    monkeypatch.setattr(algo, "make_env", lambda name, *options: point_env(algo, terminate_at_step_7))
    cfg = tiny(algo, tmp_path, episode_length=1000, num_eval_envs=2)
    lines = []
    rows = algo.train(cfg, log=lines.append)
    assert [(r["eval_length"], r["train_length"]) for r in rows] == [(7.0, 7.0)] * len(rows)
    progress = [line for line in lines if " steps/s " in line]
    assert len(progress) == cfg.num_evals
    assert all(" | eval length 7 | " in line and " | train length 7 | " in line for line in progress)


@ALGOS
def test_nonfinite_loss_stops_the_run_naming_it_and_keeps_last_good_checkpoint(algo, monkeypatch, tmp_path):
    def huge_rewards_from_step_40(sim, nxt, action):  # finite, but overflows the losses
        return nxt.replace(reward=jnp.where(nxt.obs[0] >= 40, 1e36, nxt.reward))
    cfg, lines, run = run_point(algo, monkeypatch, point_env(algo, huge_rewards_from_step_40), tmp_path)
    quantity = "critic loss" if algo is trudi_jax else "loss"
    with pytest.raises(SystemExit, match=f"non-finite {quantity} at iteration 4 .* last good checkpoint kept"):
        run()  # step 40 is the last of iteration 4 (steps 33..40), in the third log point (iterations 4, 5)
    meta, _ = algo.read_checkpoint(os.path.join(cfg.out_dir, "checkpoint.msgpack"))
    assert meta["chunks_done"] == 2
    assert all(np.isfinite(r[k]) for r in meta["rows"] for k in r if k.endswith("loss"))
    with open(os.path.join(cfg.out_dir, "metrics.csv")) as f:  # the failing log point wrote no row
        assert [int(r["env_steps"]) for r in csv.DictReader(f)] == [r["env_steps"] for r in meta["rows"]]


@ALGOS
def test_nonfinite_observations_stop_the_run_at_once(algo, monkeypatch, tmp_path):
    env = point_env(algo, lambda sim, nxt, action: nxt, reset_obs=(0.0, np.nan))
    cfg, lines, run = run_point(algo, monkeypatch, env, tmp_path)
    with pytest.raises(SystemExit, match="non-finite observations at iteration 0 .* no checkpoint written"):
        run()
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.msgpack"))


def nan_after(num_updates):
    """An optax transformation that turns the policy's updates (TruDi: the actor's, whose loss comes after the
    critic's; PPO: all) from the num_updates-th on into NaN."""
    import optax

    def update(updates, count, params=None):
        bad = (count >= num_updates) & ("log_alpha" in updates or "value" in updates)
        return jax.tree.map(lambda u: jnp.where(bad, jnp.nan, u), updates), count + 1
    return optax.GradientTransformation(lambda params: jnp.zeros((), jnp.int32), update)


@ALGOS
def test_nonfinite_parameters_stop_the_run_naming_them(algo, monkeypatch, tmp_path):
    """Parameters turned NaN by the last minibatch update of iteration 4 (updates 8 and 9 are its two minibatches),
    while every loss of that iteration was still computed from finite parameters."""
    import optax
    adam = optax.adam
    monkeypatch.setattr(optax, "adam", lambda lr: optax.chain(adam(lr), nan_after(9)))
    cfg, lines, run = run_point(algo, monkeypatch, point_env(algo, lambda sim, nxt, action: nxt), tmp_path)
    quantity = "actor parameters" if algo is trudi_jax else "parameters"
    with pytest.raises(SystemExit, match=f"non-finite {quantity} at iteration 4 .* last good checkpoint kept"):
        run()


@ALGOS
def test_nonfinite_rewards_stop_the_run(algo, monkeypatch, tmp_path):
    """A finite reward that the reward scale overflows (1e30 x 1e10) reaches the batch as inf: stopped at once."""
    env = point_env(algo, lambda sim, nxt, action: nxt.replace(reward=jnp.full((), 1e30)))
    cfg, lines, run = run_point(algo, monkeypatch, env, tmp_path, reward_scale=1e10)
    with pytest.raises(SystemExit, match="non-finite rewards at iteration 0 .* no checkpoint written"):
        run()
    assert not any(f.startswith("checkpoint") or f == "metrics.csv" for f in os.listdir(cfg.out_dir))


@ALGOS
def test_blow_up_during_evaluation_ends_that_episode_only(algo):
    """Evaluation: an episode whose physics blows up at its 5th step keeps the rewards before it; others run on."""
    def blow_up_after_4_steps(sim, nxt, action):
        bad = (nxt.obs[0] >= 5) & (sim.obs[1] > 0.5)  # only episodes that started at x > 0.5
        return nxt.replace(obs=jnp.where(bad, jnp.nan, nxt.obs), reward=jnp.where(bad, jnp.nan, 1.0))
    env = point_env(algo, blow_up_after_4_steps)
    env = env._replace(reset=lambda key: PointSim(jnp.array([0.0, 0.4]) + jnp.array([0.0, 0.2]) * jnp.arange(2)[
        jax.random.randint(key, (), 0, 2)], jnp.zeros(()), jnp.zeros(())))
    mean, std, length = map(float, algo.run_episodes(env, lambda obs, key: jnp.zeros((obs.shape[0], 1)),
                                                      jax.random.PRNGKey(0), 64, 20))
    # every return is 4 (blown up after 4 rewards of 1) or 20 (all steps): a fraction p of 4s gives
    # mean 20 - 16 p and std 16 sqrt(p (1 - p)); the blown-up episodes took 5 steps, the others 20
    p = (20.0 - mean) / 16.0
    assert 0 < p < 1 and std == pytest.approx(16.0 * math.sqrt(p * (1 - p)), rel=1e-4)
    assert length == pytest.approx(20.0 - 15.0 * p, rel=1e-4)


@ALGOS
def test_evaluation_length_counts_the_steps_up_to_the_first_end(algo):
    """eval_length: an episode that terminates at its 7th step counts 7 steps and 7 rewards, nothing after it
    (the environment would run on past done); one that never ends counts the whole time limit, 20."""
    def terminate_at_step_7(sim, nxt, action):
        end = (nxt.obs[0] >= 7) & (sim.obs[1] > 0.5)  # only episodes that started at x > 0.5
        return nxt.replace(reward=jnp.ones(()), done=end.astype(jnp.float32))
    env = point_env(algo, terminate_at_step_7)
    env = env._replace(reset=lambda key: PointSim(jnp.array([0.0, 0.4]) + jnp.array([0.0, 0.2]) * jnp.arange(2)[
        jax.random.randint(key, (), 0, 2)], jnp.zeros(()), jnp.zeros(())))
    mean, _, length = map(float, algo.run_episodes(env, lambda obs, key: jnp.zeros((obs.shape[0], 1)),
                                                   jax.random.PRNGKey(1), 64, 20))
    p = (20.0 - mean) / 13.0  # the fraction of episodes that ended at step 7
    assert 0 < p < 1 and length == pytest.approx(mean, rel=1e-5)  # one reward of 1 per step taken


@ALGOS
@pytest.mark.parametrize("ending", ["all", "some"])
def test_evaluation_stops_stepping_once_every_episode_has_ended(algo, ending):
    """Episodes that start at x > 0.5 terminate at their 7th step, the others run to the time limit (20): where all
    of them start there, the policy acts 7 times, not 20; where some do, it acts 20 times."""
    def terminate_at_step_7(sim, nxt, action):
        end = (nxt.obs[0] >= 7) & (sim.obs[1] > 0.5)
        return nxt.replace(reward=jnp.ones(()), done=end.astype(jnp.float32))
    starts = jnp.array([0.6, 0.6] if ending == "all" else [0.4, 0.6])
    env = point_env(algo, terminate_at_step_7)._replace(reset=lambda key: PointSim(
        jnp.stack([0.0, starts[jax.random.randint(key, (), 0, 2)]]), jnp.zeros(()), jnp.zeros(())))
    calls = []

    def actor(obs, key):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.zeros((obs.shape[0], 1))
    _, _, length = jax.jit(lambda key: algo.run_episodes(env, actor, key, 16, 20))(jax.random.PRNGKey(0))
    jax.effects_barrier()
    assert len(calls) == (7 if ending == "all" else 20)
    assert (float(length) == 7.0) == (ending == "all") and 7.0 <= float(length) < 20.0


# ---------------------------------------------------------------------------------------------
# Configuration errors (before anything compiles)
# ---------------------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--preset", "fast"], "unknown preset 'fast'"),
    (["--total-steps", "-5"], "--total-steps must be positive"),
    (["--num-minibatches", "7"], "is not divisible into --num-minibatches 7"),
    (["--num-envs", "0"], "--num-envs and --rollout-steps must be positive"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--eval-only"], "--eval-only needs --checkpoint"),
    (["--eval-episodes", "0"], "--eval-episodes must be positive"),
    (["--video", "run.gif"], "--video must name an .mp4 file"),
    (["--num-evals", "0"], "--num-evals must be positive"),
    (["--checkpoint", "runs/x/checkpoint.msgpack"], "--checkpoint is read by --eval-only only"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be positive"),
    (["--video", "/dev/null/x.mp4"], "--video /dev/null/x.mp4: cannot be created"),  # even as root
    (["HIDDEN"], "needs one or more positive widths"),
    (["ACTOR_HIDDEN", "32", "0"], "needs one or more positive widths"),
    (["--num-seeds", "0"], "--num-seeds must be positive"),
    (["--num-epochs", "0"], "--num-minibatches and --num-epochs must be positive"),
    (["--episode-length", "0"], "--episode-length must be positive"),
    (["--gamma", "1.5"], "--gamma must be in (0, 1]"),
    (["--num-eval-envs", "-1"], "--num-eval-envs non-negative"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0"),
    (["--learning-rate", "0"], "--learning-rate"),
]
HIDDEN = {ppo_jax: "--value-hidden", trudi_jax: "--critic-hidden"}  # a width list given no values
ACTOR_HIDDEN = {ppo_jax: "--policy-hidden", trudi_jax: "--actor-hidden"}


@ALGOS
@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[f[0][0] for f in BAD_FLAGS])
def test_impossible_configuration_exits_with_one_line_before_compiling(algo, flags, message, tmp_path):
    out = tmp_path / "out"
    flags = [{"HIDDEN": HIDDEN, "ACTOR_HIDDEN": ACTOR_HIDDEN}[f][algo] if f.isupper() else f for f in flags]
    with pytest.raises(SystemExit) as error:
        algo.train(algo.parse_config(flags + ["--out-dir", str(out)]), log=lambda line: None)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


@ALGOS
def test_unusable_out_dir_is_refused_with_one_line(algo, tmp_path):
    (tmp_path / "file").write_text("")
    for out_dir in ["/dev/null/x", str(tmp_path / "file"), str(tmp_path / "file" / "run")]:
        with pytest.raises(SystemExit) as error:
            algo.train(algo.parse_config(["--out-dir", out_dir]), log=lambda line: None)
        assert f"--out-dir {out_dir}: cannot be created" in str(error.value) and "\n" not in str(error.value)


@ALGOS
def test_budget_rounding_is_reported_in_the_first_line(algo, tmp_path):
    lines = []

    def stop_at_first_line(line):
        lines.append(line)
        raise KeyboardInterrupt
    cfg = algo.parse_config(["--total-steps", "1000", "--num-evals", "100", "--num-envs", "64", "--rollout-steps", "32",
                             "--out-dir", str(tmp_path / "run")])
    with pytest.raises(KeyboardInterrupt):
        algo.train(cfg, log=stop_at_first_line)
    assert "running 204,800 env steps per seed (100 log points x 1 iterations x 64 envs x 32 steps; asked for " \
           "1,000)" in lines[0] and str(tmp_path / "run") in lines[0]
    assert not (tmp_path / "run").exists()


@ALGOS
def test_evaluation_is_sized_to_the_run_and_announced(algo, tmp_path):
    """A short run evaluates fewer episodes by default, so that evaluating takes at most its training's env steps
    (10 evaluations of the long runs' episode count would be 30-60x a 20k-step smoke run), and says so before
    loading the task; an explicit --num-eval-envs is kept."""
    full = {trudi_jax: 64, ppo_jax: 128}[algo]
    assert algo.eval_envs(algo.parse_config([])) == full  # the default budgets keep the long runs' count
    assert algo.eval_envs(algo.parse_config(["--total-steps", "300000"])) == 30
    assert algo.eval_envs(algo.parse_config(["--total-steps", "300000", "--num-eval-envs", "16"])) == 16
    assert algo.eval_envs(algo.parse_config(["--total-steps", "1000", "--num-eval-envs", "0"])) == 0
    lines = []

    def stop_at_second_line(line):
        lines.append(line)
        if len(lines) == 2:
            raise KeyboardInterrupt
    cfg = algo.parse_config(["--total-steps", "20000", "--num-envs", "16", "--out-dir", str(tmp_path / "run")])
    with pytest.raises(KeyboardInterrupt):
        algo.train(cfg, log=stop_at_second_line)
    assert algo.eval_envs(cfg) == 2
    steps = lines[0].split("running ")[1].split(" env steps")[0]  # the training's steps after rounding
    ratio = 10 * 2 * 1000 / int(steps.replace(",", ""))
    assert f"evaluating 2 episodes of up to 1000 steps at each log point: up to 20,000 env steps per seed " \
           f"({ratio:.2f}x the training's" in lines[1] and ratio <= 1
    assert not (tmp_path / "run").exists()


@ALGOS
def test_every_log_line_is_flushed(algo, monkeypatch):
    """Progress reaches a log file at once (stdout to a file is block-buffered): each line is flushed."""
    events = []
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(write=lambda text: events.append("write"),
                                                             flush=lambda: events.append("flush")))
    algo.log_line("[x] steps 1")
    monkeypatch.undo()
    assert events[-1] == "flush" and "write" in events
    for fn in (algo.train, algo.evaluate_checkpoint):
        assert inspect.signature(fn).parameters["log"].default is algo.log_line


@ALGOS
def test_each_run_gets_its_own_directory_by_default(algo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = algo.parse_config(["--env", "CartpoleBalance", "--seed", "3"])
    assert cfg.out_dir is None
    first = algo.run_directory(cfg, "x")
    assert first.startswith(os.path.join("runs", "x_CartpoleBalance_3_20"))
    os.makedirs(first)
    second = algo.run_directory(cfg, "x")
    assert second != first and second.startswith(first)


@ALGOS
def test_out_dir_holding_a_run_is_refused_unless_overwrite(algo, full_run, tmp_path):
    cfg, reference = full_run(algo)
    run = tmp_path / "run"
    shutil.copytree(cfg.out_dir, run)
    before = {p: (run / p).read_bytes() for p in os.listdir(run)}
    with pytest.raises(SystemExit, match=f"--out-dir {run} already holds a run .*pass --overwrite"):
        algo.train(tiny(algo, run), log=lambda line: None)
    assert {p: (run / p).read_bytes() for p in os.listdir(run)} == before
    (run / "notes.txt").write_text("mine")
    rows = algo.train(tiny(algo, run, overwrite=True, keep_checkpoints=1), log=lambda line: None)
    assert_rows_equal(rows, reference)
    assert sorted(os.listdir(run)) == ["checkpoint.msgpack", "config.json", "metrics.csv", "notes.txt"]


@ALGOS
def test_envs_must_split_evenly_across_devices(algo):
    algo.validate(algo.Config(num_envs=64), num_devices=4)
    with pytest.raises(SystemExit, match="--num-envs 64 is not divisible across the 3 devices"):
        algo.validate(algo.Config(num_envs=64), num_devices=3)


@ALGOS
def test_missing_logging_package_is_a_clear_error(algo, monkeypatch, tmp_path):
    for flag, module in [("--wandb", "wandb"), ("--tensorboard", "tensorboardX")]:
        monkeypatch.setitem(sys.modules, module, None)  # import fails
        with pytest.raises(SystemExit, match=f"{flag} needs the {module} package"):
            algo.train(algo.parse_config([flag, "--out-dir", str(tmp_path)]), log=lambda line: None)


# ---------------------------------------------------------------------------------------------
# Several devices: environments split across 2 forced CPU devices
# ---------------------------------------------------------------------------------------------
SHARDED_RUN = """
import json, os, shutil, sys
import jax
import numpy as np
import {algo}
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
cfg = {algo}.config_from_dict(json.loads(sys.argv[1]))
assert jax.device_count() == 2
init, _, _ = {algo}.make_train(cfg, {algo}.make_env(cfg.env))
keys = jax.numpy.zeros((1, 2), jax.numpy.uint32)
mesh = {algo}.Mesh(np.array(jax.devices()), ("envs",))
shardings = {algo}.state_shardings(mesh)
ts = jax.jit(jax.vmap(init), out_shardings=shardings)(keys)
shard_shapes = sorted({{s.data.shape for s in ts.env_state.t.addressable_shards}})
rows = {algo}.train(cfg, log=lambda line: None)
# resume the 1-device run's checkpoint after its 2nd log point on these 2 devices
os.makedirs(sys.argv[2] + "/resumed")
shutil.copy(sys.argv[2] + "/checkpoint_000000000256.msgpack", sys.argv[2] + "/resumed/checkpoint.msgpack")
resumed = {algo}.train({algo}.parse_config(["--resume", sys.argv[2] + "/resumed", "--no-plot"]), log=lambda line: None)
print(json.dumps({{"shard_shapes": shard_shapes, "rows": rows, "resumed": resumed}}))
"""


@ALGOS
def test_two_devices_match_one_device_and_resume_its_checkpoint(algo, full_run, tmp_path):
    """Splitting the environments over 2 devices changes only the order of floating-point sums in the reductions
    across devices (batch means, gradients, normaliser); random numbers do not depend on the sharding
    (threefry is partitionable). Over 6 iterations that leaves differences of float32 rounding size
    (measured ~1e-7 relative), so rtol 1e-4 passes with a wide margin yet fails on any real change.
    A checkpoint holds whole arrays, so the 1-device run's checkpoint resumes on 2 devices as well."""
    cfg, reference = full_run(algo)
    config = algo.config_dict(cfg) | {"out_dir": str(tmp_path / "run"), "checkpoint_every": 0}
    shutil.copy(os.path.join(cfg.out_dir, "checkpoint_000000000256.msgpack"), tmp_path)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_RUN.format(algo=algo.__name__), json.dumps(config),
                           str(tmp_path), str(tmp_path / "cache")], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shard_shapes"] == [[1, 4]]  # each device holds 4 of the 8 environments
    assert len(result["rows"]) == len(result["resumed"]) == len(reference) == 3
    np.testing.assert_equal(strip_timing(result["resumed"][:2]), strip_timing(reference[:2]))  # saved rows (nan == nan)
    for rows in (result["rows"], result["resumed"]):
        for a, b in zip(strip_timing(rows), strip_timing(reference)):
            for k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


DISTRIBUTED_FLAGS = {ppo_jax: ["--policy-hidden", "16", "--value-hidden", "16"],
                     trudi_jax: ["--actor-hidden", "16", "--critic-hidden", "16", "--num-bins", "11",
                                 "--num-diffusion-steps", "2"]}


@ALGOS
def test_distributed_two_processes_match_one_process(algo, full_run, tmp_path):
    """--distributed on 2 CPU processes (one device each, gloo collectives): the environments are split across
    the processes, process 0 alone writes metrics and checkpoints (gathered from both). As with 2 devices
    in one process, only the order of floating-point sums differs (measured: PPO 5e-4 relative at most, on
    approx_kl, a difference of two nearly equal log-probabilities; TruDi 1e-7), hence rtol 1e-3."""
    import socket
    cfg, reference = full_run(algo)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    flags = ["--env", "CartpoleBalance", "--num-envs", "8", "--rollout-steps", "8", "--num-minibatches", "2",
             "--num-epochs", "1", "--total-steps", str(8 * 8 * 2 * 3), "--num-evals", "3", "--num-eval-envs", "0",
             "--episode-length", "50", *DISTRIBUTED_FLAGS[algo], "--no-plot",
             "--checkpoint-every", "1", "--out-dir", str(tmp_path / "run"), "--distributed",
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, f"{algo.__name__}.py"] + flags + ["--process-id", str(i)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    name = algo.run_name(cfg)
    assert "(2 devices)" in outputs[0][0] and f"[{name}" not in outputs[1][0]  # process 1 does not log
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    assert len(rows) == len(reference) == 3
    for a, b in zip(strip_timing(rows), strip_timing(reference)):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-6, err_msg=k)
    meta, payload = algo.read_checkpoint(str(tmp_path / "run" / "checkpoint.msgpack"))
    init, _, _ = algo.make_train(cfg, algo.make_env(cfg.env))
    state = algo.restore_state("", meta, payload, jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32)))
    assert state.env_state.t.shape == (1, 8) and int(state.iteration[0]) == 6  # both processes' environments


# ---------------------------------------------------------------------------------------------
# The run-management part is one text in both files
# ---------------------------------------------------------------------------------------------
FENCE = "# Run management: video, checkpoints, devices, logging, the host loop and the command line."


def test_run_management_is_the_same_text_in_both_files():
    """Everything from the fence to the end of the file, and each function in it, is identical in ppo_jax.py
    and trudi_jax.py; what differs is named before the fence (ALGO, run_name, policy_of, eval_policy, ...)."""
    texts = {}
    for algo in (ppo_jax, trudi_jax):
        source = inspect.getsource(algo)
        assert source.count(FENCE) == 1
        texts[algo] = source[source.index(FENCE):]
    assert texts[ppo_jax] == texts[trudi_jax]
    shared = [name for name, fn in vars(trudi_jax).items() if inspect.isfunction(fn) and fn.__module__ == "trudi_jax"
              and inspect.getsource(fn) in texts[trudi_jax]]
    assert {"train", "read_checkpoint", "restore_state", "parse_config", "save_checkpoint", "evaluate_checkpoint",
            "open_sinks", "run_directory", "log_line", "config_from_dict"} <= set(shared)
    for name in shared:
        assert inspect.getsource(getattr(ppo_jax, name)) == inspect.getsource(getattr(trudi_jax, name)), name
    # the names the shared part uses of each algorithm exist in both, and only these differ
    hooks = ("ALGO", "IDENTITY_FIELDS", "PROGRESS_METRICS", "run_name", "policy_of", "eval_policy", "make_train",
             "make_env", "validate", "chunk_iterations", "run_episodes", "preset_config", "Config", "RUN_FIELDS",
             "NONFINITE_CHECKS", "TrainState", "observation", "ADDED_FIELDS")
    for name in hooks:
        assert hasattr(ppo_jax, name) and hasattr(trudi_jax, name), name


ENV_FENCE = "# Environment: Playground / Brax task by name, time limit, auto-reset from a fresh pool."


def test_environment_layer_and_normaliser_are_the_same_text_in_both_files():
    """The environment section and the observation normaliser (from the environment header to the networks
    header) are one text in both files, so the two copies cannot drift; each file still stands alone."""
    texts = {}
    for algo in (ppo_jax, trudi_jax):
        source = inspect.getsource(algo)
        assert source.count(ENV_FENCE) == 1 and source.count("\n# Networks:") == 1
        texts[algo] = source[source.index(ENV_FENCE):source.index("\n# Networks:")]
    assert texts[ppo_jax] == texts[trudi_jax]
    for name in ("make_env", "env_step", "env_reset", "desynchronize", "refresh_pool", "normalizer_update",
                 "normalize", "observation"):
        assert inspect.getsource(getattr(trudi_jax, name)) in texts[trudi_jax], name
