#!/usr/bin/env bash
# GPU check, one NVIDIA H200, about 8 minutes in all (each part has its own time limit, and a part that fails
# does not stop the next):
#  1. throughput at the paper presets' true sizes on HumanoidWalk: TruDi (1024 envs x 32 steps, 16 minibatches,
#     8 epochs, 512-wide networks, N = 8, K = 4), REPPO (the same with the Gaussian actor), ppo_jax and Brax's
#     PPO (Playground's tuned DM Control settings: 2048 envs x 480 steps, 32 minibatches, 16 epochs), timed
#     alternately, with each compiled program's peak memory (FLOPs per step are counted on CPU: --no-flops);
#  2. a short TruDi training run on HumanoidWalk with the paper preset (training steps/s, first evaluations).
# Writes into benchmarks/results/gpu/ (or $OUT when set). On a machine whose image lacks brax/mujoco/playground/tyro,
# run benchmarks/fetch_gpu_wheels.sh first on a machine with PyPI and ship .whl/ alongside; this script installs it.
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
part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $dest/NAME.log, report the exit status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$dest/$name.log"
  echo "[gpu_check] $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$dest/machine.txt"
}
part throughput_paper_HumanoidWalk 330 python3 benchmarks/throughput.py --preset paper --envs HumanoidWalk \
  --runners trudi reppo ppo_jax brax_ppo --iterations 2 --repeats 3 --no-flops \
  --json "$dest/throughput_paper_HumanoidWalk.json"
part trudi_HumanoidWalk_short 120 python3 trudi_jax.py --env HumanoidWalk --preset paper --total-steps 3000000 \
  --num-evals 3 --num-eval-envs 128 --out-dir "$dest/trudi_HumanoidWalk_short" --overwrite --no-plot
exit 0
