#!/usr/bin/env bash
# Download what benchmarks/leanrl_scripts.py needs on the GPU machine (Python 3.12, torch
# preinstalled, no network), at the root of the checkout:
#   .whl-leanrl/  the wheels that LeanRL's TD3 and SAC scripts import on HalfCheetah-v4,
#                 beside .whl/'s tensordict and optree (scripts/gpu_check.sh installs both);
#   .leanrl/      LeanRL's td3_ and sac_continuous_action_torchcompile.py, at the commit that
#                 tests/corpus/test_leanrl.py read.
# gymnasium 0.29.1 (its mujoco environments import imageio and glfw), not 1.x: the scripts read infos["final_info"] and
# infos["final_observation"], which gymnasium 1.0's vector environments no longer return
# (SAC's loop fails at the first truncation without them); numpy<2 as LeanRL's requirements
# pin (gymnasium 0.29 predates numpy 2). torchrl 0.14.1 for the replay buffer (its metadata
# asks tensordict<0.15; the buffer runs on .whl/'s 0.15.3). wandb is not fetched: the
# benchmark puts a stand-in in its place (the scripts call wandb.init and wandb.log only).
# PY_VERSION=3.11 WHEELS=/tmp/somewhere fetches the same wheels for another Python, to try
# them on a machine other than the GPU's.
# Without access to raw.githubusercontent.com, LEANRL_GIT=<a clone's git dir> reads the
# scripts from a clone of github.com/pytorch-labs/LeanRL instead.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
commit=8dbb6336b7f6cc65cdbbeb2e86637c38867e2677
wheels=${WHEELS:-.whl-leanrl}
mkdir -p "$wheels" .leanrl
pkgs=(
  gymnasium==0.29.1 farama-notifications==0.0.6 cloudpickle==3.1.3 typing-extensions==4.16.0
  numpy==1.26.4
  mujoco==3.3.7 absl-py==2.5.1 etils==1.15.0 fsspec==2026.9.0 importlib-resources==7.1.0
  zipp==4.1.2 glfw==2.11.0 pyopengl==3.1.10 imageio==2.38.1
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  tqdm==4.70.1
  torchrl==0.14.1 hoptorch==0.1.4 packaging==26.4 pyvers==0.2.3
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$wheels" "${pkgs[@]}" 2>&1 | grep -v '^WARNING' || true
for script in td3_continuous_action_torchcompile.py sac_continuous_action_torchcompile.py; do
  if [ -n "${LEANRL_GIT:-}" ]; then
    git --git-dir "$LEANRL_GIT" show "$commit:leanrl/$script" > ".leanrl/$script"
  else
    curl -fsSL -o ".leanrl/$script" \
      "https://raw.githubusercontent.com/pytorch-labs/LeanRL/$commit/leanrl/$script"
  fi
done
echo "$commit" > .leanrl/COMMIT
ls -1 "$wheels" .leanrl
du -sh "$wheels" .leanrl
