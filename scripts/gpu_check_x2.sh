#!/usr/bin/env bash
# The GPU check on a machine of two GPUs, in one call of under ten minutes: the benchmark
# against the version before alone first (GPU 0, nothing else running: its CPU times are
# what it compares), then the test suite split in two halves run side by side (GPU 0 and
# GPU 1), then the examples (GPU 1) beside the torchrl stage (GPU 0). From the repository
# root of the device's copy, with .whl, .whl-rl and benchmarks/baseline carried:
#   OUT=$OUT bash scripts/gpu_check_x2.sh          # BENCH_ARGS: run.py's, e.g. --workloads c,f
# Logs in $OUT: bench/, tests-0.log, tests-1.log, examples.log, gpu-torchrl.log.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-rl .whl-rl/*.whl || exit 1
site="$PWD/src:$PWD:/tmp/site"
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.log"
if [ "${BENCH:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # the settings' words are its arguments
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$site" python3 benchmarks/run.py --no-compile \
    --baseline benchmarks/baseline --out "$out/bench" ${BENCH_ARGS:---workloads c,f,g --repeats 45} \
    > "$out/bench.log" 2>&1 || status=1
  tail -3 "$out/bench.log"
fi
# The test files in two halves, in turn by name; the corpus and the doctests with the second.
mapfile -t files < <(ls tests/test_*.py)
half=(); other=(tests/corpus src/cudagraph_td)
for i in "${!files[@]}"; do
  if ((i % 2)); then other+=("${files[$i]}"); else half+=("${files[$i]}"); fi
done
CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$site" CATALOG_EXAMPLES=${CATALOG_EXAMPLES:-50} python3 -m \
  pytest -q -p no:cacheprovider "${half[@]}" > "$out/tests-0.log" 2>&1 &
first=$!
CUDA_VISIBLE_DEVICES=1 PYTHONPATH="$site" CATALOG_EXAMPLES=${CATALOG_EXAMPLES:-50} python3 -m \
  pytest -q -p no:cacheprovider "${other[@]}" > "$out/tests-1.log" 2>&1 || status=1
wait "$first" || status=1
tail -n 4 "$out/tests-0.log" "$out/tests-1.log"
for example in examples/*.py; do
  grep -q "^    from torchrl" "$example" && continue  # run beside torchrl, below
  echo "== $example" >> "$out/examples.log"
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH="$site" python3 "$example" >> "$out/examples.log" 2>&1 \
    || { status=1; echo "FAILED: $example"; }
done &
examples=$!
CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD/src:$PWD:/tmp/site-rl" python3 -m pytest -q \
  -p no:cacheprovider tests/test_torchrl.py tests/test_tdmodule.py tests/test_compat.py \
  tests/test_module.py tests/corpus/test_torchrl_sota.py > "$out/gpu-torchrl.log" 2>&1 || status=1
wait "$examples" || status=1
tail -n 2 "$out/gpu-torchrl.log"; grep -c "^== " "$out/examples.log"; grep FAILED "$out/examples.log"
echo "status $status"
exit "$status"
