"""Humanoid task families: Playground's locomotion humanoids (meshes from the assets wheel, privileged critic,
domain randomisation), DM Control's humanoids and Brax's humanoid. Each family trains a couple of iterations at
tiny sizes (the physics dominates the compile time on CPU: G1's program compiles in about 2 minutes on
2 cores, so one program per family, compiled with XLA's optimisations off as in all quick tests, see conftest)."""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_jax
import trudi_jax

ALGOS = pytest.mark.parametrize("algo", [ppo_jax, trudi_jax], ids=["ppo", "trudi"])

STATE, PRIVILEGED, ACTIONS = 3, 5, 2


def tiny(algo, env, **overrides):
    """Two iterations of 4 envs x 4 steps, evaluated on 2 episodes of 8 steps, with 8-wide networks."""
    common = dict(env=env, num_envs=4, rollout_steps=4, num_minibatches=2, num_epochs=1, total_steps=32,
                  num_evals=1, num_eval_envs=2, episode_length=8, plot=False)
    if algo is trudi_jax:
        common.update(actor_hidden=(8,), critic_hidden=(8,), num_bins=11, num_diffusion_steps=2)
    else:
        common.update(policy_hidden=(8,), value_hidden=(8,))
    return dataclasses.replace(algo.preset_config("cpu", env), **(common | overrides))


def split_env(algo) -> "algo.Env":
    """An env whose observation vector is [state (3) | privileged state (5)] (never stepped here)."""
    return algo.Env(None, None, STATE + PRIVILEGED, ACTIONS, actor_reads=(0, STATE),
                    critic_reads=(STATE, STATE + PRIVILEGED))


def obs_gradients(algo, env):
    """|d(actor output)/d obs| and |d(critic output)/d obs| per observation entry, at random parameters."""
    cfg = tiny(algo, "CartpoleBalance")
    lr = algo.make_learner(cfg, env)
    obs, action = jax.random.normal(jax.random.PRNGKey(1), (STATE + PRIVILEGED,)), jnp.full(ACTIONS, 0.3)
    if algo is trudi_jax:
        policy = lr.actor.init(jax.random.PRNGKey(0))
        policy = jax.tree.map(lambda x: x + 0.1, policy)  # the control net's output layer starts at zero
        critic = lr.critic.init(jax.random.PRNGKey(2), obs[None], action[None], method="all_heads")
        actor_out = lambda o: lr.actor.sample(policy, o, jax.random.PRNGKey(3))[0].sum()
        critic_out = lambda o: lr.critic.apply(critic, o, action)[0].sum()
    else:
        policy = lr.policy.init(jax.random.PRNGKey(0), obs[None])
        policy = jax.tree.map(lambda x: x + 0.1, policy)  # the mean's output layer starts near zero
        value = lr.value_net.init(jax.random.PRNGKey(2), obs[None])
        actor_out = lambda o: lr.policy.apply(policy, o)[0].sum()
        critic_out = lambda o: lr.value_net.apply(value, o).sum()
    return np.abs(jax.grad(actor_out)(obs)), np.abs(jax.grad(critic_out)(obs))


@ALGOS
def test_actor_reads_the_state_and_critic_the_privileged_state(algo):
    actor, critic = obs_gradients(algo, split_env(algo))
    assert np.all(actor[:STATE] > 0) and np.all(actor[STATE:] == 0)
    assert np.all(critic[:STATE] == 0) and np.all(critic[STATE:] > 0)
    # --no-privileged-critic: make_env gives the critic the actor's slice
    actor, critic = obs_gradients(algo, split_env(algo)._replace(critic_reads=(0, STATE)))
    assert np.all(critic[:STATE] > 0) and np.all(critic[STATE:] == 0)


@ALGOS
def test_observation_vector_is_state_then_privileged_state(algo):
    class Sim:
        obs = {"privileged_state": jnp.arange(5.0) + 10, "state": jnp.arange(3.0)}
    np.testing.assert_array_equal(algo.observation(Sim), [0, 1, 2, 10, 11, 12, 13, 14])
    Sim.obs = {"state": jnp.arange(3.0)}
    np.testing.assert_array_equal(algo.observation(Sim), [0, 1, 2])


