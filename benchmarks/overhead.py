"""Where the CPU time of one replay goes: the wrapper's path, step by step, against the floor.

    python benchmarks/overhead.py [a] [d] [e] [--emulate] [--calls N]

On CUDA, for workloads (a) of the benchmark (``x + 1`` on 16 elements), (d) (a whole SAC
update on a TensorDict batch) and (e) (an MLP's graphed forward and backward): the time to
issue a hand-written replay (the floor; torch's ``make_graphed_callables`` for (e)),
``CudaGraphModule``'s call, tensordict's, and each step of the library's replay path on
its own (the graph table's lookup, the path's reader, checks, launch and writer). Times
are CPU microseconds per call (see ``run.time_cpu``), the minimum over rounds.

With ``--emulate`` (and on a machine without CUDA), the same steps run on the CPU
emulation's graphs, without the floors and tensordict's class: their times say nothing of
a GPU's, but every step is still found and run (the test suite runs it so, so that this
script follows the library's internals).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import CudaGraphModule as TDCudaGraphModule

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "src"))

import workloads
from run import time_cpu

import cudagraph_td
from cudagraph_td._capture.entry import GraphEntry
from cudagraph_td._values.signature import metadata

Steps = dict[str, Callable[[], Any]]


def best(call: Callable[[], Any], calls: int, rounds: int) -> float:
    return min(time_cpu({"call": call}, max(1, calls // 16))["call"] for _ in range(rounds))


def _path(wrapper: cudagraph_td.CudaGraphModule) -> GraphEntry:
    """The entry of the wrapper's one graph (what a call in its mode replays)."""
    (entry,) = wrapper._table.entries()
    return entry


def tiny_op(device: torch.device, backend: str) -> Steps:
    x = torch.randn(16, device=device)
    wrapper = cudagraph_td.CudaGraphModule(lambda t: t + 1, warmup=2, backend=backend)
    for _ in range(3):
        wrapper(x)
    path = _path(wrapper)
    captured = path.captured
    static_in, static_out = captured.signature.static_inputs, captured.outputs.static[0]
    expected = captured.signature.expected[0]
    replay = captured._replay  # type: ignore[attr-defined]  # the library's graph launch

    def fresh_by_copy() -> torch.Tensor:
        out = torch.empty_like(static_out)
        torch._foreach_copy_([out], [static_out])
        return out

    steps: Steps = {"CudaGraphModule call": lambda: wrapper(x)}
    if backend == "cuda":
        graph = captured.graph  # type: ignore[attr-defined]
        theirs = TDCudaGraphModule(lambda t: t + 1, warmup=2)
        for _ in range(3):
            theirs(x)

        def floor() -> torch.Tensor:
            torch._foreach_copy_(static_in, [x])
            graph.replay()
            return static_out.clone()

        steps["floor: copy, replay, clone"] = floor
        steps["tensordict's CudaGraphModule call"] = lambda: theirs(x)
    steps |= {
        "  the graph table's lookup (mode, dict)": lambda: wrapper._table.find((x,), {}),
        "    of which the mode": wrapper._table._mode,
        "  the replay path": lambda: path.replay((x,), {}),
        "    input check: metadata(x) == expected": lambda: metadata(x) == expected,
        "    torch._foreach_copy_ of the input": lambda: torch._foreach_copy_(static_in, (x,)),
        "    copy_, for comparison": lambda: static_in[0].copy_(x),
        "    the graph's launch": replay,
        "    clone() of the output": static_out.clone,
        "    empty_like() and _foreach_copy_, for comparison": fresh_by_copy,
        "  an empty Python call": lambda: None,
    }
    return steps


