"""bfloat16 products in the gates' pass of TruDi's gated actor gradient (issue 20, item 3d): c(s), the forward KL over
the K old chains that decides each state's gate, computed without gradient for a whole minibatch in
`gated_actor_grad`, is the largest forward-only pass of the update (K * N = 32 kernel calls of the control net per
state at the paper preset). This times that pass in float32 and with the control net's matrix products in bfloat16
(trudi_jax.bf16_products: float32 accumulation, LayerNorm and activations in float32), and measures the error of c
and the gates it flips.

The paper preset's actor (3 x 512, N = 8, K = 4) on random observations; old and new parameters are the initial ones
perturbed (relative size --scales), so that c spans the trust-region bound eps. trudi_jax.py uses it by default on
CPU wherever the gated gradient runs (--gate-bf16).

    python benchmarks/bf16_gate.py --rows 2048 --json benchmarks/results/cpu/bf16_gate.json
"""
import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax as T  # noqa: E402
from benchmarks.throughput import alternating_medians  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", type=int, default=2048, help="states (the paper preset's minibatch: 2048)")
parser.add_argument("--obs-size", type=int, default=67, help="observations (HumanoidWalk's 67)")
parser.add_argument("--action-size", type=int, default=21, help="actions (HumanoidWalk's 21)")
parser.add_argument("--scales", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.07, 0.1])
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--json", default=None)
args = parser.parse_args()
cfg = T.parse_config(["--env", "CartpoleBalance", "--preset", "paper"])
actor = T.make_diffusion_actor(cfg, args.obs_size, args.action_size)
actor16 = T.make_diffusion_actor(cfg, args.obs_size, args.action_size, bf16=True)  # --gate-bf16's
k_init, k_old_params, k_new_params, k_obs, k_roll, k_old = jax.random.split(jax.random.PRNGKey(0), 6)


def perturb(params, key, scale):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [x + scale * (jnp.std(x) + 0.05) * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])


obs = jax.random.normal(k_obs, (args.rows, args.obs_size))
old_params = perturb(actor.init(k_init), k_old_params, 1.0)  # the control net's output layer starts at zero
old = actor.old_policy(old_params, obs, k_old, actor.sample(old_params, obs, k_roll)[2])


def c_f32(params):
    return actor.trust_region_kl(params, old_params, old, obs, None)


def c_bf16(params):
    return actor16.trust_region_kl(params, old_params, old, obs, None)


f32, bf16 = jax.jit(c_f32), jax.jit(c_bf16)
eps = cfg.kl_bound
errors = []
for scale in args.scales:
    params = perturb(old_params, k_new_params, scale)
    a, b = f32(params), bf16(params)
    abs_err = jnp.abs(b - a)
    row = {"scale": scale, "c_median": float(jnp.median(a)), "closed_frac": float(jnp.mean(a >= eps)),
           "abs_err_median": float(jnp.median(abs_err)), "abs_err_max": float(abs_err.max()),
           "rel_err_median": float(jnp.median(abs_err / a)), "mean_c_err": float(jnp.abs(b.mean() - a.mean())),
           "gate_flips": int(jnp.sum((a < eps) != (b < eps))), "states": args.rows}
    errors.append(row)
    print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
times = alternating_medians({"f32": (c_f32, (old_params,)), "bf16": (c_bf16, (old_params,))}, args.repeats)
print(f"c(s) of {args.rows} states: float32 {times['f32'] * 1e3:.1f} ms, bfloat16 products {times['bf16'] * 1e3:.1f} ms "
      f"({times['f32'] / times['bf16']:.2f}x)")
out = {"rows": args.rows, "obs_size": args.obs_size, "action_size": args.action_size, "eps": eps,
       "actor_hidden": list(cfg.actor_hidden), "N": cfg.num_diffusion_steps, "K": cfg.num_old_chains,
       "remat": cfg.remat, "errors": errors, "ms_f32": times["f32"] * 1e3, "ms_bf16": times["bf16"] * 1e3,
       "speedup": times["f32"] / times["bf16"], "jax": jax.__version__,
       "device": f"{jax.devices()[0]} ({os.cpu_count()} cores)",
       "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(["python"] + sys.argv)}
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
