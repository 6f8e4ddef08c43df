"""Where the CPU time of one replay goes: the wrapper's path, step by step, against the floor.

    python benchmarks/overhead.py

Workload (a) of the benchmark (``x + 1`` on 16 elements), on CUDA: the time to issue a
hand-written replay (the floor), ``CudaGraphModule``'s call, its captured replay function
called directly (without the module's mode check), and each step of that path on its own.
Times are CPU microseconds per call (see ``run.time_cpu``), the minimum over rounds.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict.nn.probabilistic import interaction_type

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))

from run import time_cpu

import cudagraph_td


def best(call: Callable[[], Any], calls: int = 4000, rounds: int = 9) -> float:
    return min(time_cpu(call, calls) for _ in range(rounds))


def main() -> None:
    if not torch.cuda.is_available():
        print("CUDA graphs need CUDA, which this machine lacks: nothing to profile.")
        return
    torch.set_grad_enabled(False)
    x = torch.randn(16, device="cuda")
    wrapper = cudagraph_td.CudaGraphModule(lambda t: t + 1, warmup=2)
    for _ in range(3):
        wrapper(x)
    runner = wrapper._runner
    captured = runner.captured
    static_in, static_out = captured.signature.static_inputs, captured.outputs.static[0]
    graph = captured.graph
    replay = runner.replay

    def floor() -> torch.Tensor:
        torch._foreach_copy_(static_in, [x])
        graph.replay()
        return static_out.clone()

    steps: dict[str, Callable[[], Any]] = {
        "floor: copy, replay, clone": floor,
        "CudaGraphModule call": lambda: wrapper(x),
        "its replay function, called directly": lambda: replay((x,), {}),
        "  mode: interaction_type()": interaction_type,
        "  mode: torch.is_grad_enabled()": torch.is_grad_enabled,
        "  input check: (type, shape, dtype, get_device(), requires_grad)": lambda: (
            type(x),
            x.shape,
            x.dtype,
            x.get_device(),
            x.requires_grad,
        ),
        "  torch._foreach_copy_": lambda: torch._foreach_copy_(static_in, [x]),
        "  copy_": lambda: static_in[0].copy_(x),
        "  graph.replay()": graph.replay,
        "  clone()": static_out.clone,
        "  an empty Python call": lambda: None,
    }
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    for name, call in steps.items():
        print(f"{name:66} {best(call):7.2f} us")


if __name__ == "__main__":
    main()
