"""Tests of ppo_jax.py: one test per equation or invariant, named after it."""
import contextlib
import csv
import dataclasses
import json
import os
import subprocess
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_jax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# Targets: GAE with terminations (no bootstrap) and truncations (bootstrap, no carry-over).
# ---------------------------------------------------------------------------------------------
def gae_reference(reward, value, next_value, terminated, truncated, gamma, lam):
    """Plain-Python double loop over envs b and time t (backwards), float64."""
    T, B = reward.shape
    advantage = np.zeros((T, B))
    for b in range(B):
        adv_next = 0.0  # A_T = 0
        for t in reversed(range(T)):
            delta = reward[t, b] + gamma * (1 - terminated[t, b]) * next_value[t, b] - value[t, b]
            done = max(terminated[t, b], truncated[t, b])
            adv_next = delta + gamma * lam * (1 - done) * adv_next
            advantage[t, b] = adv_next
    return advantage, advantage + value


def test_gae_matches_python_reference():
    rng = np.random.default_rng(0)
    T, B, gamma, lam = 7, 3, 0.97, 0.9
    reward, value, next_value = (rng.normal(size=(T, B)).astype(np.float32) for _ in range(3))
    terminated = np.zeros((T, B), np.float32)
    truncated = np.zeros((T, B), np.float32)
    terminated[[1, 4, 2], [0, 0, 2]] = 1.0
    truncated[[3, 5, 0], [1, 1, 2]] = 1.0
    advantage, returns = ppo_jax.gae(*map(jnp.asarray, (reward, value, next_value, terminated, truncated)),
                                     gamma, lam)
    ref_advantage, ref_returns = gae_reference(reward, value, next_value, terminated, truncated, gamma, lam)
    assert advantage.shape == returns.shape == (T, B)
    np.testing.assert_allclose(advantage, ref_advantage, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, ref_returns, rtol=1e-5, atol=1e-5)
    # the ends must matter: without them the reference gives a different answer
    ref_no_ends, _ = gae_reference(reward, value, next_value, 0 * terminated, 0 * truncated, gamma, lam)
    assert not np.allclose(advantage, ref_no_ends, atol=1e-3)


def test_gae_truncation_bootstraps_and_termination_does_not():
    """T=1: A = r + gamma * V(s') - V(s) at truncation, A = r - V(s) at termination."""
    r, v, v_next, gamma, lam = 1.0, 0.5, 2.0, 0.9, 0.95
    one = lambda x: jnp.full((1, 1), x, jnp.float32)  # noqa: E731
    adv_trunc, ret_trunc = ppo_jax.gae(one(r), one(v), one(v_next), one(0.0), one(1.0), gamma, lam)
    adv_term, ret_term = ppo_jax.gae(one(r), one(v), one(v_next), one(1.0), one(0.0), gamma, lam)
    np.testing.assert_allclose(adv_trunc[0, 0], r + gamma * v_next - v, rtol=1e-6)
    np.testing.assert_allclose(ret_trunc[0, 0], r + gamma * v_next, rtol=1e-6)
    np.testing.assert_allclose(adv_term[0, 0], r - v, rtol=1e-6)
    np.testing.assert_allclose(ret_term[0, 0], r, rtol=1e-6)


