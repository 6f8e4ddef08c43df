"""Time every workload of ``workloads.py`` through every tool, side by side.

    python benchmarks/run.py                  # all workloads, results in benchmarks/results/
    python benchmarks/run.py --out docs/benchmarks --name h100
    python benchmarks/run.py --baseline benchmarks/baseline   # with the code before a change

``--baseline DIR`` times an earlier version of the library beside this one, in the same
process, as the variant ``cudagraph_td (before)``: DIR holds it as the package
``cudagraph_td_baseline``, which ``scripts/make_baseline.sh REV`` makes from a commit.

Per workload, the variants are built (warm-up, compilation and capture happen here, untimed),
then timed in ``--repeats`` rounds. Each round times every variant once, in a rotated
order, so that drift of the machine (clocks, other processes) hits all variants alike.
Two timings per variant and round:

- *wall*: ``--calls`` back-to-back calls followed by one synchronisation, divided by the
  number of calls: the cost of a call in a loop, the larger of its CPU and GPU times;
- *CPU*: the same calls in short bursts that never fill the GPU's launch queue: the time
  the CPU spends issuing a call, which is what a wrapper adds, and what wall time hides
  when a call's GPU work takes longer.

The tables report the median over the rounds, and ratios to the hand-written floor and to
tensordict's ``CudaGraphModule``; for workloads g and h, each variant that takes turns
between two modes or shapes against the mean of its steady variants (one mode or shape
only). The targets say which time they check: CPU time, but for the graphed training loops
of e and e2, wall time.

Then the capture cost: for each wrapper, the time and the GPU memory from its construction
to its first replay, each wrapper built fresh after the others were freed: the median of
three builds, the wrappers taking turns in a rotating order (the first build after a
workload's timings pays one-off costs of the process, which no wrapper should be charged).
Every call of those builds sits between clears of cuBLAS's workspaces (see `bracketed`), as
torch.compile's CUDA graph trees clear them around each recording: cudagraph_td makes its
capture stream's workspaces again in its own pool after each clear (four small captures).

On a machine without CUDA there is no graph to time: the script says so and times the
eager function against the wrappers' eager fallbacks.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import pathlib
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import tensordict
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "src"))

import report
import workloads

import cudagraph_td


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_calls(call: Callable[[], Any], calls: int) -> float:
    """Wall microseconds per call over ``calls`` back-to-back calls, GPU work included."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def time_bursts(
    calls: dict[str, Callable[[], Any]], bursts: int, burst: int = 16
) -> dict[str, list[float]]:
    """CPU microseconds per call of each variant, one figure a burst: the time to issue it,
    the GPU work not waited for.

    Calls run in short bursts after an (untimed) synchronisation, so that the GPU's launch
    queue never fills and no launch waits for the GPU: what is measured is the cost of
    the Python code and the launches, which is what a wrapper adds. Where the GPU work of a
    call takes longer than that, wall time is the GPU's and hides it.

    The variants' bursts are interleaved (one burst of each, in a new random order, ``bursts``
    times), so that every variant is timed in the same state of the machine: on a shared
    host, the cost of the same call drifts by tens of percent within a second.
    """
    per_burst: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    order = random.Random(0)  # a new order at each burst: no variant always follows another
    for _ in range(bursts):
        order.shuffle(names)
        for name in names:
            call = calls[name]
            sync()
            start = time.perf_counter()
            for _ in range(burst):
                call()
            per_burst[name].append((time.perf_counter() - start) / burst * 1e6)
    sync()
    return per_burst


def time_cpu(calls: dict[str, Callable[[], Any]], bursts: int, burst: int = 16) -> dict[str, float]:
    """`time_bursts`' median burst of each variant: an interruption of the process (another
    thread, the OS) costs one burst, not the whole timing."""
    return {name: statistics.median(t) for name, t in time_bursts(calls, bursts, burst).items()}


