"""The environment layer is duplicated in ppo_jax.py and trudi_jax.py (each file stands alone): test both copies."""
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_jax
import trudi_jax

ALGOS = pytest.mark.parametrize("algo", [ppo_jax, trudi_jax], ids=["ppo", "trudi"])


@flax.struct.dataclass
class CounterSim:
    obs: jax.Array  # [steps since reset, id of the reset that started the episode]
    reward: jax.Array
    done: jax.Array


def counter_env(algo):
    def reset(key):
        return CounterSim(jnp.array([0.0, jax.random.uniform(key)]), jnp.zeros(()), jnp.zeros(()))

    def step(sim, action):
        return sim.replace(obs=sim.obs.at[0].add(1.0), reward=jnp.ones(()), done=jnp.zeros(()))

    return algo.Env(reset, step, 2, 1)


@ALGOS
def test_truncated_step_reports_final_obs_and_continues_from_pool(algo):
    env = counter_env(algo)
    state = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(0), 2))._replace(t=jnp.array([2, 0]))
    pool = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(1), 2))
    state, step = algo.env_step(env, state, jnp.zeros((2, 1)), pool, episode_length=3)
    np.testing.assert_array_equal(step.truncated, [1.0, 0.0])
    np.testing.assert_array_equal(step.terminated, [0.0, 0.0])
    np.testing.assert_array_equal(step.final_obs[:, 0], [1.0, 1.0])  # the true next observation
    np.testing.assert_array_equal(state.sim.obs[0], pool.sim.obs[0])  # env 0 restarted from its pool slot
    np.testing.assert_array_equal(state.sim.obs[1, 0], 1.0)  # env 1 runs on
    np.testing.assert_array_equal(state.t, [0, 1])


@ALGOS
def test_reset_pool_is_renewed_whole_once_per_episode_length_and_kept_in_between(algo):
    """refresh_pool re-samples every slot where renew, else returns the pool unchanged; the training loop renews at
    the chunk's iterations 0, P, 2P, ... (P = episode_length // rollout_steps: the next test). A predicate without
    a seed axis keeps the lax.cond a branch under vmap over seeds: a select would run the resets (up to 200 physics
    steps each) at every iteration."""
    env = counter_env(algo)
    assert algo.pool_renewal_period(100, 25) == 4 and algo.pool_renewal_period(10, 25) == 1
    pool = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(0), 8))
    kept = algo.refresh_pool(env, pool, jax.random.PRNGKey(1), jnp.array(False))
    renewed = algo.refresh_pool(env, pool, jax.random.PRNGKey(1), jnp.array(True))
    jax.tree.map(np.testing.assert_array_equal, kept, pool)
    assert np.all(np.asarray(renewed.sim.obs[:, 1]) != np.asarray(pool.sim.obs[:, 1]))  # every slot fresh
    pools = jax.tree.map(lambda x: jnp.stack([x, x]), pool)  # 2 seeds
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    seeds = jax.vmap(lambda p, k, i: algo.refresh_pool(env, p, k, i % 4 == 0), in_axes=(0, 0, None))
    assert "cond[" in str(jax.make_jaxpr(seeds)(pools, keys, 3))  # a branch, not a select of both
    np.testing.assert_array_equal(seeds(pools, keys, 3).sim.obs, pools.sim.obs)
    assert np.all(np.asarray(seeds(pools, keys, 4).sim.obs[:, :, 1]) != np.asarray(pools.sim.obs[:, :, 1]))


@ALGOS
def test_training_loop_renews_the_pool_at_iterations_0_and_P_of_a_chunk_for_all_seeds_at_once(algo):
    """A chunk of 8 iterations with P = 20 // 5 = 4, 2 seeds vmapped: env.reset runs at iterations 0 and 4 only (a
    callback in it counts its calls: one per vmapped call), not at all 8 as a select under vmap would."""
    calls = []
    env = counter_env(algo)

    def reset(key, reset=env.reset):
        jax.debug.callback(lambda: calls.append(1))
        return reset(key)
    nets = (dict(policy_hidden=(8,), value_hidden=(8,)) if algo is ppo_jax else
            dict(actor_hidden=(8,), critic_hidden=(8,), num_bins=11, num_diffusion_steps=2))
    cfg = algo.Config(num_envs=4, rollout_steps=5, num_minibatches=2, num_epochs=1, total_steps=4 * 5 * 8,
                      num_evals=1, num_eval_envs=0, episode_length=20, num_seeds=2, **nets)
    assert algo.chunk_iterations(cfg) == 8 and algo.pool_renewal_period(20, 5) == 4
    init, chunk, _ = algo.make_train(cfg, env._replace(reset=reset))
    ts = jax.jit(jax.vmap(init))(jax.random.split(jax.random.PRNGKey(0), 2))
    jax.effects_barrier()
    assert len(calls) == 2  # the environments' first states and the first pool
    calls.clear()
    jax.block_until_ready(jax.jit(jax.vmap(chunk))(ts))
    jax.effects_barrier()
    assert len(calls) == 2


