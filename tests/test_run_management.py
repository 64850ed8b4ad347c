"""Checkpoints, resume, evaluation of a saved policy, video, failure handling, devices and logging sinks.

Run-management code is duplicated in ppo_jax.py and trudi_jax.py (each file stands alone): test both copies.
One short CartpoleBalance run per algorithm (checkpoint every log point) is shared by most tests.
"""
import csv
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
TIMING = ("wall_s", "steps_per_sec")  # the only columns allowed to differ between identical runs


def tiny(algo, out_dir, **overrides):
    """A CartpoleBalance run of 3 log points x 2 iterations that compiles in well under a minute on CPU."""
    common = dict(env="CartpoleBalance", num_envs=8, rollout_steps=8, num_minibatches=2, num_epochs=1,
                  total_steps=8 * 8 * 2 * 3, num_evals=3, num_eval_envs=2, episode_length=50, out_dir=str(out_dir),
                  plot=False, checkpoint_every=1)
    if algo is trudi_jax:
        common.update(actor_hidden=(16,), critic_hidden=(16,), num_bins=11, num_diffusion_steps=2)
    else:
        common.update(policy_hidden=(16,), value_hidden=(16,))
    return algo.Config(**(common | overrides))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted reference run of each algorithm: (config, rows); its checkpoint is in cfg.out_dir."""
    runs = {}

    def get(algo):
        if algo not in runs:
            cfg = tiny(algo, tmp_path_factory.mktemp(algo.__name__ + "_full"))
            runs[algo] = cfg, algo.train(cfg, log=lambda line: None)
        return runs[algo]
    return get


def strip_timing(rows):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def assert_rows_equal(a, b):
    """Exactly equal (NaN == NaN), timing columns aside."""
    assert len(a) == len(b)
    for x, y in zip(strip_timing(a), strip_timing(b)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), (k, x[k], y[k])


# ---------------------------------------------------------------------------------------------
# Checkpoints and resume
# ---------------------------------------------------------------------------------------------
@ALGOS
def test_resumed_run_reproduces_uninterrupted_run_bit_exactly(algo, full_run, tmp_path):
    cfg, reference = full_run(algo)
    interrupted = tiny(algo, tmp_path / "run")

    def ctrl_c_after_second_log_point(line):
        if f"steps {2 * 8 * 8 * 2:,} " in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        algo.train(interrupted, log=ctrl_c_after_second_log_point)
    meta, _ = algo.read_checkpoint(str(tmp_path / "run" / "checkpoint.msgpack"))
    assert meta["chunks_done"] == 2

    resumed_cfg = algo.parse_config(["--resume", str(tmp_path / "run")])
    assert resumed_cfg.out_dir == str(tmp_path / "run") and resumed_cfg.num_envs == 8  # the saved config
    rows = algo.train(resumed_cfg, log=lambda line: None)
    assert_rows_equal(rows, reference)
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == len(reference)
    # and the final train states are identical, array by array
    _, a = algo.read_checkpoint(os.path.join(cfg.out_dir, "checkpoint.msgpack"))
    _, b = algo.read_checkpoint(str(tmp_path / "run" / "checkpoint.msgpack"))
    assert a == b


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
        assert state.actor_opt_state is not None and state.critic_opt_state is not None
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
    algo.save_checkpoint(path, {"w": np.arange(3.0)}, {"step": 1})
    good = open(path, "rb").read()

    def crash(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(algo.os, "replace", crash)
    with pytest.raises(OSError):
        algo.save_checkpoint(path, {"w": np.arange(3.0) + 1}, {"step": 2})
    assert open(path, "rb").read() == good  # the previous checkpoint survived
    monkeypatch.undo()
    assert algo.read_checkpoint(path)[0]["step"] == 1


@ALGOS
def test_loading_a_checkpoint_never_unpickles(algo, full_run, monkeypatch):
    cfg, _ = full_run(algo)

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    path = os.path.join(cfg.out_dir, "checkpoint.msgpack")
    meta, payload = algo.read_checkpoint(path)
    init, _, _ = algo.make_train(cfg, algo.make_env(cfg.env))
    algo.restore_state(path, meta, payload, jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32)))


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
    assert "±" in lines[0] and "over 5 episodes" in lines[0]


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
    monkeypatch.setattr(algo, "make_env", lambda name, backend="mjx": env)
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
    wandb_run = types.SimpleNamespace(log=lambda row, step: logged.append((row, step)), finish=lambda: None)
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


@ALGOS
def test_nonfinite_observations_stop_the_run_at_once(algo, monkeypatch, tmp_path):
    env = point_env(algo, lambda sim, nxt, action: nxt, reset_obs=(0.0, np.nan))
    cfg, lines, run = run_point(algo, monkeypatch, env, tmp_path)
    with pytest.raises(SystemExit, match="non-finite observations at iteration 0 .* no checkpoint written"):
        run()
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.msgpack"))


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
    (["--num-evals", "0"], "--num-evals and --num-eval-envs must be positive"),
]


@ALGOS
@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[f[0][0] for f in BAD_FLAGS])
def test_impossible_configuration_exits_with_one_line_before_compiling(algo, flags, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as error:
        algo.train(algo.parse_config(flags + ["--out-dir", str(out)]), log=lambda line: None)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


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
import json, sys
import jax
import numpy as np
import {algo}
cfg = {algo}.config_from_dict(json.loads(sys.argv[1]))
assert jax.device_count() == 2
init, _, _ = {algo}.make_train(cfg, {algo}.make_env(cfg.env))
keys = jax.numpy.zeros((1, 2), jax.numpy.uint32)
mesh = {algo}.Mesh(np.array(jax.devices()), ("envs",))
shardings = {algo}.state_shardings(jax.eval_shape(jax.vmap(init), keys), mesh)
ts = jax.jit(jax.vmap(init), out_shardings=shardings)(keys)
shard_shapes = sorted({{s.data.shape for s in ts.env_state.t.addressable_shards}})
rows = {algo}.train(cfg, log=lambda line: None)
print(json.dumps({{"shard_shapes": shard_shapes, "rows": rows}}))
"""