def bracketed(call: Callable[[], Any]) -> Any:
    """``call()`` (a warm-up, capture or compilation), between clears of cuBLAS's workspaces,
    as torch.compile's CUDA graph trees bracket each recording.

    torch caches cuBLAS's workspaces by stream, and hands its pool's streams out again every
    32: a graph captured on a stream whose workspace another graph made uses memory that it
    does not own (pytorch#193402). Here tensordict's class captured on the stream of
    ``torch.cuda.graph`` (workload d), whose next capture (torch's ``make_graphed_callables``,
    e) took that workspace; once a clear and ``torch.cuda.empty_cache()`` gave it back to the
    driver, its replays faulted. Cleared before and after each of the tools' captures, no
    workspace outlives the capture that made it (and `workloads` keeps torch's warm-ups off
    its capture stream, whose workspace the capture would otherwise take). cudagraph_td needs
    none of this (its graphs use workspaces of their own), and clears nothing itself.
    """
    torch._C._cuda_clearCublasWorkspaces()
    try:
        return call()
    finally:
        torch._C._cuda_clearCublasWorkspaces()


def grad_context(workload: workloads.Workload) -> AbstractContextManager[Any]:
    return torch.no_grad() if workload.no_grad else nullcontext()


def wanted(name: str, args: argparse.Namespace) -> bool:
    """Whether the variant ``name`` is to be timed, by ``--variants`` and ``--no-compile``."""
    if args.variants and name not in args.variants.split(","):
        return False
    return not (args.no_compile and name == "compile")


def build(
    workload: workloads.Workload, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, str]]:
    """Build the variants, run each a few times (warm-up, capture); return them and the skips."""
    calls: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, make in workload.variants.items():
        if not wanted(name, args):
            continue
        try:
            call = bracketed(make)
            for _ in range(5):  # past any warm-up, capture or compilation
                bracketed(call)
            sync()
        except Exception as err:  # a tool that cannot run this workload
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            traceback.print_exc(limit=2, file=sys.stderr)
            continue
        calls[name] = call
    return calls, skipped


def measure(workload: workloads.Workload, args: argparse.Namespace) -> dict[str, Any]:
    with grad_context(workload):
        calls, skipped = build(workload, args)
        per_call = max(1e-6, time_calls(calls["eager"], 20) / 1e6)
        n = max(20, min(args.calls, int(args.seconds / per_call)))
        n = max(n, int(workload.seconds / per_call))  # a workload's least seconds per timing
        times: dict[str, list[float]] = {name: [] for name in calls}
        cpu: dict[str, list[float]] = {name: [] for name in calls}
        names = list(calls)
        bursts = max(args.bursts, n // 16)
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                times[name].append(time_calls(calls[name], n))
            for name, us in time_cpu(calls, bursts).items():
                cpu[name].append(us)
    del calls
    gc.collect()
    return {
        "workload": workload.name,
        "description": workload.description,
        "calls_per_timing": n,
        "median_us": {name: statistics.median(t) for name, t in times.items()},
        "median_cpu_us": {name: statistics.median(t) for name, t in cpu.items()},
        "all_us": times,
        "all_cpu_us": cpu,
        "skipped": skipped,
        # A variant taking turns between modes or shapes -> its steady variants (g, h).
        "steady": {name: list(steady) for name, steady in workload.steady.items()},
    }


def one_capture(make: Callable[[], Any]) -> dict[str, Any]:
    """One wrapper's build, warm-up, capture and first replay: time and GPU memory."""
    gc.collect()
    # cudagraph_td frees cuBLAS's workspaces around a capture (see its backend): free
    # them first, so that neither wrapper is credited with memory that it freed.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    sync()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    try:
        call = bracketed(make)
        for _ in range(3):  # warmup=2: a warm-up, the capture, the first replay
            bracketed(call)
        sync()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err)[:160]}"}
    cost = {
        "ms": (time.perf_counter() - start) * 1e3,
        "allocated_mib": (torch.cuda.memory_allocated() - allocated) / 2**20,
        "reserved_mib": (torch.cuda.memory_reserved() - reserved) / 2**20,
    }
    del call
    return cost


