"""The Python work of one replay, counted: bytecodes and frames of the library, per call.

A timing on a GPU host moves by a few hundredths of the floor from round to round; this
count does not move at all. It runs the replay path of the benchmark's policy calls on the
CPU emulation (the emulation's own frames left out: they stand for the graph's launch) and
counts, with ``sys.settrace``, the opcodes executed in the library's frames and the frames
entered. With ``--baseline DIR`` (``scripts/make_baseline.sh``), the version before too.

    python benchmarks/python_work.py --baseline benchmarks/baseline
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule


def count(run: Callable[[], Any], package: str) -> tuple[int, int]:
    """The opcodes run in ``package``'s frames (not its emulation's) by ``run()``, and the
    frames entered."""
    opcodes, frames = 0, 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal opcodes
        if event == "opcode":
            opcodes += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal frames
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(package + ".") or "._emulation." in module:
            return None
        frames += 1
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(None)
    return opcodes, frames


def calls(library: ModuleType) -> dict[str, Callable[[], Any]]:
    """The replay path's calls of the benchmark's kinds, each captured already."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    wrap = library.CudaGraphModule  # type: ignore[attr-defined]
    policy = wrap(TensorDictModule(net, ["obs"], ["action"]), backend="emulate")
    function = wrap(torch.nn.Linear(4, 2), backend="emulate")
    grad = wrap(torch.nn.Linear(4, 2), backend="emulate")
    x, td = torch.randn(3, 4), TensorDict(obs=torch.randn(3, 4), batch_size=[3])
    keywords = wrap(TensorDictModule(torch.nn.Linear(4, 2), ["obs"], ["action"]), backend="emulate")
    # Borrowed outputs, called with the wrapper's own input buffers (in place), by keywords.
    lent = wrap(
        TensorDictModule(torch.nn.Linear(4, 2), ["obs"], ["action"]),
        backend="emulate",
        outputs="borrowed",
    )
    lent_td = wrap(
        TensorDictModule(torch.nn.Linear(4, 2), ["obs"], ["action"]),
        backend="emulate",
        outputs="borrowed",
    )
    # Buckets of rows (f): a call of 3 rows replays the 4-row graph on its first rows.
    buckets = wrap(
        TensorDictModule(torch.nn.Linear(4, 2), ["obs"], ["action"]),
        backend="emulate",
        shapes=library.Buckets([4, 8]),  # type: ignore[attr-defined]
    )
    # Exact shapes (f exact): a graph per batch size.
    exact = wrap(
        TensorDictModule(torch.nn.Linear(4, 2), ["obs"], ["action"]),
        backend="emulate",
        shapes=library.Exact(max_graphs=64),  # type: ignore[attr-defined]
    )
    found = {
        "a. a function of one tensor": (lambda: function(x), False),
        "c. a policy, module(td)": (lambda: policy(td), False),
        "c. a policy, module(obs=...)": (lambda: keywords(obs=x), False),
        "c. a function, grad mode": (lambda: grad(x), True),
        "c. borrowed, in place": (lambda: lent(obs=x), False),
        "c. borrowed, in place, (td)": (lambda: lent_td(td), False),
        "f. buckets, 3 rows of 4": (lambda: buckets(td), False),
        "f. exact shapes": (lambda: exact(td), False),
    }
    ready = {}
    for name, (call, grad_mode) in found.items():

        def run(call: Callable[[], Any] = call, grad_mode: bool = grad_mode) -> Any:
            with torch.set_grad_enabled(grad_mode):
                return call()

        for _ in range(3):  # a warm-up, the capture, a replay
            run()
        ready[name] = run
    with torch.no_grad():
        args, kwargs = lent.input_buffers(obs=x)
        td_args, td_kwargs = lent_td.input_buffers(td)
    ready["c. borrowed, in place"] = lambda: _no_grad(lent, args, kwargs)
    ready["c. borrowed, in place, (td)"] = lambda: _no_grad(lent_td, td_args, td_kwargs)
    return ready


def _no_grad(module: Any, args: Any, kwargs: Any) -> Any:
    with torch.no_grad():
        return module(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="folder of an earlier version")
    args = parser.parse_args()
    libraries = {"now": importlib.import_module("cudagraph_td")}
    if args.baseline:
        sys.path.insert(0, args.baseline)
        libraries["before"] = importlib.import_module("cudagraph_td_baseline")
    # Each counted twice, the second count kept: on Python 3.12, the first traced call of a
    # process counted no opcodes (the tracer's opcode events start lazily).
    counted = {
        version: {
            name: [count(call, library.__name__) for _ in range(2)][-1]
            for name, call in calls(library).items()
        }
        for version, library in libraries.items()
    }
    print(f"{'call':32s}" + "".join(f"{v + ' opcodes':>16s}{v + ' frames':>14s}" for v in counted))
    for name in counted["now"]:
        cells = "".join(f"{counted[v][name][0]:16d}{counted[v][name][1]:14d}" for v in counted)
        print(f"{name:32s}{cells}")


if __name__ == "__main__":
    main()
