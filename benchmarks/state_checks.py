"""What the checks of the state around a graph cost per call, part by part (CPU time).

Each replay checks, besides its inputs: the calling thread, the autocast state, and the
parameters and buffers that the graph reads (see ``src/cudagraph_td/_state.py``). This times
each part alone with ``timeit`` on this host, for the policy of the benchmark's workload c
and for a larger network, beside a whole replay of that policy, so that the share of each
check can be read off. Run on the GPU machine: ``python benchmarks/state_checks.py``.
"""

from __future__ import annotations

import functools
import operator
import threading
import timeit
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule


def _us(fn: Any, number: int = 20_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def _policy(device: str, width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4)).to(device)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "cuda" if device == "cuda" else "emulate"
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
    )
    for depth in (2, 8):
        net = _policy(device, 64, depth)
        policy = CudaGraphModule(
            TensorDictModule(net, in_keys=["obs"], out_keys=["act"]), backend=backend
        )
        td = TensorDict(obs=torch.randn(32, 16, device=device), batch_size=[32])
        with torch.no_grad():
            for _ in range(5):
                policy(td)
            state = policy._current_runner().captured.state
            tensors = len(state.entries)
            parts = {
                "thread (threading.get_ident)": threading.get_ident,
                "autocast (torch._C._is_any_autocast_enabled)": torch._C._is_any_autocast_enabled,
                f"parameters and buffers ({tensors} tensors: State.fresh)": state.fresh,
                "whole replay (policy(td))": functools.partial(policy, td),
            }
            c_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
            if c_check is not None:  # torch's one C call over the addresses (CUDA builds)
                holders = [e[1] for e in state.entries]
                keys = [e[2] for e in state.entries]
                ptrs = [e[4] for e in state.entries]
                indices = list(range(len(ptrs)))
                parts["  the same, with torch._C._tensors_data_ptrs_at_indices_equal"] = (
                    lambda: c_check(list(map(operator.getitem, holders, keys)), ptrs, indices)  # noqa: B023
                )
            times = {name: _us(fn) for name, fn in parts.items()}
        if device == "cuda":
            torch.cuda.synchronize()
        whole = times["whole replay (policy(td))"]
        print(f"\npolicy, {depth + 1} linear layers:")
        for name, us in times.items():
            print(f"  {name:58s} {us:7.3f} us  ({us / whole:6.1%} of a replay)")


if __name__ == "__main__":
    main()