def capture_cost(workload: workloads.Workload, rounds: int = 3) -> dict[str, Any]:
    """Time and GPU memory from construction to the first replay, per wrapper: the median of
    ``rounds`` builds, the wrappers taking turns in a rotating order, so that a one-off cost
    of the process (the first capture after other work freed its graphs) is no one's."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workload.captures}
    errors: dict[str, dict[str, Any]] = {}
    names = list(workload.captures)
    with grad_context(workload):
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name in errors:
                    continue
                cost = one_capture(workload.captures[name])
                if "error" in cost:
                    errors[name] = cost
                else:
                    runs[name].append(cost)
    costs: dict[str, Any] = {}
    for name in names:
        if name in errors:
            costs[name] = errors[name]
            continue
        ms = [run["ms"] for run in runs[name]]
        costs[name] = {
            key: statistics.median(run[key] for run in runs[name])
            for key in ("ms", "allocated_mib", "reserved_mib")
        }
        costs[name]["all_ms"] = ms
    return {"workload": workload.name, "capture": costs}


def cpu_fallback(args: argparse.Namespace) -> None:
    print(
        "CUDA graphs need CUDA, which this machine lacks: timing the eager function against "
        "the wrappers' eager fallbacks (no graph is captured)."
    )
    x = torch.randn(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each wrapper's warning says what this script said
        variants = {
            "eager": lambda t: t + 1,
            "cudagraph_td": cudagraph_td.CudaGraphModule(lambda t: t + 1),
            "tensordict": tensordict.nn.CudaGraphModule(lambda t: t + 1),
        }
    for name, fn in variants.items():
        us = statistics.median(
            time_calls(lambda fn=fn: fn(x), args.calls) for _ in range(args.repeats)
        )
        print(f"  {name:13} {us:8.2f} us/call  (tiny op, eager fallback)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the results")
    parser.add_argument("--name", default="results", help="file name of the results, no suffix")
    parser.add_argument("--repeats", type=int, default=7, help="rounds of timings")
    parser.add_argument("--calls", type=int, default=2000, help="most calls per timing")
    parser.add_argument("--seconds", type=float, default=0.05, help="target seconds per timing")
    parser.add_argument(
        "--bursts", type=int, default=25, help="least bursts of 16 calls per variant and round"
    )
    parser.add_argument("--workloads", default="", help="comma-separated name prefixes (a,b,...)")
    parser.add_argument("--variants", default="", help="comma-separated variants (default all)")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument(
        "--baseline", default="", help="folder of an earlier version (scripts/make_baseline.sh)"
    )
    args = parser.parse_args()
    if args.baseline:
        sys.path.insert(0, str(pathlib.Path(args.baseline).resolve()))
        workloads.BASELINE = importlib.import_module("cudagraph_td_baseline")
    faulthandler.enable()  # a crash inside a tool prints where it happened
    if not torch.cuda.is_available():
        cpu_fallback(args)
        return
    device = torch.device("cuda")
    chosen = tuple(p.strip() for p in args.workloads.split(",") if p.strip())
    results, captures = [], []
    for workload in workloads.all_workloads(device):
        if chosen and not workload.name.startswith(chosen):
            continue
        print(f"== {workload.name}", flush=True)
        results.append(measure(workload, args))
        # Kept as it goes: a run stopped by a time limit keeps the workloads it finished.
        _write(args, results, captures)
        captures.append(capture_cost(workload))
        print(report.table([results[-1]], "wall"), report.table([results[-1]], "CPU"), sep="\n\n")
        if results[-1]["steady"]:
            print(report.steady_table([results[-1]], "CPU"), flush=True)
        if workloads.BASELINE is not None:
            print(report.before_table([results[-1]], "CPU"), flush=True)
    data = _write(args, results, captures)
    print(report.markdown(data))
    print(report.chart(data, pathlib.Path(args.out) / f"{args.name}.png"))


def _write(
    args: argparse.Namespace, results: list[dict[str, Any]], captures: list[dict[str, Any]]
) -> dict[str, Any]:
    """The results so far, as ``<out>/<name>.json`` and its Markdown report."""
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "cudagraph_td": cudagraph_td.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join(sys.argv),
        "baseline": getattr(workloads.BASELINE, "REVISION", None),
        "repeats": args.repeats,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "results": results, "capture": captures}
    (out / f"{args.name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{args.name}.md").write_text(report.markdown(data))
    return data


if __name__ == "__main__":
    main()
