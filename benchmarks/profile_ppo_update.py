"""ppo_jax's minibatch step against Brax PPO's, and both against the floor of the same networks (issue: speed,
item 5). benchmarks/throughput.py --quick splits each trainer's time per env step into rollout and update; this
script takes the update apart.

    python benchmarks/profile_ppo_update.py                      # CheetahRun, throughput.py --quick's batch shape
    python benchmarks/profile_ppo_update.py --env CartpoleBalance --json out.json

One real rollout of ppo_jax (throughput.py --quick: 128 envs x 32 steps, 8 minibatches, its networks) gives the
data; every piece is compiled alone as a scan of --steps minibatch steps (so a call's dispatch is spread over many
steps, as inside a training program), timed in alternating rounds, median of --repeats. FLOPs are XLA's cost
analysis of one step with its scans unrolled (as throughput.py counts them). Pieces:
  ppo_jax      ppo_jax.update_minibatch: PPO loss gradient, clip, Adam (advantages and targets precomputed)
  ppo_jax_epoch  ppo_jax.update_epochs for one epoch, per minibatch step: the step plus the epoch's permutation
               and gather of the batch
  brax         Brax PPO's minibatch step as brax/training/agents/ppo/train.py runs it (its compute_ppo_loss on a
               [batch_size envs, unroll_length] slice: observation normalisation, GAE and the bootstrap value inside
               the loss; value_and_grad, clip, Adam), with Brax's networks of the same widths
  floor        the same two networks as ppo_jax, forward and backward on the minibatch with a squared-output loss,
               clip and Adam: the dense layers' work with nothing of PPO around it
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_jax as P  # noqa: E402
from benchmarks.throughput import QUICK, alternating_medians, cost, ppo_config  # noqa: E402


def rollout_batch(cfg: P.Config):
    """A learner, its params and optimiser state, and one real rollout with its GAE targets."""
    env = P.make_env(cfg.env)
    lr = P.make_learner(cfg, env)
    key = jax.random.PRNGKey(0)
    ts = jax.jit(lambda k: P.init_train_state(lr, k))(key)
    _, _, traj, _ = jax.jit(lambda ts, k: P.collect_rollout(lr, ts, k, False))(ts, key)
    batch = jax.jit(lambda ts, tr: P.compute_targets(lr, ts.params, ts.norm, tr))(ts, traj)
    return lr, ts, traj, batch


def brax_step(cfg: P.Config, obs_size: int, action_size: int, traj: P.Transition):
    """Brax PPO's minibatch step and its inputs (params, optimiser state, normaliser, one [B, T] minibatch)."""
    from brax.training import gradients, types
    from brax.training.acme import running_statistics, specs
    from brax.training.agents.ppo import losses, networks

    nets = networks.make_ppo_networks(obs_size, action_size,
                                      preprocess_observations_fn=running_statistics.normalize,
                                      policy_hidden_layer_sizes=cfg.policy_hidden,
                                      value_hidden_layer_sizes=cfg.value_hidden)
    k_pi, k_v = jax.random.split(jax.random.PRNGKey(1))
    params = losses.PPONetworkParams(policy=nets.policy_network.init(k_pi), value=nets.value_network.init(k_v))
    normalizer = running_statistics.update(
        running_statistics.init_state(specs.Array((obs_size,), jnp.dtype("float32"))), traj.obs)
    clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    optimizer = optax.chain(*clip, optax.adam(cfg.learning_rate))
    loss_fn = functools.partial(losses.compute_ppo_loss, ppo_network=nets, entropy_cost=cfg.entropy_coef,
                                discounting=cfg.gamma, reward_scaling=1.0, gae_lambda=cfg.gae_lambda,
                                clipping_epsilon=cfg.clip_eps, normalize_advantage=cfg.normalize_advantage,
                                vf_coefficient=cfg.value_coef)
    grad_fn = gradients.loss_and_pgrad(loss_fn, pmap_axis_name=None, has_aux=True)
    # Brax's minibatch: batch_size = num_envs / num_minibatches whole rollouts, [B, T] (time second)
    envs = cfg.num_envs // cfg.num_minibatches
    take = lambda x: jnp.swapaxes(x[:, :envs], 0, 1)
    logits = nets.policy_network.apply(normalizer, params.policy, traj.obs)  # the behaviour policy's outputs
    data = types.Transition(
        observation=take(traj.obs), action=take(jnp.tanh(traj.u)), reward=take(traj.reward),
        discount=take(1.0 - traj.terminated), next_observation=take(traj.next_obs),
        extras={"policy_extras": {"raw_action": take(traj.u), "log_prob": take(traj.log_prob),
                                  "distribution_params": take(logits)},
                "state_extras": {"truncation": take(traj.truncated)}})

    def step(carry, data):  # as minibatch_step in brax/training/agents/ppo/train.py (no adaptive-KL schedule)
        opt_state, params, key = carry
        key, key_loss = jax.random.split(key)
        (_, metrics), grads = grad_fn(params, normalizer, data, key_loss)
        updates, opt_state = optimizer.update(grads, opt_state)
        return (opt_state, optax.apply_updates(params, updates), key), metrics

    return step, (optimizer.init(params), params, jax.random.PRNGKey(2)), data


