"""Where the time of one minibatch update goes, piece by piece, with FLOPs and FLOP rates (issue: speed at
the paper's sizes). At the paper preset the update is 98.5 % of TruDi's FLOPs per env step
(results/cpu/flops_paper.json), so its pieces decide whether TruDi wastes time per FLOP against REPPO.

    python benchmarks/profile_update.py                                   # TruDi and REPPO, paper preset, CartpoleBalance
    python benchmarks/profile_update.py --json benchmarks/results/cpu/profile_update.json
    python benchmarks/profile_update.py --runners trudi -- --num-old-chains 1  # flags after -- go to trudi_jax

Each piece is jitted alone on a real minibatch (one rollout, its targets, the first minibatch of the batch) and
timed as the median of --repeats calls after one warm-up, the pieces in alternating rounds; its FLOPs are XLA's
cost analysis with scans unrolled (as benchmarks/throughput.py counts them) of the same piece with --remat off and
--gate-chunk 0: the algorithm's FLOPs, not counting the forward passes that rematerialisation repeats, nor leaving
out the gradients that the gated gradient skips, so GFLOP/s is the rate of useful work of the plain gradient (the
minibatch's gate fraction is printed: the gated gradient's work depends on it). Pieces:
  update        update_minibatch: critic gradient step, then actor gradient step (what the epochs repeat)
  critic_grad   gradient of the critic loss
  actor_grad    gradient of the actor loss (chain or Gaussian sample, Q, trust-region KL, duals), as the update
                takes it (TruDi on CPU at the paper preset: gated_actor_grad)
  plain_grad    jax.grad of the actor loss (every state through both branches of its gate)
  sample_grad   gradient of the reparameterised sample alone (action and log-prob: the chain's N steps)
  kl_grad       gradient of the trust-region KL alone (TruDi forward: new kernels at the K old chains' states)
  q_grad        gradient of Q at the sampled action wrt the actor (the critic's forward and backward at a)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax as T  # noqa: E402
from benchmarks.throughput import alternating_medians, cost  # noqa: E402


def minibatch_inputs(cfg: T.Config, warm_steps: int = 0):
    """A learner, its params (as update_minibatch takes them) and the first minibatch of one real iteration; with
    warm_steps, the params after that many update steps on this minibatch (so that the new policy differs from the
    old one, and some states' gates close, as in all but an iteration's first step)."""
    env = T.make_env(cfg.env, cfg.backend)
    lr = T.make_learner(cfg, env)
    key = jax.random.PRNGKey(0)
    ts = jax.jit(lambda k: T.init_train_state(lr, k))(key)
    _, _, traj, _ = jax.jit(lambda ts, k: T.collect_rollout(lr, ts, k, False))(ts, key)
    batch = jax.jit(lambda ts, tr, k: T.compute_targets(lr.actor, lr.critic, cfg, ts.actor_params, ts.critic_params,
                                                        ts.norm, tr, k))(ts, traj, key)
    size = cfg.num_envs * cfg.rollout_steps // cfg.num_minibatches
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:size], batch)
    params = T.Params(ts.actor_params, ts.critic_params, ts.actor_opt_state, ts.critic_opt_state,
                      ts.actor_params["policy"], jnp.array(False))
    if warm_steps:
        steps = jax.jit(lambda p, mb, k: jax.lax.scan(lambda p, k: T.update_minibatch(lr, p, (mb, k)), p,
                                                      jax.random.split(k, warm_steps))[0])
        params = steps(params, flat, jax.random.fold_in(key, 1))
    return lr, params, flat, key


def pieces(lr: T.Learner, params: T.Params, mb, key) -> dict:
    cfg, actor, critic = lr.cfg, lr.actor, lr.critic
    policy = params.actor["policy"]
    actor_grad = T.gated_actor_grad if T.gate_chunk(cfg) else jax.grad(T.actor_loss, has_aux=True)  # as the update
    gate = {"gate_actor": lr.gate_actor} if T.gate_chunk(cfg) else {}  # its gates' pass too (bfloat16 where default)

    def sample_loss(p):
        action, log_prob, _ = actor.sample(p, mb.obs, key)
        return action.sum() + log_prob.sum()

    def kl_loss(p):
        trace = actor.sample(jax.lax.stop_gradient(p), mb.obs, key)[2]
        return actor.trust_region_kl(p, params.old_policy, mb.old, mb.obs, trace, jax.random.fold_in(key, 1)).sum()

    def q_loss(p):
        action = actor.sample(p, mb.obs, key)[0]
        return T.expected_q(critic.apply(params.critic, mb.obs, action)[0], cfg).sum()

    return {
        "update": (lambda p, mb, k: T.update_minibatch(lr, p, (mb, k)), (params, mb, key)),
        "critic_grad": (lambda c, mb: jax.grad(T.critic_loss, has_aux=True)(c, mb, critic, cfg), (params.critic, mb)),
        "actor_grad": (lambda a, mb, k: actor_grad(
            a, params.old_policy, params.critic, mb, k, actor, critic, cfg, lr.env.action_size, **gate),
            (params.actor, mb, key)),
        "plain_grad": (lambda a, mb, k: jax.grad(T.actor_loss, has_aux=True)(  # actor_grad without the gates' skips
            a, params.old_policy, params.critic, mb, k, actor, critic, cfg, lr.env.action_size),
            (params.actor, mb, key)),
        "sample_grad": (jax.grad(sample_loss), (policy,)),
        "kl_grad": (jax.grad(kl_loss), (policy,)),
        "q_grad": (jax.grad(q_loss), (policy,)),
    }


def profile(cfg: T.Config, repeats: int, names=None, warm_steps: int = 0, log=print) -> dict:
    lr, params, mb, key = minibatch_inputs(cfg, warm_steps)
    counted = pieces(T.make_learner(dataclasses.replace(cfg, remat="off", gate_chunk=0), lr.env), params, mb, key)
    table = {name: piece for name, piece in pieces(lr, params, mb, key).items() if names is None or name in names}
    medians, out = alternating_medians(table, repeats), {}
    for name, (fn, args) in table.items():
        flops = cost(counted[name][0], *args)["flops"]  # --remat off: the algorithm's FLOPs, its scans unrolled
        seconds = medians[name]
        out[name] = {"seconds": seconds, "flops": flops, "gflop_per_s": flops / seconds / 1e9}
        log(f"  {name:12s} {seconds * 1e3:9.1f} ms  {flops / 1e9:9.2f} GFLOP  {flops / seconds / 1e9:7.1f} GFLOP/s")
    gate_frac = jax.jit(lambda p, mb, k: T.actor_loss(p.actor, p.old_policy, p.critic, mb, k, lr.actor, lr.critic, cfg,
                                                      lr.env.action_size)[1]["gate_frac"])(params, mb, key)
    out["gate_frac"], out["gate_chunk"] = float(gate_frac), T.gate_chunk(cfg)
    log(f"  closed gates {out['gate_frac']:.2f} of the minibatch, gated gradient chunks of {out['gate_chunk']} states "
        "(0: plain gradient)")
    return out


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CartpoleBalance")
    parser.add_argument("--preset", default="paper", choices=["cpu", "paper"])
    parser.add_argument("--runners", nargs="+", default=["trudi", "reppo"], choices=["trudi", "reppo"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pieces", nargs="+", default=None, help="only these pieces (default: all)")
    parser.add_argument("--warm-steps", type=int, default=8,
                        help="update steps on the minibatch before timing (0: new policy = old, every gate open)")
    parser.add_argument("--json", default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    result = {"env": args.env, "preset": args.preset, "extra_flags": extra, "jax": jax.__version__,
              "device": f"{jax.devices()[0].platform} ({os.cpu_count()} cores, {platform.machine()})",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/profile_update.py", *argv])}
    for runner in args.runners:
        actor = "diffusion" if runner == "trudi" else "gaussian"
        cfg = T.parse_config(["--env", args.env, "--preset", args.preset, "--actor", actor, *extra])
        print(f"[profile] {runner}: {cfg.num_envs * cfg.rollout_steps // cfg.num_minibatches} samples per minibatch, "
              f"actor {cfg.actor_hidden}, critic {cfg.critic_hidden}, N {cfg.num_diffusion_steps}, "
              f"K {cfg.num_old_chains}, --kl-direction {cfg.kl_direction}", flush=True)
        result[runner] = profile(cfg, args.repeats, args.pieces, args.warm_steps,
                                 log=lambda line: print(line, flush=True))
    if "trudi" in result and "reppo" in result:
        t, r = result["trudi"]["update"], result["reppo"]["update"]
        result["update_time_ratio"] = t["seconds"] / r["seconds"]
        result["update_flop_ratio"] = t["flops"] / r["flops"]
        print(f"[profile] update: time ratio {result['update_time_ratio']:.2f}, FLOP ratio "
              f"{result['update_flop_ratio']:.2f} ({result['update_time_ratio'] / result['update_flop_ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
