"""What one call of workload f asks of CUDA and of ATen, counted, for each variant.

Timings of two versions differ by noise and by layout; counts do not. Under
``torch.profiler``, ``--calls`` calls of each variant of workload f (the policy called with
random batch sizes; ``--baseline DIR`` adds the version before's variants) give, per call, the
CUDA runtime calls (kernel and graph launches, copies, events) and the ATen operators that the
host ran, and the CPU time the profiler saw in each. A variant that launches one more kernel,
or copies one more tensor, than another shows here as a difference of one a call:

    python benchmarks/launches.py --baseline benchmarks/baseline
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pathlib
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [str(pathlib.Path(__file__).parent)]
import workloads  # noqa: E402
from run import sync  # noqa: E402


def per_call(call: Any, calls: int) -> tuple[dict[str, float], dict[str, float]]:
    """The events of ``calls`` calls, a call: {name: count}, {name: CPU us}."""
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.no_grad():
        for _ in range(calls):
            call()
        sync()
    counts: collections.Counter[str] = collections.Counter()
    times: collections.Counter[str] = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith(("cuda", "aten::")) and "Synchronize" not in event.key:
            counts[event.key] += event.count
            times[event.key] += event.self_cpu_time_total
    return (
        {k: v / calls for k, v in sorted(counts.items())},
        {k: v / calls for k, v in sorted(times.items())},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="folder of the version before")
    parser.add_argument("--calls", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("launches.py counts what a call asks of CUDA: it needs CUDA (none here)")
        return
    if args.baseline:
        sys.path.insert(0, str(pathlib.Path(args.baseline).resolve()))
        workloads.BASELINE = importlib.import_module("cudagraph_td_baseline")
    workload = workloads.policy_random_batch(torch.device("cuda"))
    names = ["floor", "cudagraph_td", "cudagraph_td exact"]
    names += [n for n in (workloads.BEFORE, f"{workloads.BEFORE} exact") if n in workload.variants]
    rows: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    with torch.no_grad():
        calls = {name: workload.variants[name]() for name in names}
    for name, call in calls.items():
        per_call(call, 64)  # the profiler's own first-use costs
        rows[name] = per_call(call, args.calls)
    keys = sorted({k for counts, _ in rows.values() for k in counts})
    width, column = max(len(k) for k in keys), max(28, *map(len, names))
    print("each cell: the count a call, and the CPU time the profiler saw in them a call")
    print(f"{'a call':{width}s} " + " ".join(f"{n:>{column}s}" for n in names))
    for key in keys:
        cells = [f"{rows[n][0].get(key, 0):8.2f} {rows[n][1].get(key, 0):8.2f} us" for n in names]
        print(f"{key:{width}s} " + " ".join(f"{c:>{column}s}" for c in cells))


if __name__ == "__main__":
    main()
