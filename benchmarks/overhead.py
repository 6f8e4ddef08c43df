"""Where the CPU time of one replay goes: the wrapper's path, step by step, against the floor.

    python benchmarks/overhead.py [a] [d] [e]

On CUDA, for workloads (a) of the benchmark (``x + 1`` on 16 elements), (d) (a whole SAC
update on a TensorDict batch) and (e) (an MLP's graphed forward and backward): the time to
issue a hand-written replay (the floor; torch's ``make_graphed_callables`` for (e)),
``CudaGraphModule``'s call, tensordict's, and each step of their paths on its own. Times
are CPU microseconds per call (see ``run.time_cpu``), the minimum over rounds.
"""

from __future__ import annotations

import copy
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import CudaGraphModule as TDCudaGraphModule
from tensordict.nn.probabilistic import interaction_type

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "src"))

import workloads
from run import time_cpu

import cudagraph_td
from cudagraph_td._call import replay as _replay
from cudagraph_td._values.signature import metadata

Steps = dict[str, Callable[[], Any]]


def best(call: Callable[[], Any], calls: int = 4000, rounds: int = 9) -> float:
    return min(time_cpu({"call": call}, max(1, calls // 16))["call"] for _ in range(rounds))


def tiny_op() -> Steps:
    x = torch.randn(16, device="cuda")
    wrapper = cudagraph_td.CudaGraphModule(lambda t: t + 1, warmup=2)
    theirs = TDCudaGraphModule(lambda t: t + 1, warmup=2)
    for _ in range(3):
        wrapper(x)
        theirs(x)
    runner = wrapper._current_runner()
    captured = runner.captured
    static_in, static_out = captured.signature.static_inputs, captured.outputs.static[0]
    graph = captured.graph
    replay = runner.replay
    base_replay = super(torch.cuda.CUDAGraph, graph).replay
    (route,) = _replay.default_routes(captured)
    reader, writer = route

    def floor() -> torch.Tensor:
        torch._foreach_copy_(static_in, [x])
        graph.replay()
        return static_out.clone()

    def fresh_by_copy() -> torch.Tensor:
        out = torch.empty_like(static_out)
        torch._foreach_copy_([out], [static_out])
        return out

    return {
        "floor: copy, replay, clone": floor,
        "CudaGraphModule call": lambda: wrapper(x),
        "tensordict's CudaGraphModule call": lambda: theirs(x),
        "its replay function, called directly": lambda: replay((x,), {}),
        "  mode: interaction_type()": interaction_type,
        "  mode: torch.is_grad_enabled()": torch.is_grad_enabled,
        "  reader (positional)": lambda: reader.read((x,), {}),
        "  input check: metadata(x) == expected": lambda: metadata(x) == metadata(static_in[0]),
        "  launch (copy, replay, clone)": lambda: captured.launch([x]),
        "  writer (the one tensor)": lambda: writer.write((x,), (x,)),
        "    of which x.device": lambda: x.device,
        "    x.get_device(), for comparison": x.get_device,
        "  torch._foreach_copy_": lambda: torch._foreach_copy_(static_in, [x]),
        "  copy_": lambda: static_in[0].copy_(x),
        "  graph.replay()": graph.replay,
        "  the C++ replay, without CUDAGraph.replay's Python frame": base_replay,
        "  clone()": static_out.clone,
        "  empty_like() and _foreach_copy_": fresh_by_copy,
        "  an empty Python call": lambda: None,
    }


def sac_update() -> Steps:
    device = torch.device("cuda")
    workload = workloads.sac_update(device)
    floor = workload.variants["floor"]()
    theirs = workload.variants["tensordict"]()
    sac = workloads._sac_module()
    batch = sac.batches(1, device)[0]
    wrapper = cudagraph_td.CudaGraphModule(sac.SAC(device).update, warmup=2)
    for _ in range(3):
        wrapper(batch)
        theirs()
    captured = wrapper._current_runner().captured
    signature, outputs, watch = captured.signature, captured.outputs, captured._watch
    (route,) = _replay.default_routes(captured)
    reader = route[0]
    assert watch is not None and isinstance(reader, _replay.TensorDictEntries)
    tensors = signature.match((batch,), {})
    fresh = outputs.copies.make()
    keys = list(batch.keys())
    out_keys = [f"k{i}" for i in range(len(fresh))]
    return {
        "floor: read, copy, replay, clone, TensorDict": floor,
        "CudaGraphModule call": lambda: wrapper(batch),
        "tensordict's CudaGraphModule call": theirs,
        "  reader: the batch read by key": lambda: reader.read((batch,), {}),
        "  input check: one metadata comparison": lambda: (
            list(map(metadata, tensors)) == signature.expected
        ),
        "  the full check, for comparison: signature.match": lambda: signature.match((batch,), {}),
        "    of which optree.tree_flatten": lambda: cudagraph_td._values.tree.optree.tree_flatten(
            ((batch,), {}), namespace=cudagraph_td._values.tree.NAMESPACE
        ),
        "  training-step watch": watch,
        "  torch._foreach_copy_ of the inputs": lambda: torch._foreach_copy_(
            signature.static_inputs, tensors
        ),
        "  graph.replay()": captured.graph.replay,
        "  fresh outputs (one buffer, views, _foreach_copy_)": outputs.copies.make,
        "    of which the views": lambda: cudagraph_td._values.outputs._views(
            torch.empty(len(fresh), device=device), outputs.copies._groups[0][3]
        ),
        "  the result rebuilt (optree.tree_unflatten)": lambda: outputs.rebuild(fresh),
        "  floor: batch[k] for each key": lambda: [batch[k] for k in keys],
        "  floor: clone() per output": lambda: [t.clone() for t in outputs.static],
        "  floor: TensorDict of the outputs": lambda: TensorDict(
            dict(zip(out_keys, fresh, strict=True)), batch_size=[]
        ),
    }


def forward_backward() -> Steps:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    ).cuda()
    x = torch.randn(128, 64, device="cuda")
    theirs = torch.cuda.make_graphed_callables(copy.deepcopy(net), (x.clone(),))
    ours = cudagraph_td.make_graphed_callables(copy.deepcopy(net), (x.clone(),))

    def train(model: Any) -> Callable[[], None]:
        def step() -> None:
            model(x).sum().backward()

        return step

    return {
        "floor (torch's): forward": lambda: theirs(x),
        "cudagraph_td: forward": lambda: ours(x),
        "floor (torch's): forward, backward": train(theirs),
        "cudagraph_td: forward, backward": train(ours),
    }


PROFILES = {"a": tiny_op, "d": sac_update, "e": forward_backward}


def main() -> None:
    if not torch.cuda.is_available():
        print("CUDA graphs need CUDA, which this machine lacks: nothing to profile.")
        return
    chosen = sys.argv[1:] or list(PROFILES)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    for name in chosen:
        print(f"\n({name})")
        with torch.no_grad() if name == "a" else torch.enable_grad():
            calls = 400 if name == "e" else 4000  # (e) costs about 1 ms a call
            for step, call in PROFILES[name]().items():
                print(f"{step:66} {best(call, calls):7.2f} us")


if __name__ == "__main__":
    main()
