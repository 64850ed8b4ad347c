"""Environment steps per second of ppo_jax.py and of Brax's own PPO trainer, same task, same settings.

    python benchmarks/throughput.py --quick                          # both default tasks, ~15 min on 2 CPU cores
    python benchmarks/throughput.py --envs CheetahRun --num-envs 2048 --repeats 5 --json throughput.json
    python benchmarks/throughput.py --quick --envs CartpoleBalance --runners trudi reppo --num-diffusion-steps 8
    python benchmarks/throughput.py --preset paper --envs HumanoidWalk --runners trudi reppo --iterations 1
    python benchmarks/throughput.py --preset paper --envs CartpoleBalance HumanoidWalk --runners trudi reppo ppo_jax \
        --flops-only                                                 # FLOPs per env step only, nothing run

`--preset paper` runs every trainer at its own file's paper preset for the task (TruDi/REPPO: 1024 envs x 32 steps,
16 minibatches, 8 epochs, 512-wide networks, N = 8, K = 4; ppo_jax and Brax's PPO: Playground's tuned settings),
so the steps/s compare the programs users run; the batch-shape flags then do not apply. `--preset cpu` does the
same with each file's cpu preset (what `benchmarks/reproduce.py --tasks cpu` runs): the cost of a task per 1M steps.
FLOPs per environment step (`<runner>_flops_per_step`, per piece in `<runner>_flops_per_step_pieces`) come from
XLA's cost analysis of each piece of one iteration compiled alone with its scans unrolled (the analysis counts a
loop body once): T * (policy step + environment step) + reset-pool refresh + targets + epochs * minibatches * update.

Every runner compiles once (compile time is reported on its own, never mixed into steps/s) and runs one
untimed warm-up block; then the runners are timed alternately, one block each per round
(ppo_jax, brax_ppo, ppo_jax, brax_ppo, ...) for --repeats rounds, and the table shows the median.
A block is --iterations PPO iterations of num_envs * rollout_steps environment steps each: one rollout,
then num_epochs x num_minibatches gradient steps. Evaluation is not timed on either side.
With --json the file is rewritten as the measurement goes: after each runner's warm-up and each round it holds
the task's row so far, marked "partial": true (first block, compile time, the rounds' steps/s), so a run stopped by
a time limit (a lent GPU's) keeps what it measured; benchmarks/readme_results.py leaves partial rows out.

How each trainer is timed:
* ppo_jax: `chunk` is AOT-compiled as in training (`jax.jit(over_seeds(chunk)).lower(ts).compile()`), with its
  evaluation outputs dropped so XLA removes the evaluation episodes from the program; a block is one call.
* brax_ppo: `brax.training.agents.ppo.train` compiles inside and runs one training epoch between two
  `progress_fn` calls (run_evals=False). It runs in a worker thread whose `progress_fn` waits for the
  next round, so the Brax program is compiled once and its epochs interleave with the other runners.
  Its compile time is estimated as the first epoch minus the median steady epoch (it includes Brax's
  setup: environment reset, network init). Brax's own `training/sps` timer is recorded as a check.

Not the same work per step: Brax's Playground wrapper resets a finished environment to its cached first
state, while the algorithm files keep a pool of fresh initial states and renew all of it once per
episode_length // rollout_steps iterations (at the first iteration of each chunk and every such period within
it); where a reset simulates (CheetahRun settles for 200 physics steps), that costs about 200 * rollout_steps /
episode_length extra physics steps per environment and iteration. A block should therefore span at least one
renewal period (the presets' --iterations: 31 = 1000 // 32), or the renewal is paid more often than in training.

TruDi and REPPO (`--runners trudi reppo`) use trudi_jax's cpu-preset networks with the bench's batch shape;
the table then also gives TruDi's time per environment step relative to REPPO's.

Add a trainer by adding an entry to RUNNERS: a function (bench, env name) -> Runner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import queue
import shlex
import statistics
import sys
import threading
import time
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_jax  # noqa: E402
import trudi_jax  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Settings: the shared knobs, mapped onto each trainer; presets are instances.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bench:
    envs: tuple[str, ...] = ("CartpoleBalance", "CheetahRun")  # Playground tasks to time
    num_envs: int = 2048  # parallel environments (Brax: num_envs, batch_size = num_envs / num_minibatches)
    rollout_steps: int = 32  # steps per environment per iteration (Brax: unroll_length)
    num_minibatches: int = 32  # minibatches per epoch
    num_epochs: int = 8  # passes over each batch (Brax: num_updates_per_batch)
    policy_hidden: tuple[int, ...] = ppo_jax.Config.policy_hidden  # policy MLP widths
    value_hidden: tuple[int, ...] = ppo_jax.Config.value_hidden  # value MLP widths
    iterations: int = 31  # PPO iterations per timed block (Brax: training steps per epoch); >= one pool renewal period
    repeats: int = 5  # timed rounds per runner; the median is reported
    quick: bool = False  # small preset: both default tasks in ~15 minutes on 2 CPU cores
    json: str | None = None  # also write the results to this file
    runners: tuple[str, ...] = ("ppo_jax", "brax_ppo")  # which of: ppo_jax brax_ppo trudi reppo ppo_jax_rollout
    # brax_rollout (the rollout alone, so update = whole - rollout) trudi_plain trudi_gated trudi_gated_f32 (TruDi with
    # --gate-chunk 0, 256, 256 --gate-bf16 False) trudi_k1 (TruDi with --num-old-chains 1)
    num_diffusion_steps: int = trudi_jax.Config.num_diffusion_steps  # TruDi's N
    num_old_chains: int | None = None  # TruDi's K (None: the preset's; the cpu preset's with the bench shape)
    kl_direction: Literal["forward", "reverse"] = "forward"  # TruDi's trust-region KL (trudi_jax --kl-direction)
    paper_networks: bool = False  # TruDi/REPPO/PPO networks (and TruDi's K) of each file's paper preset
    preset: Literal["bench", "paper", "cpu"] = "bench"  # paper/cpu: every runner at its file's preset for the task
    # (envs, rollout, minibatches, epochs, networks, K, N; Brax PPO at ppo_jax's), the batch flags above ignored
    flops: bool = True  # count FLOPs per env step with XLA's cost analysis (ppo_jax, trudi, reppo)
    flops_only: bool = False  # only count FLOPs per env step (no compile of the whole program, no timing)


QUICK = Bench(num_envs=128, rollout_steps=32, num_minibatches=8, num_epochs=8, iterations=31, repeats=3, quick=True)


def parse_bench(argv: list[str]) -> Bench:
    """tyro CLI on top of the full or --quick preset, so explicit flags override the preset."""
    default = QUICK if "--quick" in argv else Bench()
    bench = tyro.cli(Bench, default=default, args=argv)
    if bench.num_envs % bench.num_minibatches:
        raise SystemExit(f"error: --num-envs {bench.num_envs} must be divisible by --num-minibatches "
                         f"{bench.num_minibatches} (Brax's minibatches are whole rollouts of num_envs/num_minibatches envs)")
    if bench.repeats < 1 or bench.iterations < 1:
        raise SystemExit("error: --repeats and --iterations must be positive")
    return bench


def ppo_config(bench: Bench, env_name: str) -> ppo_jax.Config:
    """ppo_jax's config for one block of bench.iterations iterations; Brax reads the same fields."""
    if bench.preset != "bench":
        cfg = ppo_jax.preset_config(bench.preset, env_name)
        return block_config(ppo_jax, cfg, bench.iterations)
    base = ppo_jax.preset_config("paper", env_name) if bench.paper_networks else ppo_jax.Config()
    cfg = dataclasses.replace(base, env=env_name, num_envs=bench.num_envs, rollout_steps=bench.rollout_steps,
                         num_minibatches=bench.num_minibatches, num_epochs=bench.num_epochs,
                         policy_hidden=base.policy_hidden if bench.paper_networks else bench.policy_hidden,
                         value_hidden=base.value_hidden if bench.paper_networks else bench.value_hidden,
                         total_steps=bench.iterations * bench.num_envs * bench.rollout_steps,
                         num_evals=1, num_eval_envs=1, plot=False)
    ppo_jax.validate(cfg)
    return cfg