def test_gae_done_stops_the_recursion():
    """A_t at a truncation ignores A_{t+1} (the next step belongs to a new episode)."""
    reward = jnp.array([[1.0], [100.0]])
    zeros = jnp.zeros((2, 1))
    adv, _ = ppo_jax.gae(reward, zeros, zeros, zeros, jnp.array([[1.0], [0.0]]), 0.9, 0.95)
    np.testing.assert_allclose(adv[:, 0], [1.0, 100.0], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Observation normaliser: merged running moments equal the moments of all data seen.
# ---------------------------------------------------------------------------------------------
def test_normalizer_matches_numpy():
    rng = np.random.default_rng(1)
    size = 3
    batches = [rng.normal(3.0, 2.0, shape + (size,)).astype(np.float32)
               for shape in [(5,), (17,), (1,), (4, 16), (2, 3, 7)]]  # leading dims are flattened
    norm = ppo_jax.normalizer_init(size)
    for x in batches:
        norm = ppo_jax.normalizer_update(norm, jnp.asarray(x))
    data = np.concatenate([x.reshape(-1, size) for x in batches]).astype(np.float64)
    assert float(norm.count) == len(data)
    np.testing.assert_allclose(norm.mean, data.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var, data.var(0), rtol=1e-5)

    z = np.asarray(ppo_jax.normalize(norm, jnp.asarray(data, jnp.float32)))
    np.testing.assert_allclose(z, (data - data.mean(0)) / np.sqrt(data.var(0) + 1e-8), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(z.std(0), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(ppo_jax.normalize(norm, data, enabled=False), data)


# ---------------------------------------------------------------------------------------------
# Environment: time-limit truncation keeps the true final observation; auto-reset from the pool.
# ---------------------------------------------------------------------------------------------
@flax.struct.dataclass
class FakeSim:
    obs: jax.Array  # (step counter, reset marker): the marker is > 0 only right after a reset
    reward: jax.Array
    done: jax.Array
    terminate_at: jax.Array  # the task ends the episode when the counter reaches this


NEVER = 10**6


def fake_reset(key):
    marker = 1.0 + jax.random.uniform(key)  # distinct per reset key
    return FakeSim(jnp.array([0.0, marker]), jnp.zeros(()), jnp.zeros(()), jnp.asarray(float(NEVER)))


def fake_step(sim, action):
    counter = sim.obs[0] + 1.0
    return sim.replace(obs=jnp.array([counter, 0.0]), reward=counter + 0.0 * action.sum(),
                       done=(counter >= sim.terminate_at).astype(jnp.float32))


FAKE_ENV = ppo_jax.Env(fake_reset, fake_step, obs_size=2, action_size=1)


def run_steps(state, reset_pool, episode_length, num_steps):
    steps = []
    for _ in range(num_steps):
        action = jnp.zeros((state.t.shape[0], 1))
        state, step = ppo_jax.env_step(FAKE_ENV, state, action, reset_pool, episode_length)
        steps.append(step)
    return state, steps


def test_truncation_bootstrap_uses_final_observation():
    episode_length, num_envs = 3, 2
    state = ppo_jax.env_reset(FAKE_ENV, jax.random.split(jax.random.PRNGKey(0), num_envs))
    reset_pool = ppo_jax.env_reset(FAKE_ENV, jax.random.split(jax.random.PRNGKey(1), num_envs))
    before, steps = run_steps(state, reset_pool, episode_length, episode_length - 1)
    for k, step in enumerate(steps):  # inside the episode nothing ends and the state carries on
        np.testing.assert_array_equal(step.truncated, 0.0)
        np.testing.assert_array_equal(step.terminated, 0.0)
        np.testing.assert_array_equal(step.final_obs[:, 0], k + 1)
    np.testing.assert_array_equal(before.t, episode_length - 1)

    state, step = ppo_jax.env_step(FAKE_ENV, before, jnp.zeros((num_envs, 1)), reset_pool, episode_length)
    np.testing.assert_array_equal(step.truncated, 1.0)
    np.testing.assert_array_equal(step.terminated, 0.0)
    # s'_T is the true next observation (counter = episode_length, no reset marker), not the pool's
    np.testing.assert_array_equal(step.final_obs, np.tile([float(episode_length), 0.0], (num_envs, 1)))
    np.testing.assert_array_equal(step.reward, float(episode_length))
    np.testing.assert_array_equal(step.episode_return, sum(range(1, episode_length + 1)))
    # the environment continues from its slot of the reset pool, with a fresh counter and return
    np.testing.assert_array_equal(state.sim.obs, reset_pool.sim.obs)
    assert not np.allclose(state.sim.obs, before.sim.obs)
    np.testing.assert_array_equal(state.t, 0)
    np.testing.assert_array_equal(state.ret, 0.0)


def test_termination_ends_episode_without_truncation():
    """Env 0 terminates at step 2 (which is also the time limit: termination wins); env 1 runs on."""
    episode_length, num_envs = 2, 2
    state = ppo_jax.env_reset(FAKE_ENV, jax.random.split(jax.random.PRNGKey(0), num_envs))
    state = state._replace(sim=state.sim.replace(terminate_at=jnp.array([2.0, NEVER])))
    reset_pool = ppo_jax.env_reset(FAKE_ENV, jax.random.split(jax.random.PRNGKey(1), num_envs))
    _, (first, second) = run_steps(state, reset_pool, episode_length=NEVER, num_steps=2)
    np.testing.assert_array_equal(first.terminated, [0.0, 0.0])
    np.testing.assert_array_equal(second.terminated, [1.0, 0.0])
    np.testing.assert_array_equal(second.truncated, [0.0, 0.0])
    np.testing.assert_array_equal(second.final_obs[0], [2.0, 0.0])
    np.testing.assert_array_equal(second.episode_return[0], 1.0 + 2.0)

    next_state, (_, at_limit) = run_steps(state, reset_pool, episode_length, num_steps=2)
    np.testing.assert_array_equal(at_limit.terminated, [1.0, 0.0])
    np.testing.assert_array_equal(at_limit.truncated, [0.0, 1.0])
    np.testing.assert_array_equal(next_state.sim.obs, reset_pool.sim.obs)  # both were reset
    np.testing.assert_array_equal(next_state.t, [0, 0])


# ---------------------------------------------------------------------------------------------
# Config / CLI: presets, flag overrides, one-line errors before anything is written.
# ---------------------------------------------------------------------------------------------
def run_cli(*args):
    return subprocess.run([sys.executable, "ppo_jax.py", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)


def assert_one_line_error(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_cli_unknown_env_exits_with_close_matches(tmp_path):
    out_dir = tmp_path / "run"
    message = assert_one_line_error(run_cli("--env", "CartpoleBalanc", "--out-dir", str(out_dir)))
    assert "did you mean CartpoleBalance" in message
    assert not out_dir.exists()
    with pytest.raises(SystemExit) as exit_info:  # a name absent from the message's fixed examples
        ppo_jax.make_env("CheetahRn")
    assert "did you mean CheetahRun" in str(exit_info.value)


def test_cli_indivisible_minibatches_exits_before_writing(tmp_path):
    out_dir = tmp_path / "run"
    cfg = ppo_jax.Config()
    assert (cfg.num_envs * cfg.rollout_steps) % 7 != 0
    message = assert_one_line_error(run_cli("--num-minibatches", "7", "--out-dir", str(out_dir)))
    assert "num-minibatches" in message
    assert not out_dir.exists()


def test_preset_and_flag_override():
    cfg = ppo_jax.parse_config(["--preset", "paper", "--env", "CheetahRun", "--num-envs", "16"])
    assert cfg == dataclasses.replace(ppo_jax.preset_config("paper", "CheetahRun"), num_envs=16)
    assert (cfg.env, cfg.preset, cfg.num_envs) == ("CheetahRun", "paper", 16)
    assert (cfg.rollout_steps, cfg.num_epochs, cfg.num_minibatches) == (480, 16, 32)
    assert (cfg.total_steps, cfg.learning_rate, cfg.gamma, cfg.reward_scale) == (60_000_000, 1e-3, 0.995, 10.0)

    humanoid = ppo_jax.parse_config(["--env", "humanoid", "--preset", "paper"])  # preset after env
    assert humanoid.reward_scale == 0.1
    assert (humanoid.num_envs, humanoid.rollout_steps, humanoid.gamma) == (2048, 160, 0.97)

    assert ppo_jax.parse_config([]) == ppo_jax.Config()  # the cpu preset is the dataclass default
    assert ppo_jax.parse_config(["--learning-rate=3e-4"]).learning_rate == 3e-4


# ---------------------------------------------------------------------------------------------
# End to end: the cpu preset learns CartpoleBalance (a zero action scores about 697).
# ---------------------------------------------------------------------------------------------
class Decided(Exception):
    """Raised from the log callback once enough seeds have passed: the rest of the budget is not needed."""


@pytest.mark.slow
def test_cpu_preset_learns_cartpole_balance(tmp_path, monkeypatch):
    """Three seeds of the cpu preset in one vmapped program. Measured 2026-12-03 (2-core CPU, 1.2M steps, 4 seeds):
    every seed passes 950 between 301k and 502k steps. A single seed's course depends on the machine's
    floating-point details (seed 0 alone stayed below 750 up to 600k on one machine), so the claim is about seeds:
    all but one of 3 pass 950 within 800k steps. The run stops at the first log point where 2 have passed
    (metrics.csv is written before each progress line): the same claim at a fraction of the cost."""
    monkeypatch.chdir(tmp_path)  # MuJoCo writes MUJOCO_LOG.TXT into the working directory
    cfg = dataclasses.replace(ppo_jax.parse_config(["--env", "CartpoleBalance", "--preset", "cpu"]), num_seeds=3,
                              total_steps=800_000, num_evals=8, num_eval_envs=32, out_dir=str(tmp_path / "run"))

    def table():
        with open(tmp_path / "run" / "metrics.csv") as f:
            return list(csv.DictReader(f))

    def best_per_seed():
        best = {}
        for r in table():
            best[r["seed"]] = max(best.get(r["seed"], -1.0), float(r["eval_return"]))
        return best

    def stop_when_decided(line):
        if " | eval " in line and sum(b >= 950 for b in best_per_seed().values()) >= 2:
            raise Decided

    with contextlib.suppress(Decided):
        ppo_jax.train(cfg, log=stop_when_decided)
    best = best_per_seed()
    assert sum(b >= 950 for b in best.values()) >= 2, best  # zero action: ~697
    rows = table()
    assert len(rows) % cfg.num_seeds == 0 and {r["seed"] for r in rows} == {"0", "1", "2"}
    assert {"env_steps", "eval_return", "steps_per_sec", "approx_kl"} <= set(rows[0])
    steps_per_log_point = ppo_jax.chunk_iterations(cfg) * cfg.num_envs * cfg.rollout_steps
    assert [int(r["env_steps"]) for r in rows] == [(i // cfg.num_seeds + 1) * steps_per_log_point
                                                   for i in range(len(rows))]
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["env"] == "CartpoleBalance"