@ALGOS
def test_missing_assets_wheel_is_one_line_naming_the_install(algo, monkeypatch):
    real = importlib.import_module

    def without_assets(name, *args):
        if name == algo.HUMANOID_ASSETS:
            raise ImportError(name)
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", without_assets)
    with pytest.raises(SystemExit, match=r"pip install -r requirements-humanoid\.txt"):
        algo.make_env("T1JoystickFlatTerrain")


def test_humanoid_presets_put_the_returns_inside_the_critic_support():
    """REPPO's values per family: Brax humanoid rewards scaled by 0.1 on [0, 200], locomotion on [-10, 10]."""
    for preset in ("cpu", "paper"):
        brax = trudi_jax.preset_config(preset, "humanoid")
        assert (brax.reward_scale, brax.vmin, brax.vmax) == (0.1, 0.0, 200.0)
        g1 = trudi_jax.preset_config(preset, "G1JoystickFlatTerrain")
        assert (g1.vmin, g1.vmax) == (-10.0, 10.0)
    assert trudi_jax.preset_config("paper", "G1JoystickFlatTerrain").gamma == 0.97
    ppo = ppo_jax.preset_config("paper", "G1JoystickFlatTerrain")
    assert (ppo.num_envs, ppo.rollout_steps, ppo.num_minibatches, ppo.num_epochs) == (8192, 20, 32, 4)
    assert ppo.policy_hidden == ppo.value_hidden == (512, 256, 128) and ppo.gamma == 0.97


def train_two_iterations(algo, cfg):
    env = algo.make_env(cfg.env, cfg.backend, cfg.privileged_critic, cfg.domain_randomization)
    init, chunk, iterations = algo.make_train(cfg, env)
    ts = jax.jit(init)(jax.random.PRNGKey(0))
    ts, metrics = jax.jit(chunk)(ts)
    assert iterations == 2 and int(ts.iteration) == 2
    metrics = jax.device_get(metrics)
    assert int(metrics["nonfinite_iteration"]) == -1  # observations, rewards, losses, parameters all finite
    assert np.isfinite(metrics["eval_return"]) == (cfg.num_eval_envs > 0)
    obs = algo.observation(ts.env_state.sim)
    assert obs.shape == (cfg.num_envs, env.obs_size) and np.isfinite(np.asarray(obs)).all()
    return env, ts


def test_g1_trains_offline_with_privileged_critic_and_randomised_robots():
    """TruDi on G1 (the environment layer is the same text in ppo_jax.py, its networks' slices are tested above)."""
    algo = trudi_jax
    cfg = tiny(algo, "G1JoystickFlatTerrain", num_eval_envs=0)  # no evaluation copy of its physics to compile
    env, ts = train_two_iterations(algo, cfg)
    assert env.actor_reads == (0, 103) and env.critic_reads == (103, 319) and env.action_size == 29
    assert env.randomized
    # every environment and every pool slot carries its own robot: the drawn model fields (friction, masses, ...)
    # differ between environments 0 and 1 and between pool slots 0 and 1
    for states in (ts.env_state, ts.reset_pool):
        robots = [np.asarray(x) for x in jax.tree.leaves(states.sim.info[algo.ROBOT])]
        assert robots and any(np.abs(x[0] - x[1]).max() > 0 for x in robots)
    # the critic's first layer takes the privileged state (216) and, for TruDi's Q, the action (29)
    kernels = [x.shape[0] for x in jax.tree.leaves(ts.critic_params) if x.ndim == 2]
    assert 216 + 29 in kernels


@pytest.mark.parametrize("algo, env_name", [(trudi_jax, "HumanoidWalk"), (ppo_jax, "humanoid")],
                         ids=["trudi-HumanoidWalk", "ppo-brax-humanoid"])
def test_dm_control_and_brax_humanoids_train(algo, env_name):
    evaluated = env_name == "HumanoidWalk"  # Brax humanoid: no evaluation copy of its physics to compile
    env, _ = train_two_iterations(algo, tiny(algo, env_name, num_eval_envs=2 if evaluated else 0))
    assert env.actor_reads == env.critic_reads == (0, env.obs_size) and not env.randomized
