"""Evaluation that stops once every episode has ended (trudi_jax.run_episodes) against the fixed-length scan it
replaced (the former code, kept here): the same task, zero actions, 8 episodes of up to 1000 steps, timed after
compiling; the returns and lengths of both are printed side by side.

    python benchmarks/eval_early_stop.py --env G1JoystickFlatTerrain --json benchmarks/results/cpu/eval_early_stop_G1.json
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax as T  # noqa: E402


def run_episodes_scan(env, actor, key, num_episodes, episode_length):
    """The evaluation before 1f171f3: always episode_length steps, ended episodes masked."""
    k_reset, k_act = jax.random.split(key)
    sim = jax.vmap(env.reset)(jax.random.split(k_reset, num_episodes))

    def step(carry, k):
        sim, alive, ret, length = carry
        length = length + alive
        sim = jax.vmap(env.step)(sim, actor(T.observation(sim), k))
        alive = alive * jnp.isfinite(T.observation(sim)).all(-1) * jnp.isfinite(sim.reward)
        ret = ret + jnp.where(alive > 0, sim.reward, 0.0)
        return (sim, alive * (1.0 - (sim.done > 0)), ret, length), None
    zeros = jnp.zeros(num_episodes)
    (_, _, ret, length), _ = jax.lax.scan(step, (sim, jnp.ones(num_episodes), zeros, zeros),
                                          jax.random.split(k_act, episode_length))
    return ret.mean(), ret.std(), length.mean()


parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--env", default="G1JoystickFlatTerrain")
parser.add_argument("--episodes", type=int, default=8)
parser.add_argument("--episode-length", type=int, default=1000)
parser.add_argument("--json", default=None)
args = parser.parse_args()
env = T.make_env(args.env)
act = lambda obs, key: jnp.zeros((obs.shape[0], env.action_size))  # noqa: E731
out = {"env": args.env, "episodes": args.episodes, "episode_length": args.episode_length}
for label, fn in [("stops_when_all_ended", T.run_episodes), ("fixed_length_scan", run_episodes_scan)]:
    f = jax.jit(lambda key: fn(env, act, key, args.episodes, args.episode_length))
    start = time.perf_counter()
    jax.block_until_ready(f(jax.random.PRNGKey(0)))
    compile_s, runs = time.perf_counter() - start, []
    for i in (1, 2):
        start = time.perf_counter()
        ret, _, length = jax.block_until_ready(f(jax.random.PRNGKey(i)))
        runs.append({"seconds": time.perf_counter() - start, "return": float(ret), "length": float(length)})
    out[label] = {"first_call_s": compile_s, "runs": runs}
    print(label, out[label], flush=True)
out.update(jax=jax.__version__, device=f"{jax.devices()[0]} ({os.cpu_count()} cores)",
           date=time.strftime("%Y-%m-%dT%H:%M:%S"), command="python " + " ".join(sys.argv))
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
