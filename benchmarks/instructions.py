"""The machine instructions of one replay, counted: the library against the version before.

A timing on a GPU host moves by a few hundredths of the floor from round to round, and
`python_work.py` counts the library's Python opcodes only. This counts every instruction a
replay runs (the library's, Python's, tensordict's, torch's) with valgrind's callgrind, on
the CPU emulation with its graph's replay made a no-op (what is left is the wrapper's own
work, the input copy, the output's clone), in one thread, with a fixed hash seed: the same
count at every run. A call's count is the difference between a run of ``--calls`` more
calls and a run of ``--base`` calls, over ``--calls``.

What it cannot settle: differences of a few percent. A version's count is stable for one
setup (two runs: 900 instructions apart in 10 billion), but two harnesses that make the same
calls after another setup (other objects made first, another history of the allocator)
gave, now against the version before, -408 and -4,643 instructions a call for
``module(td)``, and -267 and +1,104 for f's exact shapes. Read only differences well beyond
that, or the same sign over several setups.

    python benchmarks/instructions.py --baseline benchmarks/baseline --kinds td,exact,buckets

Kinds: ``a`` (a function of one tensor), ``td`` (a TensorDict policy, ``module(td)``),
``kw`` (the policy with a keyword tensor), ``exact`` and ``buckets`` (the policy with
``shapes=Exact`` or ``Buckets``, called in turn with 512 TensorDicts of 1 to 64 rows, as
the benchmark's workload f). Each run takes one to two minutes under valgrind.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

KINDS = ("a", "td", "kw", "exact", "buckets")


def _calls(library: Any, kind: str) -> Callable[[int], Any]:
    """A function of ``i`` that makes the ``i``-th call of ``kind``, every graph captured."""
    import torch
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)

    def policy(**options: Any) -> Any:
        module = TensorDictModule(net, ["obs"], ["action"])
        return library.CudaGraphModule(module, backend="emulate", **options)

    x, td = torch.randn(3, 4), TensorDict(obs=torch.randn(3, 4), batch_size=[3])
    if kind == "a":
        graphed = library.CudaGraphModule(net, backend="emulate")
        call: Callable[[int], Any] = lambda i: graphed(x)  # noqa: E731
    elif kind == "td":
        graphed = policy()
        call = lambda i: graphed(td)  # noqa: E731
    elif kind == "kw":
        graphed = policy()
        call = lambda i: graphed(obs=x)  # noqa: E731
    else:
        draw = random.Random(0)
        rows = [draw.randint(1, 64) for _ in range(512)]
        shapes = (
            library.Exact(max_graphs=64)
            if kind == "exact"
            else library.Buckets([1, 2, 4, 8, 16, 32, 64])
        )
        graphed = policy(shapes=shapes)
        batches = [TensorDict(obs=torch.randn(n, 4), batch_size=[n]) for n in rows]
        for n in range(1, 65):  # every size past its warm-up and capture
            for _ in range(3):
                graphed(TensorDict(obs=torch.randn(n, 4), batch_size=[n]))
        call = lambda i: graphed(batches[i % len(batches)])  # noqa: E731
    for i in range(3):  # a warm-up, the capture, a replay
        call(i)
    return call


def child(version: str, kind: str, calls: int, baseline: str) -> None:
    """The process that valgrind counts: ``calls`` replays of ``kind``."""
    import gc

    import torch

    torch.set_num_threads(1)
    if version == "before":
        sys.path.insert(0, baseline)
    name = "cudagraph_td_baseline" if version == "before" else "cudagraph_td"
    library = importlib.import_module(name)
    recording = importlib.import_module(f"{name}._emulation.recording")
    recording.RecordedGraph.replay = lambda self: None  # the graph's own work left out
    with torch.no_grad():
        call = _calls(library, kind)
        gc.disable()
        for i in range(calls):
            call(i)


def count(version: str, kind: str, calls: int, baseline: str) -> int:
    """The instructions of a run of ``calls`` replays, under callgrind."""
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        **{f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")},
    }
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--child",
        version,
        kind,
        str(calls),
        "--baseline",
        baseline,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    line = next(row for row in done.stderr.splitlines() if "Collected :" in row)
    return int(line.split(":")[-1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="folder of an earlier version")
    parser.add_argument("--kinds", default="td,exact,buckets", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--base", type=int, default=200, help="calls of the shorter run")
    parser.add_argument("--calls", type=int, default=2000, help="calls more in the longer run")
    parser.add_argument("--child", nargs=3, metavar=("VERSION", "KIND", "CALLS"))
    args = parser.parse_args()
    if args.child:
        version, kind, calls = args.child
        child(version, kind, int(calls), args.baseline)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: it counts the instructions")
    versions = ["now", "before"] if args.baseline else ["now"]
    print(f"{'kind':8s}" + "".join(f"{v + ' instructions':>22s}" for v in versions))
    for kind in args.kinds.split(","):
        per_call = []
        for version in versions:
            short = count(version, kind, args.base, args.baseline)
            long = count(version, kind, args.base + args.calls, args.baseline)
            per_call.append((long - short) / args.calls)
        print(f"{kind:8s}" + "".join(f"{n:22,.0f}" for n in per_call), flush=True)


if __name__ == "__main__":
    main()