@ALGOS
def test_desynchronized_clocks_spread_over_the_time_limit_and_hide_cut_episodes(algo):
    env = counter_env(algo)
    state = algo.env_reset(env, jax.random.split(jax.random.PRNGKey(0), 256))
    state = algo.desynchronize(state, jax.random.PRNGKey(1), 1000)
    t = np.asarray(state.t)
    assert t.min() >= 0 and t.max() < 1000 and len(np.unique(t)) > 200
    assert np.all(np.isnan(np.asarray(state.ret)[t > 0]))  # a cut episode's return is never reported


@ALGOS
def test_over_seeds_maps_the_seed_axis_with_or_without_vmap(algo):
    """One seed: a plain call on the squeezed arguments; several: vmap. Same results, seed axis kept."""
    vmapped = []

    def fn(state, key):
        assert state["x"].shape == (4,)  # one seed's state either way
        vmapped.append(isinstance(state["x"], jax.core.Tracer))
        return {"x": state["x"] * 2 + jax.random.normal(key, state["x"].shape)}, state["x"].sum()

    for num_seeds in (1, 3):
        state = {"x": jnp.arange(num_seeds * 4.0).reshape(num_seeds, 4)}
        keys = jax.random.split(jax.random.PRNGKey(0), num_seeds)
        got, want = algo.over_seeds(fn)(state, keys), jax.vmap(fn)(state, keys)
        assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)
        jax.tree.map(np.testing.assert_allclose, got, want)
    assert vmapped == [False, True, True, True]  # over_seeds(1 seed), vmap(1), over_seeds(3 seeds), vmap(3)


TINY = {ppo_jax: dict(policy_hidden=(8,), value_hidden=(8,)),
        trudi_jax: dict(actor_hidden=(8,), critic_hidden=(8,), num_bins=11, num_diffusion_steps=2)}


def tiny_config(algo, **kw):
    return algo.Config(**TINY[algo], num_envs=4, rollout_steps=2, num_minibatches=1, num_epochs=1, total_steps=8,
                       num_evals=1, num_eval_envs=2, episode_length=5, **kw)


@ALGOS
def test_clock_offsets_and_initial_states_use_different_keys(algo, monkeypatch):
    """init draws the environments' initial states and their clock offsets from two keys, not one: with one key,
    the offsets would be a function of the same random bits as the initial states."""
    seen = {}
    env_reset, desynchronize = algo.env_reset, algo.desynchronize
    monkeypatch.setattr(algo, "env_reset", lambda env, keys: seen.setdefault("reset", []).append(keys)
                        or env_reset(env, keys))
    monkeypatch.setattr(algo, "desynchronize", lambda state, key, length: seen.setdefault("clock", key)
                        is None or desynchronize(state, key, length))
    cfg = tiny_config(algo)
    init, _, _ = algo.make_train(cfg, counter_env(algo))
    init(jax.random.PRNGKey(0))
    clock_key = seen["clock"]
    for reset_keys in seen["reset"]:  # the initial states and the reset pool
        assert not np.array_equal(jax.random.split(clock_key, cfg.num_envs), reset_keys)
        assert not any(np.array_equal(clock_key, k) for k in reset_keys)


@ALGOS
def test_max_grad_norm_zero_turns_clipping_off_and_still_learns(algo):
    """--max-grad-norm 0 means no clipping (clipping to norm 0 would make every update zero): one iteration
    changes the parameters, as it does with clipping on."""
    for max_grad_norm in (0.0, 0.5):
        init, chunk, _ = algo.make_train(tiny_config(algo, max_grad_norm=max_grad_norm), counter_env(algo))
        ts = init(jax.random.PRNGKey(0))
        before = jax.tree.leaves(algo.policy_of(ts)[0])
        after = jax.tree.leaves(algo.policy_of(jax.jit(chunk)(ts)[0])[0])
        changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
        assert sum(changed) >= len(changed) // 2, (max_grad_norm, changed)
        assert all(np.isfinite(x).all() for x in after)


@ALGOS
def test_negative_max_grad_norm_is_refused(algo):
    with pytest.raises(SystemExit, match="max-grad-norm"):
        algo.validate(tiny_config(algo, max_grad_norm=-1.0))
