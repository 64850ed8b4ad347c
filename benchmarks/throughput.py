"""Environment steps per second of ppo_jax.py and of Brax's own PPO trainer, same task, same settings.

    python benchmarks/throughput.py --quick                          # both default tasks, ~15 min on 2 CPU cores
    python benchmarks/throughput.py --envs CheetahRun --num-envs 2048 --repeats 5 --json throughput.json
    python benchmarks/throughput.py --quick --envs CartpoleBalance --runners trudi reppo --num-diffusion-steps 8

Every runner compiles once (compile time is reported on its own, never mixed into steps/s) and runs one
untimed warm-up block; then the runners are timed alternately, one block each per round
(ppo_jax, brax_ppo, ppo_jax, brax_ppo, ...) for --repeats rounds, and the table shows the median.
A block is --iterations PPO iterations of num_envs * rollout_steps environment steps each: one rollout,
then num_epochs x num_minibatches gradient steps. Evaluation is not timed on either side.

How each trainer is timed:
* ppo_jax: `chunk` is AOT-compiled as in training (`jax.jit(over_seeds(chunk)).lower(ts).compile()`), with its
  evaluation outputs dropped so XLA removes the evaluation episodes from the program; a block is one call.
* brax_ppo: `brax.training.agents.ppo.train` compiles inside and runs one training epoch between two
  `progress_fn` calls (run_evals=False). It runs in a worker thread whose `progress_fn` waits for the
  next round, so the Brax program is compiled once and its epochs interleave with the other runners.
  Its compile time is estimated as the first epoch minus the median steady epoch (it includes Brax's
  setup: environment reset, network init). Brax's own `training/sps` timer is recorded as a check.

Not the same work per step: Brax's Playground wrapper resets a finished environment to its cached first
state, while the algorithm files keep a pool of fresh initial states and re-sample 1/(episode_length /
rollout_steps) of it per iteration; where a reset simulates (CheetahRun settles for 200 physics steps), that
costs about 200 * rollout_steps / episode_length extra physics steps per environment and iteration.

TruDi and REPPO (`--runners trudi reppo`) use trudi_jax's cpu-preset networks with the bench's batch shape;
the table then also gives TruDi's time per environment step relative to REPPO's.

Add a trainer by adding an entry to RUNNERS: a function (bench, env name) -> Runner.
"""
from __future__ import annotations

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
from typing import Callable, NamedTuple

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
    iterations: int = 10  # PPO iterations per timed block (Brax: training steps per epoch)
    repeats: int = 5  # timed rounds per runner; the median is reported
    quick: bool = False  # small preset: both default tasks in ~15 minutes on 2 CPU cores
    json: str | None = None  # also write the results to this file
    runners: tuple[str, ...] = ("ppo_jax", "brax_ppo")  # which of: ppo_jax brax_ppo trudi reppo
    num_diffusion_steps: int = trudi_jax.Config.num_diffusion_steps  # TruDi's N
    num_old_chains: int = trudi_jax.Config.num_old_chains  # TruDi's K
    paper_networks: bool = False  # TruDi/REPPO/PPO networks (and TruDi's K) of each file's paper preset


QUICK = Bench(num_envs=128, rollout_steps=32, num_minibatches=8, num_epochs=8, iterations=4, repeats=3, quick=True)


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
    base = ppo_jax.preset_config("paper", env_name) if bench.paper_networks else ppo_jax.Config()
    cfg = dataclasses.replace(base, env=env_name, num_envs=bench.num_envs, rollout_steps=bench.rollout_steps,
                         num_minibatches=bench.num_minibatches, num_epochs=bench.num_epochs,
                         policy_hidden=base.policy_hidden if bench.paper_networks else bench.policy_hidden,
                         value_hidden=base.value_hidden if bench.paper_networks else bench.value_hidden,
                         total_steps=bench.iterations * bench.num_envs * bench.rollout_steps,
                         num_evals=1, num_eval_envs=1, plot=False)
    ppo_jax.validate(cfg)
    return cfg


class Runner(NamedTuple):
    compile_s: float | None  # measured compile time, or None: estimate it as first_block_s - median block
    first_block_s: float  # the untimed warm-up block (for Brax it also holds the compilation)
    run_block: Callable[[], float]  # runs one block, returns its wall-clock seconds
    close: Callable[[], dict]  # finishes the run; returns extra fields for the results


# ---------------------------------------------------------------------------------------------
# ppo_jax: AOT-compiled chunk, evaluation dropped from the program.
# ---------------------------------------------------------------------------------------------
def ppo_jax_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(ppo_jax, ppo_config(bench, env_name), bench)