def floor_step(lr: P.Learner):
    """The dense layers' work of ppo_jax's step: both networks forward and backward, clip, Adam."""
    def loss(params, obs):
        mean, _ = lr.policy.apply(params["policy"], obs)
        value = lr.value_net.apply(params["value"], obs)
        return jnp.mean(mean**2) + jnp.mean(value**2)

    def step(carry, obs):
        params, opt_state = carry
        grads = jax.grad(loss)(params, obs)
        updates, opt_state = lr.optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None
    return step


def repeated(step, steps: int):
    """fn(carry, minibatch) -> carry after `steps` steps on the same minibatch, one compiled scan."""
    return lambda carry, mb: jax.lax.scan(lambda c, _: (step(c, mb)[0], None), carry, None, length=steps)[0]


def pieces(cfg: P.Config, steps: int):
    lr, ts, traj, batch = rollout_batch(cfg)
    size = cfg.num_envs * cfg.rollout_steps // cfg.num_minibatches
    mb = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:size], batch)
    brax, brax_carry, brax_data = brax_step(cfg, lr.env.obs_size, lr.env.action_size, traj)
    ours = functools.partial(P.update_minibatch, lr)
    one_epoch = dataclasses.replace(cfg, num_epochs=1)
    epoch_lr = lr._replace(cfg=one_epoch)
    epochs = steps // cfg.num_minibatches

    def epoch_run(carry, batch):  # `epochs` single-epoch update_epochs calls: steps minibatch steps in all
        def body(c, k):
            return P.update_epochs(epoch_lr, c, batch, k)[0], None
        return jax.lax.scan(body, carry, jax.random.split(jax.random.PRNGKey(3), epochs))[0]

    carry = (ts.params, ts.opt_state)
    return {  # name: (timed fn, its args, one step's fn for the FLOP count, its args, minibatch steps per call)
        "ppo_jax": (repeated(ours, steps), (carry, mb), ours, (carry, mb), steps),
        "ppo_jax_epoch": (epoch_run, (carry, batch), lambda c, b: P.update_epochs(epoch_lr, c, b,
                                                                                   jax.random.PRNGKey(3))[0],
                          (carry, batch), epochs * cfg.num_minibatches),
        "brax": (repeated(brax, steps), (brax_carry, brax_data), brax, (brax_carry, brax_data), steps),
        "floor": (repeated(floor_step(lr), steps), (carry, mb.obs), floor_step(lr), (carry, mb.obs), steps),
    }, size


def profile(cfg: P.Config, steps: int, repeats: int, log=print) -> dict:
    table, size = pieces(cfg, steps)
    medians = alternating_medians({name: (fn, args) for name, (fn, args, *_) in table.items()}, repeats)
    out = {}
    for name, (fn, args, one, one_args, n) in table.items():
        flops = cost(one, *one_args)["flops"]
        if name == "ppo_jax_epoch":
            flops /= cfg.num_minibatches  # one epoch counted: per minibatch step
        row = out[name] = {"flops_per_minibatch_step": flops, "ms_per_minibatch_step": medians[name] / n * 1e3}
        row["us_per_env_step"] = row["ms_per_minibatch_step"] * 1e3 * cfg.num_epochs / size
        row["gflop_per_s"] = row["flops_per_minibatch_step"] / row["ms_per_minibatch_step"] / 1e6
        log(f"  {name:14s} {row['ms_per_minibatch_step']:7.3f} ms per minibatch step ({row['us_per_env_step']:5.1f} "
            f"us per env step at {cfg.num_epochs} epochs)  {row['flops_per_minibatch_step'] / 1e6:8.1f} MFLOP  "
            f"{row['gflop_per_s']:6.1f} GFLOP/s")
    return out


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CheetahRun")
    parser.add_argument("--steps", type=int, default=64, help="minibatch steps per timed call")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = ppo_config(QUICK, args.env)
    print(f"[profile] {args.env}: {cfg.num_envs} envs x {cfg.rollout_steps} steps, {cfg.num_minibatches} minibatches "
          f"x {cfg.num_epochs} epochs, policy {cfg.policy_hidden}, value {cfg.value_hidden}", flush=True)
    result = {"env": args.env, "num_envs": cfg.num_envs, "rollout_steps": cfg.rollout_steps,
              "num_minibatches": cfg.num_minibatches, "num_epochs": cfg.num_epochs,
              "policy_hidden": cfg.policy_hidden, "value_hidden": cfg.value_hidden, "jax": jax.__version__,
              "device": f"{jax.devices()[0].platform} ({os.cpu_count()} cores, {platform.machine()})",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/profile_ppo_update.py", *argv])}
    result["pieces"] = profile(cfg, args.steps, args.repeats, log=lambda line: print(line, flush=True))
    p = result["pieces"]
    result["brax_over_ppo_jax_time"] = p["brax"]["ms_per_minibatch_step"] / p["ppo_jax"]["ms_per_minibatch_step"]
    result["brax_over_ppo_jax_flops"] = p["brax"]["flops_per_minibatch_step"] / p["ppo_jax"]["flops_per_minibatch_step"]
    result["ppo_jax_over_floor_time"] = p["ppo_jax"]["ms_per_minibatch_step"] / p["floor"]["ms_per_minibatch_step"]
    print(f"[profile] Brax / ppo_jax: time {result['brax_over_ppo_jax_time']:.2f}x, FLOPs "
          f"{result['brax_over_ppo_jax_flops']:.2f}x; ppo_jax / floor: time {result['ppo_jax_over_floor_time']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
