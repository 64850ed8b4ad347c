#!/usr/bin/env bash
# GPU check, one NVIDIA H200, under 8 minutes in all:
#  1. throughput of TruDi, REPPO (TruDi --actor gaussian), ppo_jax and Brax's PPO on HumanoidWalk with the
#     paper networks and TruDi's paper batch (1024 envs x 32 steps, 16 minibatches, 8 epochs), timed alternately;
#  2. a short TruDi learning run on HumanoidWalk with the paper preset;
#  3. checkpoint write/read time and size of the paper-preset train state on HumanoidWalk (both algorithms).
# Writes into benchmarks/results/gpu/ (or $OUT when set). On a machine whose image lacks brax/mujoco/playground/tyro,
# run benchmarks/fetch_gpu_wheels.sh first on a machine with PyPI and ship .whl/ alongside; this script installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-benchmarks/results/gpu}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
if ! python3 -c "import brax, mujoco, mujoco_playground, tyro" 2>/dev/null; then
  [ -d .whl ] || { echo "error: brax/mujoco/playground/tyro are missing and there is no .whl/ (run benchmarks/fetch_gpu_wheels.sh)" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import jax, brax, mujoco; print('jax', jax.__version__, jax.devices(), 'brax', brax.__version__, 'mujoco', mujoco.__version__)"
  date -u +%FT%TZ; } | tee "$dest/machine.txt"
timeout 300 python3 benchmarks/throughput.py --envs HumanoidWalk --paper-networks --num-envs 1024 --rollout-steps 32 \
  --num-minibatches 16 --num-epochs 8 --iterations 5 --repeats 3 --runners trudi reppo ppo_jax brax_ppo \
  --json "$dest/throughput_HumanoidWalk.json" 2>&1 | tee "$dest/throughput_HumanoidWalk.log"
timeout 120 python3 trudi_jax.py --env HumanoidWalk --preset paper --total-steps 2000000 --num-evals 2 \
  --num-eval-envs 64 --out-dir "$dest/trudi_HumanoidWalk_short" 2>&1 | tee "$dest/trudi_HumanoidWalk_short.log"
timeout 60 python3 benchmarks/checkpoint_io.py --env HumanoidWalk --preset paper \
  --json "$dest/checkpoint_io.json" 2>&1 | tee "$dest/checkpoint_io.log"