@ALGOS
def test_two_devices_match_one_device(algo, full_run, tmp_path):
    """Splitting the environments over 2 devices changes only the order of floating-point sums in the reductions
    across devices (batch means, gradients, normaliser); random numbers do not depend on the sharding
    (threefry is partitionable). Over 6 iterations that leaves differences of float32 rounding size
    (measured ~1e-7 relative), so rtol 1e-4 passes with a wide margin yet fails on any real change."""
    cfg, reference = full_run(algo)
    config = algo.config_dict(cfg) | {"out_dir": str(tmp_path), "checkpoint_every": 0}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARDED_RUN.format(algo=algo.__name__), json.dumps(config)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shard_shapes"] == [[1, 4]]  # each device holds 4 of the 8 environments
    for a, b in zip(strip_timing(result["rows"]), strip_timing(reference)):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_distributed_two_processes_match_one_process(full_run, tmp_path):
    """--distributed on 2 CPU processes (one device each, gloo collectives): the environments are split across
    the processes, process 0 alone writes metrics and checkpoints (gathered from both). As with 2 devices
    in one process, only the order of floating-point sums differs (measured: 5e-4 relative at most, on
    approx_kl, a difference of two nearly equal log-probabilities), hence rtol 1e-3."""
    import socket
    cfg, reference = full_run(ppo_jax)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    flags = ["--env", "CartpoleBalance", "--num-envs", "8", "--rollout-steps", "8", "--num-minibatches", "2",
             "--num-epochs", "1", "--total-steps", str(8 * 8 * 2 * 3), "--num-evals", "3", "--num-eval-envs", "2",
             "--episode-length", "50", "--policy-hidden", "16", "--value-hidden", "16", "--no-plot",
             "--checkpoint-every", "1", "--out-dir", str(tmp_path / "run"), "--distributed",
             "--coordinator-address", f"localhost:{port}", "--num-processes", "2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "ppo_jax.py"] + flags + ["--process-id", str(i)], cwd=REPO_ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "(2 devices)" in outputs[0][0] and "[ppo" not in outputs[1][0]  # process 1 does not log
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    for a, b in zip(strip_timing(rows), strip_timing(reference)):
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-3, atol=1e-6, err_msg=k)
    meta, payload = ppo_jax.read_checkpoint(str(tmp_path / "run" / "checkpoint.msgpack"))
    init, _, _ = ppo_jax.make_train(cfg, ppo_jax.make_env(cfg.env))
    state = ppo_jax.restore_state("", meta, payload, jax.eval_shape(jax.vmap(init), jnp.zeros((1, 2), jnp.uint32)))
    assert state.env_state.t.shape == (1, 8) and int(state.iteration[0]) == 6  # both processes' environments