def block_config(module, cfg, iterations: int):
    """cfg trimmed to one block of `iterations` iterations as one chunk, with a minimal evaluation."""
    cfg = dataclasses.replace(cfg, total_steps=iterations * cfg.num_envs * cfg.rollout_steps, num_evals=1,
                              num_eval_envs=1, plot=False)
    module.validate(cfg)
    return cfg


class Runner(NamedTuple):
    compile_s: float | None  # measured compile time, or None: estimate it as first_block_s - median block
    first_block_s: float  # the untimed warm-up block (for Brax it also holds the compilation)
    run_block: Callable[[], float]  # runs one block, returns its wall-clock seconds
    close: Callable[[], dict]  # finishes the run; returns extra fields for the results
    steps_per_block: int  # environment steps of one block
    extra: dict = {}  # fields measured at setup (FLOP counts, memory), added to the results


# ---------------------------------------------------------------------------------------------
# ppo_jax: AOT-compiled chunk, evaluation dropped from the program.
# ---------------------------------------------------------------------------------------------
def ppo_jax_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(ppo_jax, ppo_config(bench, env_name), bench)


# ---------------------------------------------------------------------------------------------
# FLOPs per environment step: XLA's cost analysis of each piece of one iteration.
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def unrolled_scans():
    """Every jax.lax.scan (and jax.lax.map) traced meanwhile is unrolled: XLA's cost analysis counts a loop body
    once, whatever its trip count (checked: a 10-step scan of a matmul reports the FLOPs of one matmul)."""
    scan, map_ = jax.lax.scan, jax.lax.map
    jax.lax.scan = functools.partial(scan, unroll=True)
    jax.lax.map = lambda f, xs, **_: scan(lambda carry, x: (carry, f(x)), None, xs, unroll=True)[1]
    try:
        yield
    finally:
        jax.lax.scan, jax.lax.map = scan, map_


