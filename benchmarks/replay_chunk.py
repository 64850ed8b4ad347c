"""Replay the chunk after a checkpoint with one metrics row per training iteration (what a log point averages).

    python trudi_jax.py --env CartpoleBalance --preset cpu --actor gaussian --seed 300 --total-steps 2400000 \
        --num-evals 20 --checkpoint-every 1 --keep-checkpoints 20 --out-dir runs/long300
    python benchmarks/replay_chunk.py runs/long300/checkpoint_000000966656.msgpack replay.csv
    python benchmarks/replay_chunk.py runs/long300/checkpoint_000000966656.msgpack replay.csv --set-beta 1e-3

The checkpoint holds the train state with its random key, so the replay runs the same iterations as the run did
(on the same machine: another CPU's floating-point details give another course). `--set-beta` is an
intervention: beta set to that value at the start of the chunk, everything else as saved.
"""
import argparse
import csv
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trudi_jax as T  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint file written by trudi_jax.py --checkpoint-every")
    parser.add_argument("out", help="CSV: one row per seed and iteration of the next chunk")
    parser.add_argument("--set-beta", type=float, default=None, help="set beta to this value first (intervention)")
    args = parser.parse_args(argv)
    meta, payload = T.read_checkpoint(args.checkpoint)
    cfg = T.config_from_dict(meta["config"])
    env = T.make_env(cfg.env, cfg.backend, cfg.privileged_critic, cfg.domain_randomization)
    lr = T.make_learner(cfg, env)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(cfg.seed), i))(jnp.arange(cfg.num_seeds))
    abstract = jax.eval_shape(T.over_seeds(functools.partial(T.init_train_state, lr)), keys)
    ts = T.restore_state(args.checkpoint, meta, payload, abstract)
    if args.set_beta is not None:
        actor = dict(ts.actor_params)
        actor["log_beta"] = jnp.full_like(actor["log_beta"], math.log(args.set_beta))
        ts = ts._replace(actor_params=actor)

    def chunk(ts):
        ts, metrics = jax.lax.scan(functools.partial(T.train_iteration, lr), ts, jnp.arange(T.chunk_iterations(cfg)))
        metrics.pop("nonfinite")
        return metrics

    metrics = jax.device_get(jax.jit(T.over_seeds(chunk))(ts))
    names = sorted(metrics)
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "iteration", "env_steps"] + names)
        for s in range(cfg.num_seeds):
            for i in range(T.chunk_iterations(cfg)):
                steps = meta["env_steps"] + (i + 1) * cfg.num_envs * cfg.rollout_steps
                writer.writerow([cfg.seed if cfg.num_seeds == 1 else s, i, steps]
                                + [f"{float(np.asarray(metrics[k])[s, i]):.6g}" for k in names])
    print(f"wrote {args.out}: {cfg.num_seeds} seed(s) x {T.chunk_iterations(cfg)} iterations after "
          f"{meta['env_steps']:,} env steps")


if __name__ == "__main__":
    main()