def trudi_config(bench: Bench, env_name: str, actor: str) -> trudi_jax.Config:
    """trudi_jax's cpu-preset (or paper-preset) networks with the bench's batch shape; 'gaussian' is REPPO."""
    base = trudi_jax.preset_config("paper", env_name) if bench.paper_networks else trudi_jax.Config()
    cfg = dataclasses.replace(base, env=env_name, actor=actor, num_envs=bench.num_envs,
                           rollout_steps=bench.rollout_steps, num_minibatches=bench.num_minibatches,
                           num_epochs=bench.num_epochs, num_diffusion_steps=bench.num_diffusion_steps,
                           num_old_chains=base.num_old_chains if bench.paper_networks else bench.num_old_chains,
                           total_steps=bench.iterations * bench.num_envs * bench.rollout_steps,
                           num_evals=1, num_eval_envs=1, plot=False)
    trudi_jax.validate(cfg)
    return cfg


def trudi_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(trudi_jax, trudi_config(bench, env_name, "diffusion"), bench)


def reppo_runner(bench: Bench, env_name: str) -> Runner:
    return jitted_runner(trudi_jax, trudi_config(bench, env_name, "gaussian"), bench)


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

    def run_block() -> float:
        start = time.perf_counter()
        state["ts"], metrics = jax.block_until_ready(compiled(state["ts"]))
        return time.perf_counter() - start

    return Runner(compile_s, run_block(), run_block, lambda: {})


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
    return Runner(None, time.perf_counter() - start, run_block, close)


RUNNERS: dict[str, Callable[[Bench, str], Runner]] = {"ppo_jax": ppo_jax_runner, "brax_ppo": brax_ppo_runner,
                                                      "trudi": trudi_runner, "reppo": reppo_runner}
BASELINE = "brax_ppo"  # the ratio column is <runner>_sps / BASELINE_sps


# ---------------------------------------------------------------------------------------------
# Measurement: compile all, alternate blocks, report medians.
# ---------------------------------------------------------------------------------------------
def measure(bench: Bench, env_name: str, log: Callable[[str], None] = print) -> dict:
    """One result row for a task: median steps/s and compile seconds of every runner."""
    steps_per_block = bench.iterations * bench.num_envs * bench.rollout_steps
    runners = {}
    for name in bench.runners:
        runners[name] = RUNNERS[name](bench, env_name)
        log(f"[{env_name}] {name}: ready (first block {runners[name].first_block_s:.1f} s)")
    seconds = {name: [] for name in runners}
    for round_ in range(bench.repeats):
        for name, runner in runners.items():
            seconds[name].append(runner.run_block())
        log(f"[{env_name}] round {round_ + 1}/{bench.repeats}: " + ", ".join(
            f"{name} {steps_per_block / s[-1]:,.0f} steps/s" for name, s in seconds.items()))
    row = {"env": env_name}
    for name, runner in runners.items():
        block_s = statistics.median(seconds[name])
        compile_s = runner.compile_s if runner.compile_s is not None else runner.first_block_s - block_s
        row[f"{name}_sps"] = steps_per_block / block_s
        row[f"{name}_compile_s"] = compile_s
        row[f"{name}_sps_rounds"] = [steps_per_block / s for s in seconds[name]]
        row.update({f"{name}_{key}": value for key, value in runner.close().items()})
    if "trudi" in runners and "reppo" in runners:
        row["trudi_time_per_step_vs_reppo"] = row["reppo_sps"] / row["trudi_sps"]
    for name in runners:
        if name != BASELINE and BASELINE in runners:
            row["ratio" if name == "ppo_jax" else f"ratio_{name}"] = row[f"{name}_sps"] / row[f"{BASELINE}_sps"]
    return row


def markdown_table(rows: list[dict]) -> str:
    names = [name for name in RUNNERS if f"{name}_sps" in rows[0]]
    ratios = {key: f"{key} (vs {BASELINE})" for key in rows[0] if key == "ratio" or key.startswith("ratio_")}
    if "trudi_sps" in rows[0] and "reppo_sps" in rows[0]:
        ratios["trudi_time_per_step_vs_reppo"] = "TruDi time per step / REPPO's"
    header = (["env"] + [f"{n} steps/s" for n in names] + list(ratios.values())
              + [f"{n} compile s" for n in names])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ([row["env"]] + [f"{row[f'{n}_sps']:,.0f}" for n in names] + [f"{row[r]:.2f}" for r in ratios]
                 + [f"{row[f'{n}_compile_s']:.1f}" for n in names])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> list[dict]:
    bench = parse_bench(argv)
    import brax
    context = {"num_envs": bench.num_envs, "rollout_steps": bench.rollout_steps,
               "num_minibatches": bench.num_minibatches, "num_epochs": bench.num_epochs,
               "policy_hidden": list(bench.policy_hidden), "value_hidden": list(bench.value_hidden),
               "iterations_per_block": bench.iterations, "paper_networks": bench.paper_networks,
               "steps_per_block": bench.iterations * bench.num_envs * bench.rollout_steps,
               "repeats": bench.repeats, "jax": jax.__version__, "brax": brax.__version__,
               "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} ({os.cpu_count()} CPU cores)",
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": shlex.join(["python", "benchmarks/throughput.py", *argv])}
    rows = [measure(bench, name) | context for name in bench.envs]
    print(markdown_table(rows))
    if bench.json:
        with open(bench.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
