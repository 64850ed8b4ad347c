"""bf16 matrix products on this machine: forward and gradient of a 3 x 512 LayerNorm-swish MLP (the shape of TruDi's
control net at the paper preset) in float32 and with bfloat16 products (inputs and weights cast, float32
accumulation: preferred_element_type), timed in alternating rounds (median of 7), with the gradient's relative
error per layer.

    python benchmarks/bf16_matmul.py --rows 2048 --json benchmarks/results/cpu/bf16_matmul.json
"""
import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.throughput import alternating_medians  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", type=int, default=2048)
parser.add_argument("--json", default=None)
args = parser.parse_args()
rows, width, d_in = args.rows, 512, 64
key = jax.random.PRNGKey(0)
ks = jax.random.split(key, 5)
W = [jax.random.normal(ks[0], (d_in, width)) / 8, jax.random.normal(ks[1], (width, width)) / 22,
     jax.random.normal(ks[2], (width, width)) / 22, jax.random.normal(ks[3], (width, 8)) / 22]
x = jax.random.normal(ks[4], (rows, d_in))

def mlp(W, x, dtype):
    h = x
    for i, w in enumerate(W):
        h = jnp.dot(h.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
        if i < len(W) - 1:
            h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-6)
            h = jax.nn.swish(h)
    return h

def grad(dtype):
    return jax.jit(jax.grad(lambda W, x: (mlp(W, x, dtype) ** 2).sum()))

def fwd(dtype):
    return jax.jit(lambda W, x: mlp(W, x, dtype))

table = {"grad_f32": (grad(jnp.float32), (W, x)), "grad_bf16": (grad(jnp.bfloat16), (W, x)),
         "fwd_f32": (fwd(jnp.float32), (W, x)), "fwd_bf16": (fwd(jnp.bfloat16), (W, x))}
med = alternating_medians(table, 7)
flops_fwd = 2 * rows * sum(w.shape[0] * w.shape[1] for w in W)
out = {}
for n, s in med.items():
    f = flops_fwd * (3 if n.startswith("grad") else 1)
    out[n] = {"ms": s * 1e3, "gflop_per_s": f / s / 1e9}
    print(f"{n:10s} {s*1e3:8.2f} ms {f/s/1e9:7.1f} GFLOP/s")
g32 = grad(jnp.float32)(W, x); g16 = grad(jnp.bfloat16)(W, x)
rel = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) for a, b in zip(g32, g16)]
print("relative gradient error bf16 vs f32 per layer:", [f"{r:.4f}" for r in rel])
out.update(rows=rows, width=width, grad_rel_err=rel, jax=jax.__version__, device=f"{jax.devices()[0]} ({os.cpu_count()} cores)",
           date=datetime.datetime.now().isoformat(timespec="seconds"), command=" ".join(["python"] + sys.argv))
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
