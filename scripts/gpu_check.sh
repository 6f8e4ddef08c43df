#!/usr/bin/env bash
# The whole GPU check in one call: the test suite (CUDA tests included), the examples, and
# with BENCH=1 the benchmark (beside the version in benchmarks/baseline, if made by
# scripts/make_baseline.sh). On the device machine (no network, torch preinstalled), from
# the repository root:
#   bash scripts/gpu_check.sh                 # tests and examples
#   TESTS=0 BENCH=1 bash scripts/gpu_check.sh # the benchmark alone (SOAK=0: without the soak)
#   TESTS=0 TORCHRL=0 SOAK=0 MEMORY=1 bash scripts/gpu_check.sh  # the memory contract, memcheck
#   TESTS=0 TORCHRL=0 SOAK=0 LEANRL=1 bash scripts/gpu_check.sh  # LeanRL's loops end to end
#   TESTS=0 TORCHRL=0 SOAK=0 ROLLOUTS=1 bash scripts/gpu_check.sh  # whole rollouts, steps/s
#   TESTS=0 TORCHRL=0 SOAK=0 LEANRL_SCRIPTS=1 bash scripts/gpu_check.sh  # LeanRL's own scripts
#   TESTS=0 TORCHRL=0 SOAK=0 MJW=1 bash scripts/gpu_check.sh  # MuJoCo Warp: check, timings
#   TESTS=0 TORCHRL=0 SOAK=0 MJW=1 MJW_BENCH=0 MJW_PPO=1 bash scripts/gpu_check.sh  # its PPO
#   TESTS=0 TORCHRL=0 SOAK=0 MJW=1 MJW_BENCH=0 MJW_PPO_APART=1 bash scripts/gpu_check.sh  # seeds apart
#   CRASH_DEBUGGER=/usr/local/cuda/bin/cuda-gdb bash scripts/gpu_check.sh  # native stacks at a crash
#   CRASH_STACKS=torch bash scripts/gpu_check.sh  # the same from torch's handler, at full speed
# It installs the wheels that ../shared/gpu/fetch-wheels.sh put in .whl/ (if any), and writes
# its logs to $OUT (or ./gpu-logs when OUT is unset); test-pairs.log pairs each test body's
# outcome on the emulation with its outcome on CUDA (scripts/test_pairs.py). With wheels in
# .whl-rl/ (torchrl 0.14.1, the tensordict 0.14.3 it requires, and their small needs; see
# scripts/fetch_torchrl_wheels.sh) it also runs the tests that use torchrl, in an environment
# of their own.
set -uo pipefail
out=${OUT:-gpu-logs}
mkdir -p "$out"
report=$(cd "$out" && pwd)/corpus.jsonl  # absolute: the torchrl stage runs elsewhere too
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD/src:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
status=0
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, tensordict, optree; print("torch", torch.__version__, "tensordict", tensordict.__version__, "optree", optree.__version__)'
} 2>&1 | tee "$out/env.log"
if [ "${TESTS:-1}" = 1 ]; then
  # The corpus (tests/corpus) runs with the rest; each row's outcome per wrapper goes to
  # corpus.jsonl, and scripts/corpus_table.py makes the docs' table of it.
  rm -f "$report"
  # Through crashes: a test that crashes the process is reported, and the tests after it
  # run in a fresh one (scripts/pytest_through_crashes.py). The slowest tests are listed:
  # the device time of a session is short.
  CORPUS_REPORT="$report" CATALOG_EXAMPLES=${CATALOG_EXAMPLES:-200} \
    python3 scripts/pytest_through_crashes.py -p no:cacheprovider --durations=30 \
    tests src/cudagraph_td "$@" \
    2>&1 | tee "$out/gpu-tests.log" || status=1
  # Each test body's outcome on the emulation beside CUDA's (the hazard files in the table).
  python3 scripts/test_pairs.py "$out/gpu-tests.log" tests/test_capture.py tests/test_recording.py \
    > "$out/test-pairs.log"
  for example in examples/*.py; do
    grep -q "^    from torchrl" "$example" && continue  # run beside torchrl, below
    echo "== $example" | tee -a "$out/examples.log"
    python3 "$example" 2>&1 | tee -a "$out/examples.log" || status=1
  done
fi
echo "== the script at ${SECONDS} s after the tests and examples" | tee -a "$out/stages.log"
if [ "${TORCHRL:-1}" = 1 ] && compgen -G ".whl-rl/torchrl-*.whl" > /dev/null; then
  # torchrl 0.14.1 pins tensordict<0.15: its own site directory, not the one above. The
  # corpus first (docs/corpus.md's table): a call's time limit cuts the tests after it.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-rl .whl-rl/*.whl || exit 1
  CORPUS_REPORT="$report" PYTHONPATH="$PWD/src:$PWD:/tmp/site-rl" \
    python3 -m pytest -q -p no:cacheprovider tests/corpus/test_torchrl_sota.py \
    tests/test_torchrl.py tests/test_tdmodule.py tests/test_compat.py tests/test_module.py \
    2>&1 | tee "$out/gpu-torchrl.log" || status=1
  for example in $(grep -l "^    from torchrl" examples/*.py); do
    echo "== $example" | tee -a "$out/examples.log"
    PYTHONPATH="$PWD/src:/tmp/site-rl" python3 "$example" ${RL_EXAMPLE_ARGS:-} 2>&1 \
      | tee -a "$out/examples.log" || status=1
  done
fi
echo "== the script at ${SECONDS} s after the torchrl stage" | tee -a "$out/stages.log"
if [ "${ROLLOUTS:-0}" = 1 ] && compgen -G ".whl-rl/torchrl-*.whl" > /dev/null; then
  # Whole rollouts of torchrl's PendulumEnv (benchmarks/rollouts.py): environment steps per
  # second, eager per step, the policy graphed, the whole K-step rollout graphed.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-rl .whl-rl/*.whl || exit 1
  PYTHONPATH="$PWD/src:/tmp/site-rl" python3 benchmarks/rollouts.py ${ROLLOUTS_ARGS:-} \
    --json "$out/rollouts.json" 2>&1 | tee "$out/rollouts.log" || status=1
fi
if [ "${MJW:-0}" = 1 ]; then
  # MuJoCo Warp's HalfCheetah (benchmarks/mjwarp_cheetah.py, benchmarks/mjwarp_ppo.py): its
  # wheels joined from the parts that earlier calls to this warm machine carried
  # (scripts/carry_parts.sh: call 1 carries .carry1 and runs `carry_parts.sh status`, the
  # call with the last part runs this). MJW_BENCH=1 (the default): the graphed-against-eager
  # check and the steps per second at MJW_ENVS worlds (the eager per-step loop syncs the host
  # at each solver iteration: minutes). MJW_PPO=1: PPO graphed against eager (MJW_PPO_ARGS),
  # best in a call of its own (first `--seeds 0 --total-steps 327680` for the time an
  # iteration takes, then the settings that fit a call).
  bash scripts/carry_parts.sh join || exit 1
  export WARP_CACHE_PATH=${WARP_CACHE_PATH:-/tmp/warp-cache-mjw}
  if [ "${MJW_BENCH:-1}" = 1 ]; then
    PYTHONPATH="$PYTHONPATH:/tmp/site-mjw" python3 benchmarks/mjwarp_cheetah.py --check \
      --skip-c --check-deterministic off --envs "${MJW_ENVS:-1024,4096}" \
      --json "$out/mjw.json" 2>&1 | grep -v '^Module ' | tee "$out/mjw.log" || status=1
  fi
  if [ "${MJW_PPO_APART:-0}" = 1 ]; then
    # PPO's returns, each seed and mode a process of its own, side by side on the GPU (the
    # eager loop waits on the host at each solver iteration: apart, the runs wait together),
    # then one report of them all (mjwarp_ppo.py --merge). Their steps per second share
    # the GPU and the host: time with MJW_PPO=1 and one seed. The first run loads (or
    # compiles) Warp's kernels into the cache before the others start.
    runs=()
    for seed in ${MJW_PPO_SEEDS:-0 1 2}; do
      for mode in graphed eager; do
        name="$out/mjw_ppo_${mode}_${seed}"
        runs+=("$name.json")
        # shellcheck disable=SC2086  # the settings' words are its arguments
        PYTHONPATH="$PYTHONPATH:/tmp/site-mjw" python3 benchmarks/mjwarp_ppo.py --seeds "$seed" \
          --mode "$mode" ${MJW_PPO_ARGS:-} --json "$name.json" > "$name.log" 2>&1 &
        if [ "${#runs[@]}" = 1 ]; then
          for _ in $(seq 300); do grep -q "kernels loaded" "$name.log" && break; sleep 1; done
        fi
      done
    done
    wait
    PYTHONPATH="$PYTHONPATH:/tmp/site-mjw" python3 benchmarks/mjwarp_ppo.py --merge "${runs[@]}" \
      --json "$out/mjw_ppo.json" 2>&1 | tee "$out/mjw_ppo.log" || status=1
  fi
  if [ "${MJW_PPO:-0}" = 1 ]; then
    # shellcheck disable=SC2086  # the settings' words are its arguments
    PYTHONPATH="$PYTHONPATH:/tmp/site-mjw" python3 benchmarks/mjwarp_ppo.py \
      ${MJW_PPO_ARGS:---seeds 0,1,2 --mode graphed,eager} --json "$out/mjw_ppo.json" 2>&1 \
      | grep -v '^Module ' | tee "$out/mjw_ppo.log" || status=1
  fi
fi
if [ -f "$out/corpus.jsonl" ]; then
  python3 scripts/corpus_table.py "$out/corpus.jsonl" > "$out/corpus-table.md" || status=1
fi
if [ "${SOAK:-1}" = 1 ]; then
  # This library's graphs beside torch's, torch.compile's and tensordict's, in one process,
  # every result checked against eager (scripts/soak.py); then a short run, and the process
  # of tests/workspace_owners.py, under compute-sanitizer's memcheck. Under the sanitizer,
  # torch.compile's graph trees fail their own check of their pool at a warm-up ("tensors
  # in the cudagraph pool not tracked as outputs"; the same seed passes without it): its
  # actors are left out there. So are the failed-capture actors: their capture fails by
  # design (a host sync under capture), through the CUDA API errors that memcheck counts
  # (cudaStreamSynchronize refused while capturing, then the invalidated capture's end).
  python3 scripts/soak.py --seconds "${SOAK_SECONDS:-120}" --seed "${SOAK_SEED:-0}" 2>&1 \
    | tee "$out/soak.log" || status=1
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
  if [ -x "$sanitizer" ]; then
    for run in "scripts/soak.py --steps ${MEMCHECK_STEPS:-150} --skip compile,failed-capture --seed 1" \
      "tests/workspace_owners.py cudagraph_td"; do
      echo "== memcheck: $run" | tee -a "$out/memcheck.log"
      # shellcheck disable=SC2086  # the run's words are its arguments
      "$sanitizer" --tool memcheck --leak-check no --error-exitcode 3 python3 $run 2>&1 \
        | tee -a "$out/memcheck.log" || status=1
    done
  fi
fi
if [ "${MEMORY:-0}" = 1 ]; then
  # The memory contract in random runs on CUDA (tests/test_memory_contract.py): 1,000 steps
  # a seed, then a short run under compute-sanitizer's memcheck; and the GPU memory the
  # captures hold (benchmarks/memory.py).
  MEMORY_CONTRACT_STEPS=${MEMORY_STEPS:-1000} python3 -m pytest -q -p no:cacheprovider \
    tests/test_memory_contract.py -k cuda 2>&1 | tee "$out/memory-contract.log" || status=1
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
  if [ -x "$sanitizer" ]; then
    MEMORY_CONTRACT_STEPS=${MEMCHECK_MEMORY_STEPS:-120} "$sanitizer" --tool memcheck \
      --leak-check no --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider \
      tests/test_memory_contract.py -k "cuda and 0" 2>&1 | tee "$out/memcheck-memory.log" \
      || status=1
  fi
  python3 benchmarks/memory.py --json "$out/memory.json" 2>&1 | tee "$out/memory.log" \
    || status=1
fi
if [ "${BENCH:-0}" = 1 ]; then
  baseline=()
  [ -d benchmarks/baseline/cudagraph_td_baseline ] && baseline=(--baseline benchmarks/baseline)
  python3 benchmarks/run.py --repeats "${REPEATS:-9}" "${baseline[@]}" --out "$out/bench" \
    --name "${BENCH_NAME:-h100}" 2>&1 | tee "$out/bench.log" || status=1
fi
if [ "${LEANRL:-0}" = 1 ]; then
  # LeanRL's SAC, TD3 and PPO loops end to end: eager, tensordict's class, cudagraph_td
  # (benchmarks/leanrl.py; about 2 minutes on an H100 with these settings).
  # shellcheck disable=SC2086  # the settings' words are its arguments
  python3 benchmarks/leanrl.py ${LEANRL_ARGS:---steps 700 --skip 30 --rounds 5} 2>&1 \
    | tee "$out/leanrl.log" || status=1
fi
if [ "${LEANRL_SCRIPTS:-0}" = 1 ]; then
  # LeanRL's own TD3 and SAC scripts on HalfCheetah-v4 (benchmarks/leanrl_scripts.py):
  # tensordict's class, cudagraph_td's, cudagraph_td's with borrowed outputs, 3 runs each,
  # a fresh process a run (on an H100 with these settings: 203 s for TD3 alone and 176 s for
  # SAC alone, each in a call of its own with LEANRL_SCRIPTS_ARGS="--scripts td3 ...", which
  # keeps each call under a 600 s limit). Needs .leanrl/
  # and .whl-leanrl/ from scripts/fetch_leanrl.sh, in a site directory of their own (its
  # numpy<2 and gymnasium 0.29 ahead of whatever torch's environment has).
  if compgen -G ".whl-leanrl/*.whl" > /dev/null && [ -d .leanrl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-leanrl .whl-leanrl/*.whl || exit 1
    # shellcheck disable=SC2086  # the settings' words are its arguments
    PYTHONPATH="$PWD/src:/tmp/site-leanrl:$PYTHONPATH" python3 benchmarks/leanrl_scripts.py \
      ${LEANRL_SCRIPTS_ARGS:---runs 3 --total-timesteps 2200 --learning-starts 800 --timeout 150} \
      --out "$out" 2>&1 | tee "$out/leanrl_scripts.log" || status=1
  else
    echo "LEANRL_SCRIPTS=1: .whl-leanrl/ or .leanrl/ missing (bash scripts/fetch_leanrl.sh)" \
      | tee "$out/leanrl_scripts.log"
    status=1
  fi
fi
exit $status
