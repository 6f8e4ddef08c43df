#!/usr/bin/env bash
# Download, into .whl-rl/ at the root of the checkout, what the GPU machine (Python 3.12,
# torch preinstalled, no network) needs to run the tests that use torchrl: torchrl 0.14.1,
# the tensordict it requires (<0.15) and their small pure-Python needs. scripts/gpu_check.sh
# installs them in a site directory of their own, apart from .whl/'s newer tensordict.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl-rl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl-rl/' >> .git/info/exclude; }
mkdir -p .whl-rl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-rl \
  torchrl==0.14.1 tensordict==0.14.3 cloudpickle==3.1.2 optree==0.20.0 pyvers==0.2.3 2>&1 | grep -v '^WARNING' || true
ls -1 .whl-rl