def sac_update(device: torch.device, backend: str) -> Steps:
    sac = workloads._sac_module()
    batch = sac.batches(1, device)[0]
    wrapper = cudagraph_td.CudaGraphModule(sac.SAC(device).update, warmup=2, backend=backend)
    for _ in range(3):
        wrapper(batch)
    path = _path(wrapper)
    captured = path.captured
    read, write = path._by_position
    assert write is not None
    tensors = read((batch,), {})
    assert tensors is not None
    signature, state = captured.signature, captured.state
    fresh = captured.outputs.copies.make()
    keys = list(batch.keys())  # a TensorDict iterates over its rows, not its keys
    steps: Steps = {"CudaGraphModule call": lambda: wrapper(batch)}
    if backend == "cuda":
        workload = workloads.sac_update(device)
        steps["floor: read, copy, replay, clone, TensorDict"] = workload.variants["floor"]()
        steps["tensordict's CudaGraphModule call"] = workload.variants["tensordict"]()
    steps |= {
        "  the graph table's lookup (mode, dict)": lambda: wrapper._table.find((batch,), {}),
        "  the replay path": lambda: path.replay((batch,), {}),
        "    reader: the batch read by key": lambda: read((batch,), {}),
        "    input check: one metadata comparison": lambda: (
            list(map(metadata, tensors)) == signature.expected
        ),
        "    state check (parameters, optimizer state, bindings)": (
            state.fresh if state is not None else (lambda: True)
        ),
        "    launch: watch, copy, replay, fresh outputs": lambda: captured.launch(tensors),
        "      training-step watch (gradients, hyperparameters)": (
            captured._watch or (lambda: None)  # type: ignore[attr-defined]
        ),
        "      torch._foreach_copy_ of the inputs": lambda: torch._foreach_copy_(
            signature.static_inputs, tensors
        ),
        "      the graph's launch": captured._replay,  # type: ignore[attr-defined]
        "      fresh outputs (one buffer, one copy)": captured.outputs.copies.make,
        "    writer: the result TensorDict": lambda: write((batch,), {}, fresh),
        "  floor's parts: batch[k] for each key": lambda: [batch[k] for k in keys],
        "  floor's parts: clone() per output": lambda: [t.clone() for t in captured.outputs.static],
        "  floor's parts: a TensorDict of the outputs": lambda: TensorDict(
            {f"k{i}": t for i, t in enumerate(fresh)}, batch_size=[]
        ),
    }
    return steps


def forward_backward(device: torch.device, backend: str) -> Steps:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    ).to(device)
    x = torch.randn(128, 64, device=device)
    ours = cudagraph_td.make_graphed_callables(
        copy.deepcopy(net),
        (x.clone(),),
        backend=backend,  # type: ignore[arg-type]
    )

    def train(model: Any) -> Callable[[], None]:
        def step() -> None:
            model(x).sum().backward()

        return step

    steps: Steps = {}
    if backend == "cuda":
        theirs = torch.cuda.make_graphed_callables(copy.deepcopy(net), (x.clone(),))
        steps["floor (torch's): forward"] = lambda: theirs(x)
        steps["floor (torch's): forward, backward"] = train(theirs)
    steps["cudagraph_td: forward"] = lambda: ours(x)
    steps["cudagraph_td: forward, backward"] = train(ours)
    return steps


PROFILES = {"a": tiny_op, "d": sac_update, "e": forward_backward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="*", choices=[[], *PROFILES], default=[])
    parser.add_argument("--emulate", action="store_true", help="the CPU emulation's graphs")
    parser.add_argument("--calls", type=int, default=4000, help="calls per timing, (e): 1/10")
    parser.add_argument("--rounds", type=int, default=9, help="timings per step")
    args = parser.parse_args()
    emulate = args.emulate or not torch.cuda.is_available()
    device, backend = (
        (torch.device("cpu"), "emulate") if emulate else (torch.device("cuda"), "cuda")
    )
    where = "the CPU emulation" if emulate else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}, Python {sys.version.split()[0]}")
    # The emulation records capturable optimizers' CPU steps only inside this context.
    scope = cudagraph_td.capturable_on_cpu() if emulate else contextlib.nullcontext()
    with scope:
        for name in args.profiles or list(PROFILES):
            print(f"\n({name})")
            with torch.no_grad() if name == "a" else torch.enable_grad():
                calls = args.calls // 10 if name == "e" else args.calls  # (e): ~1 ms a call
                for step, call in PROFILES[name](device, backend).items():
                    print(f"{step:66} {best(call, calls, args.rounds):7.2f} us")


if __name__ == "__main__":
    main()