def cost(fn, *args, unroll: bool = True) -> dict:
    """FLOPs (and bytes) of fn compiled for these (abstract) arguments, with every scan unrolled (unless unroll is
    False: then a loop body counts once, a lower bound)."""
    with unrolled_scans() if unroll else contextlib.nullcontext():
        analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return {"flops": float(analysis.get("flops", 0.0)), "bytes": float(analysis.get("bytes accessed", 0.0))}


def alternating_medians(calls: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn(*args) in `calls` ({name: (fn, args)}), compiled and warmed up first, then timed in
    `repeats` alternating rounds, so that a change in the machine's load falls on every call alike."""
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, (fn, args) in calls.items()}
    for name, (_, args) in calls.items():
        jax.block_until_ready(compiled[name](*args))  # warm-up
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (_, args) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def flop_count(module, cfg) -> dict:
    """FLOPs per environment step of one iteration of an algorithm file, from its pieces:
        T * (policy step + environment step) + reset-pool refresh + targets + epochs * minibatches * update.
    The policy step, the targets and the update are exact (their scans unrolled); the physics has solver loops
    (while loops) that the cost analysis counts once, so the environment's share is a lower bound. TruDi is counted
    with --remat off: the algorithm's FLOPs, without the forward passes that rematerialisation repeats, and with
    --gate-chunk 0: the plain gradient's FLOPs (the gated gradient skips a share that depends on the gates)."""
    if module is trudi_jax:
        cfg = dataclasses.replace(cfg, remat="off", gate_chunk=0)
    env = module.make_env(cfg.env, cfg.backend)
    lr = module.make_learner(cfg, env)
    key = jax.random.PRNGKey(0)
    ts = jax.eval_shape(lambda k: module.init_train_state(lr, k), key)
    T, B, M = cfg.rollout_steps, cfg.num_envs, cfg.num_minibatches
    traj = jax.eval_shape(lambda ts, k: module.collect_rollout(lr, ts, k, False)[2], ts, key)
    obs = jax.ShapeDtypeStruct((B, env.obs_size), jnp.float32)
    action = jax.ShapeDtypeStruct((B, env.action_size), jnp.float32)
    if module is trudi_jax:
        policy_step = cost(lambda ts, o, k: lr.actor.sample(ts.actor_params["policy"], o, k), ts, obs, key)
        targets_fn = lambda ts, tr, k: module.compute_targets(lr.actor, lr.critic, cfg, ts.actor_params,
                                                              ts.critic_params, ts.norm, tr, k)
        batch = jax.eval_shape(targets_fn, ts, traj, key)
        targets = cost(targets_fn, ts, traj, key)
        minibatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((T * B // M,) + x.shape[2:], x.dtype), batch)
        params = jax.eval_shape(lambda ts: module.Params(ts.actor_params, ts.critic_params, ts.actor_opt_state,
                                                         ts.critic_opt_state, ts.actor_params["policy"],
                                                         jnp.array(False)), ts)
        update = cost(lambda p, mb, k: module.update_minibatch(lr, p, (mb, k)), params, minibatch, key)
    else:
        policy_step = cost(lambda ts, o, k: lr.policy.apply(ts.params["policy"], o), ts, obs, key)
        targets_fn = lambda ts, tr: module.compute_targets(lr, ts.params, ts.norm, tr)
        batch = jax.eval_shape(targets_fn, ts, traj)
        targets = cost(targets_fn, ts, traj)
        minibatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((T * B // M,) + x.shape[2:], x.dtype), batch)
        update = cost(lambda ts, mb: module.update_minibatch(lr, (ts.params, ts.opt_state), mb), ts, minibatch)
    env_step = cost(lambda ts, a: module.env_step(env, ts.env_state, a, ts.reset_pool, cfg.episode_length), ts,
                    action)
    # the whole pool is renewed once per renewal period: its resets, spread over the iterations of a period. Not
    # unrolled: a reset that settles (CheetahRun: 200 physics steps) unrolled for all B envs exhausted 24 GiB of
    # memory in XLA's compiler; so, like the physics, a lower bound
    renewal = cost(lambda k: module.env_reset(env, jax.random.split(k, B)), key, unroll=False)
    period = module.pool_renewal_period(cfg.episode_length, T)
    pieces = {"policy_step": T * policy_step["flops"], "env_step": T * env_step["flops"],
              "reset_refresh": renewal["flops"] / period, "targets": targets["flops"],
              "update": cfg.num_epochs * M * update["flops"]}
    steps = T * B
    return {"flops_per_step": sum(pieces.values()) / steps,
            "flops_per_step_pieces": {k: v / steps for k, v in pieces.items()},
            "update_minibatch_flops": update["flops"], "policy_step_flops": policy_step["flops"]}


def trudi_config(bench: Bench, env_name: str, actor: str) -> trudi_jax.Config:
    """trudi_jax's cpu-preset (or paper-preset) networks with the bench's batch shape; 'gaussian' is REPPO.
    With --preset paper or cpu: that preset as it is."""
    if bench.preset != "bench":
        cfg = trudi_jax.preset_config(bench.preset, env_name)
        cfg = dataclasses.replace(cfg, actor=actor, kl_direction=bench.kl_direction,
                                  num_old_chains=bench.num_old_chains or cfg.num_old_chains)
        return block_config(trudi_jax, cfg, bench.iterations)
    base = trudi_jax.preset_config("paper", env_name) if bench.paper_networks else trudi_jax.Config()
    cfg = dataclasses.replace(base, env=env_name, actor=actor, num_envs=bench.num_envs,
                           rollout_steps=bench.rollout_steps, num_minibatches=bench.num_minibatches,
                           num_epochs=bench.num_epochs, num_diffusion_steps=bench.num_diffusion_steps,
                           num_old_chains=bench.num_old_chains or base.num_old_chains,
                           kl_direction=bench.kl_direction,
                           total_steps=bench.iterations * bench.num_envs * bench.rollout_steps,
                           num_evals=1, num_eval_envs=1, plot=False)
    trudi_jax.validate(cfg)
    return cfg


def trudi_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(trudi_jax, trudi_config(bench, env_name, "diffusion"), bench)


def reppo_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(trudi_jax, trudi_config(bench, env_name, "gaussian"), bench)


def trudi_plain_runner(bench: Bench, env_name: str) -> Runner:
    """TruDi with the plain gradient of its actor loss (--gate-chunk 0), to time against the gated one."""
    return jitted_runner(trudi_jax, dataclasses.replace(trudi_config(bench, env_name, "diffusion"), gate_chunk=0),
                         bench)


def trudi_gated_runner(bench: Bench, env_name: str) -> Runner:
    """TruDi with the gated actor gradient whatever the machine (--gate-chunk 256; by default only on CPU), its
    gates from bfloat16 products where that is the default (CPU)."""
    return jitted_runner(trudi_jax, dataclasses.replace(trudi_config(bench, env_name, "diffusion"),
                                                        gate_chunk=trudi_jax.GATE_CHUNK), bench)


def trudi_gated_f32_runner(bench: Bench, env_name: str) -> Runner:
    """TruDi with the gated actor gradient and its gates from float32 products (--gate-chunk 256 --gate-bf16 False)."""
    return jitted_runner(trudi_jax, dataclasses.replace(trudi_config(bench, env_name, "diffusion"),
                                                        gate_chunk=trudi_jax.GATE_CHUNK, gate_bf16=False), bench)


def trudi_k1_runner(bench: Bench, env_name: str) -> Runner:
    """TruDi with one old chain per state, the rollout's own (--num-old-chains 1, the cpu preset's K): the trust
    region's cheapest sampled form, to time beside the preset's K."""
    return jitted_runner(trudi_jax, dataclasses.replace(trudi_config(bench, env_name, "diffusion"), num_old_chains=1),
                         bench)


def jitted_runner(module, cfg, bench: Bench) -> Runner:
    """An algorithm file's AOT-compiled training chunk (ppo_jax or trudi_jax), evaluation removed."""
    env = module.make_env(cfg.env)
    start = time.perf_counter()
    init, chunk, iters_per_chunk = module.make_train(cfg, env)
    assert iters_per_chunk == bench.iterations, (iters_per_chunk, bench.iterations)
    ts = jax.block_until_ready(jax.jit(module.over_seeds(init))(jax.random.PRNGKey(0)[None]))

    def train_chunk(ts):
        ts, metrics = chunk(ts)
        return ts, {k: v for k, v in metrics.items() if not k.startswith("eval_")}  # unused -> removed

    compiled = jax.jit(module.over_seeds(train_chunk), donate_argnums=0).lower(ts).compile()
    compile_s = time.perf_counter() - start
    state = {"ts": ts}
    extra = flop_count(module, cfg) if bench.flops else {}
    memory = compiled.memory_analysis()
    if memory is not None:
        extra["peak_memory_bytes"] = int(getattr(memory, "peak_memory_in_bytes", 0) or (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes))
    extra["config"] = {k: getattr(cfg, k) for k in ("num_envs", "rollout_steps", "num_minibatches", "num_epochs")}

    gates = []  # TruDi: the fraction of closed gates per block (the warm-up first): the gated gradient's work

    def run_block() -> float:
        start = time.perf_counter()
        state["ts"], metrics = jax.block_until_ready(compiled(state["ts"]))
        if "gate_frac" in metrics:
            gates.append(float(np.mean(metrics["gate_frac"])))
        return time.perf_counter() - start

    return Runner(compile_s, run_block(), run_block, lambda: {"gate_frac_blocks": gates} if gates else {},
                  cfg.num_envs * cfg.rollout_steps * bench.iterations, extra)


# ---------------------------------------------------------------------------------------------
# Brax PPO: brax.training.agents.ppo.train in a worker thread, one epoch per round.
# ---------------------------------------------------------------------------------------------
def install_brax_shims() -> None:
    """Brax 0.14 calls jax.device_put_replicated, which JAX 0.10 removed; put back an equivalent."""
    if hasattr(jax, "device_put_replicated"):
        return

    def device_put_replicated(x, devices):
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("i",)),
                                              jax.sharding.PartitionSpec("i"))
        return jax.tree.map(lambda a: jax.device_put(jnp.stack([jnp.asarray(a)] * len(devices)), sharding), x)

    jax.device_put_replicated = device_put_replicated


def brax_ppo_runner(bench: Bench, env_name: str) -> Runner:
    from brax.training.agents.ppo import networks as ppo_networks
    from brax.training.agents.ppo import train as brax_ppo
    from mujoco_playground import registry, wrapper

    install_brax_shims()
    cfg = ppo_config(bench, env_name)
    env = registry.load(env_name, config_overrides={"impl": "jax"})
    steps_per_block = bench.iterations * cfg.num_envs * cfg.rollout_steps
    num_blocks = 1 + bench.repeats  # warm-up epoch + timed epochs
    reports, resume = queue.Queue(), queue.Queue()
    own_sps, steps_seen = [], []

    def progress_fn(step, metrics):
        steps_seen.append(int(step))
        own_sps.append(float(metrics["training/sps"]))
        reports.put(None)
        resume.get()

    def train():
        try:
            brax_ppo.train(
                environment=env, wrap_env_fn=wrapper.wrap_for_brax_training, episode_length=cfg.episode_length,
                action_repeat=1, num_timesteps=num_blocks * steps_per_block, num_envs=cfg.num_envs,
                unroll_length=cfg.rollout_steps, batch_size=cfg.num_envs // cfg.num_minibatches,
                num_minibatches=cfg.num_minibatches, num_updates_per_batch=cfg.num_epochs,
                normalize_observations=cfg.normalize_obs, learning_rate=cfg.learning_rate,
                entropy_cost=cfg.entropy_coef, discounting=cfg.gamma, gae_lambda=cfg.gae_lambda,
                reward_scaling=cfg.reward_scale, clipping_epsilon=cfg.clip_eps,
                max_grad_norm=cfg.max_grad_norm or None, normalize_advantage=cfg.normalize_advantage,
                vf_loss_coefficient=cfg.value_coef,
                network_factory=functools.partial(ppo_networks.make_ppo_networks,
                                                  policy_hidden_layer_sizes=cfg.policy_hidden,
                                                  value_hidden_layer_sizes=cfg.value_hidden),
                num_evals=1 + num_blocks, run_evals=False, num_eval_envs=1, progress_fn=progress_fn, seed=0)
            reports.put(None)
        except BaseException as error:  # hand it to the main thread
            reports.put(error)

    def wait():
        error = reports.get()
        if error is not None:
            raise RuntimeError(f"Brax PPO failed on {env_name}") from error

    def run_block() -> float:
        start = time.perf_counter()
        resume.put(None)
        wait()
        return time.perf_counter() - start

    def close() -> dict:
        resume.put(None)
        wait()
        thread.join()
        expected = [steps_per_block * (i + 1) for i in range(num_blocks)]
        assert steps_seen == expected, f"Brax counted steps {steps_seen}, expected {expected}"
        return {"own_sps": statistics.median(own_sps[1:])}  # Brax's training/sps, warm-up epoch excluded

    thread = threading.Thread(target=train, daemon=True)
    start = time.perf_counter()
    thread.start()
    wait()
    return Runner(None, time.perf_counter() - start, run_block, close, steps_per_block)


# ---------------------------------------------------------------------------------------------
# Rollouts alone (no update): where a trainer's time goes, measured in the same alternating rounds.
# ---------------------------------------------------------------------------------------------
def ppo_jax_rollout_runner(bench: Bench, env_name: str) -> Runner:
    """ppo_jax's collect_rollout (policy sampling, physics, reset-pool refresh) for a block's iterations."""
    cfg = ppo_config(bench, env_name)
    env = ppo_jax.make_env(cfg.env)
    lr = ppo_jax.make_learner(cfg, env)
    start = time.perf_counter()
    ts = jax.block_until_ready(jax.jit(lambda k: ppo_jax.init_train_state(lr, k))(jax.random.PRNGKey(0)))

    def block(ts):
        def iteration(ts, _):
            key, k_roll = jax.random.split(ts.key)
            renew = ts.iteration % ppo_jax.pool_renewal_period(cfg.episode_length, cfg.rollout_steps) == 0
            env_state, reset_pool, traj, _ = ppo_jax.collect_rollout(lr, ts, k_roll, renew)
            return ts._replace(env_state=env_state, reset_pool=reset_pool, key=key, iteration=ts.iteration + 1), \
                traj.reward.sum()
        return jax.lax.scan(iteration, ts, None, length=bench.iterations)

    compiled = jax.jit(block, donate_argnums=0).lower(ts).compile()
    return timed_block_runner(compiled, ts, time.perf_counter() - start,
                              bench.iterations * cfg.num_envs * cfg.rollout_steps)


def brax_rollout_runner(bench: Bench, env_name: str) -> Runner:
    """Brax PPO's rollout as its training step runs it (acting.generate_unroll on Playground's Brax wrapper,
    the same extra fields, a freshly initialised PPO policy network of the same widths) for a block's iterations."""
    from brax.training import acting
    from brax.training.acme import running_statistics, specs
    from brax.training.agents.ppo import networks as ppo_networks
    from mujoco_playground import registry, wrapper

    cfg = ppo_config(bench, env_name)
    env = wrapper.wrap_for_brax_training(registry.load(env_name, config_overrides={"impl": "jax"}),
                                         episode_length=cfg.episode_length, action_repeat=1)
    start = time.perf_counter()
    obs_size = env.observation_size
    nets = ppo_networks.make_ppo_networks(obs_size, env.action_size,
                                          preprocess_observations_fn=running_statistics.normalize,
                                          policy_hidden_layer_sizes=cfg.policy_hidden,
                                          value_hidden_layer_sizes=cfg.value_hidden)
    make_policy = ppo_networks.make_inference_fn(nets)
    key_pi, key_v, key_env, key = jax.random.split(jax.random.PRNGKey(0), 4)
    normalizer = running_statistics.init_state(specs.Array((obs_size,), jnp.dtype("float32")))
    params = (normalizer, nets.policy_network.init(key_pi), nets.value_network.init(key_v))
    state = jax.block_until_ready(jax.jit(env.reset)(jax.random.split(key_env, cfg.num_envs)))

    def block(carry):
        state, key = carry
        policy = make_policy(params)

        def iteration(carry, _):
            state, key = carry
            key, k = jax.random.split(key)
            state, data = acting.generate_unroll(env, state, policy, k, cfg.rollout_steps,
                                                 extra_fields=("truncation", "episode_metrics", "episode_done"))
            return (state, key), data.reward.sum()
        return jax.lax.scan(iteration, (state, key), None, length=bench.iterations)

    compiled = jax.jit(block, donate_argnums=0).lower((state, key)).compile()
    return timed_block_runner(compiled, (state, key), time.perf_counter() - start,
                              bench.iterations * cfg.num_envs * cfg.rollout_steps)


def timed_block_runner(compiled, carry, compile_s: float, steps_per_block: int) -> Runner:
    state = {"carry": carry}

    def run_block() -> float:
        start = time.perf_counter()
        state["carry"], _ = jax.block_until_ready(compiled(state["carry"]))
        return time.perf_counter() - start

    return Runner(compile_s, run_block(), run_block, lambda: {}, steps_per_block)


RUNNERS: dict[str, Callable[[Bench, str], Runner]] = {"ppo_jax": ppo_jax_runner, "brax_ppo": brax_ppo_runner,
                                                      "trudi": trudi_runner, "reppo": reppo_runner,
                                                      "trudi_plain": trudi_plain_runner,
                                                      "trudi_gated": trudi_gated_runner,
                                                      "trudi_gated_f32": trudi_gated_f32_runner,
                                                      "trudi_k1": trudi_k1_runner,
                                                      "ppo_jax_rollout": ppo_jax_rollout_runner,
                                                      "brax_rollout": brax_rollout_runner}
BASELINE = "brax_ppo"  # the ratio column is <runner>_sps / BASELINE_sps


# ---------------------------------------------------------------------------------------------
# Measurement: compile all, alternate blocks, report medians.
# ---------------------------------------------------------------------------------------------
def measure(bench: Bench, env_name: str, log: Callable[[str], None] = print,
            save: Callable[[dict], None] = lambda partial: None) -> dict:
    """One result row for a task: median steps/s and compile seconds of every runner. After each runner is ready
    and after each round, save(partial row) gets what is measured so far (a run cut short by a time limit, as on
    a lent GPU, keeps it)."""
    runners, partial = {}, {"env": env_name}
    for name in bench.runners:
        runners[name] = RUNNERS[name](bench, env_name)
        log(f"[{env_name}] {name}: ready (first block {runners[name].first_block_s:.1f} s)")
        partial |= {f"{name}_first_block_s": runners[name].first_block_s, f"{name}_compile_s": runners[name].compile_s,
                    f"{name}_steps_per_block": runners[name].steps_per_block, f"{name}_sps_rounds": []}
        partial |= {f"{name}_{key}": value for key, value in runners[name].extra.items()}
        save(partial)
    seconds = {name: [] for name in runners}
    for round_ in range(bench.repeats):
        for name, runner in runners.items():
            seconds[name].append(runner.run_block())
        log(f"[{env_name}] round {round_ + 1}/{bench.repeats}: " + ", ".join(
            f"{name} {runners[name].steps_per_block / s[-1]:,.0f} steps/s" for name, s in seconds.items()))
        save(partial | {f"{name}_sps_rounds": [runners[name].steps_per_block / t for t in s]
                        for name, s in seconds.items()})
    row = {"env": env_name}
    for name, runner in runners.items():
        block_s = statistics.median(seconds[name])
        compile_s = runner.compile_s if runner.compile_s is not None else runner.first_block_s - block_s
        row[f"{name}_sps"] = runner.steps_per_block / block_s
        row[f"{name}_compile_s"] = compile_s
        row[f"{name}_sps_rounds"] = [runner.steps_per_block / s for s in seconds[name]]
        row.update({f"{name}_{key}": value for key, value in runner.extra.items()})
        row.update({f"{name}_{key}": value for key, value in runner.close().items()})
    for variant in ("trudi_plain", "trudi_gated", "trudi_gated_f32", "trudi_k1"):
        if variant in runners and "reppo" in runners:
            row[f"{variant}_time_per_step_vs_reppo"] = row["reppo_sps"] / row[f"{variant}_sps"]
    if "trudi" in runners and "reppo" in runners:
        row["trudi_time_per_step_vs_reppo"] = row["reppo_sps"] / row["trudi_sps"]
        if "trudi_flops_per_step" in row and "reppo_flops_per_step" in row:
            row["trudi_flops_per_step_vs_reppo"] = row["trudi_flops_per_step"] / row["reppo_flops_per_step"]
    for name in runners:
        if name not in (BASELINE, "ppo_jax_rollout", "brax_rollout") and BASELINE in runners:
            row["ratio" if name == "ppo_jax" else f"ratio_{name}"] = row[f"{name}_sps"] / row[f"{BASELINE}_sps"]
    if "ppo_jax_rollout" in runners and "brax_rollout" in runners:
        row["rollout_ratio"] = row["ppo_jax_rollout_sps"] / row["brax_rollout_sps"]
    for whole, rollout in (("ppo_jax", "ppo_jax_rollout"), ("brax_ppo", "brax_rollout")):
        if whole in runners and rollout in runners:  # microseconds per env step: rollout, and the rest (update)
            row[f"{whole}_rollout_us_per_step"] = 1e6 / row[f"{rollout}_sps"]
            row[f"{whole}_update_us_per_step"] = 1e6 / row[f"{whole}_sps"] - 1e6 / row[f"{rollout}_sps"]
    return row


def markdown_table(rows: list[dict]) -> str:
    names = [name for name in RUNNERS if f"{name}_sps" in rows[0]]
    ratios = {key: f"{key} (vs {BASELINE})" for key in rows[0] if key == "ratio" or key.startswith("ratio_")}
    if "trudi_sps" in rows[0] and "reppo_sps" in rows[0]:
        ratios["trudi_time_per_step_vs_reppo"] = "TruDi time per step / REPPO's"
    for variant, label in (("trudi_plain", "plain gradient"), ("trudi_gated", "gated gradient"),
                           ("trudi_gated_f32", "gated gradient, float32 gates"), ("trudi_k1", "K = 1")):
        if f"{variant}_time_per_step_vs_reppo" in rows[0]:
            ratios[f"{variant}_time_per_step_vs_reppo"] = f"TruDi ({label}) time per step / REPPO's"
    if "rollout_ratio" in rows[0]:
        ratios["rollout_ratio"] = "rollout alone: ppo_jax_rollout / brax_rollout"
    if "trudi_flops_per_step_vs_reppo" in rows[0]:
        ratios["trudi_flops_per_step_vs_reppo"] = "TruDi FLOPs per step / REPPO's"
    header = (["env"] + [f"{n} steps/s" for n in names] + list(ratios.values())
              + [f"{n} compile s" for n in names])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ([row["env"]] + [f"{row[f'{n}_sps']:,.0f}" for n in names] + [f"{row[r]:.2f}" for r in ratios]
                 + [f"{row[f'{n}_compile_s']:.1f}" for n in names])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_table(rows: list[dict]) -> str:
    """Microseconds per env step in the rollout and in the rest of an iteration (the update), where measured."""
    names = [n for n in ("ppo_jax", "brax_ppo") if f"{n}_rollout_us_per_step" in rows[0]]
    if not names:
        return ""
    header = ["env"] + [f"{n} {part} us/step" for n in names for part in ("rollout", "update")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join([row["env"]] + [f"{row[f'{n}_{part}_us_per_step']:.1f}" for n in names
                                                       for part in ("rollout", "update")]) + " |")
    return "\n".join(lines)


CONFIGS = {"ppo_jax": lambda bench, env: (ppo_jax, ppo_config(bench, env)),
           "trudi": lambda bench, env: (trudi_jax, trudi_config(bench, env, "diffusion")),
           "reppo": lambda bench, env: (trudi_jax, trudi_config(bench, env, "gaussian"))}


def count_only(bench: Bench, env_name: str, log: Callable[[str], None] = print) -> dict:
    """--flops-only: FLOPs per environment step of each runner's iteration, nothing run."""
    row = {"env": env_name}
    for name in bench.runners:
        module, cfg = CONFIGS[name](bench, env_name)
        row.update({f"{name}_{k}": v for k, v in flop_count(module, cfg).items()})
        log(f"[{env_name}] {name}: {row[f'{name}_flops_per_step']:,.0f} FLOPs per env step")
    if "trudi" in bench.runners and "reppo" in bench.runners:
        row["trudi_flops_per_step_vs_reppo"] = row["trudi_flops_per_step"] / row["reppo_flops_per_step"]
    return row


def main(argv: list[str]) -> list[dict]:
    bench = parse_bench(argv)
    import brax
    context = {"preset": bench.preset, "iterations_per_block": bench.iterations, "repeats": bench.repeats,
               "jax": jax.__version__, "brax": brax.__version__,
               "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} ({os.cpu_count()} CPU cores)",
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": shlex.join(["python", "benchmarks/throughput.py", *argv])}
    if bench.preset == "bench":  # the shared batch shape (with --preset paper each runner's own: <runner>_config)
        context |= {"num_envs": bench.num_envs, "rollout_steps": bench.rollout_steps,
                    "num_minibatches": bench.num_minibatches, "num_epochs": bench.num_epochs,
                    "policy_hidden": list(bench.policy_hidden), "value_hidden": list(bench.value_hidden),
                    "paper_networks": bench.paper_networks,
                    "steps_per_block": bench.iterations * bench.num_envs * bench.rollout_steps}
    rows = []

    def write(rows):
        if bench.json:
            with open(bench.json + ".tmp", "w") as f:
                json.dump(rows, f, indent=2)
            os.replace(bench.json + ".tmp", bench.json)

    for name in bench.envs:  # the JSON holds the finished rows and, marked "partial", what the current one has so far
        if bench.flops_only:
            rows.append(count_only(bench, name) | context)
        else:
            rows.append(measure(bench, name, save=lambda partial: write(rows + [partial | context | {"partial": True}]))
                        | context)
        write(rows)
    if not bench.flops_only:
        print(markdown_table(rows))
        print(split_table(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
