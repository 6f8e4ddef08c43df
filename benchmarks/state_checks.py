"""What the checks of the state around a graph cost per call, part by part (CPU time).

Each replay checks, besides its inputs: the calling thread, the autocast state, and the
parameters and buffers that the graph reads (see ``src/cudagraph_td/_state/state.py``). This times
each part alone with ``timeit`` on this host, for the policy of the benchmark's workload c
and for a larger network, beside a whole replay of that policy, so that the share of each
check can be read off. Then, for functions that find their models and optimizers through
attributes and closures, ``State.fresh`` with and without the bindings where those were
found. Run on the GPU machine: ``python benchmarks/state_checks.py`` (on a CPU, the
emulation's graphs).
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
import threading
import timeit
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule, capturable_on_cpu
from cudagraph_td._state.state import State


def _us(fn: Any, number: int = 20_000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def _state_of(graphed: CudaGraphModule) -> Any:
    """The State that the graph of ``graphed`` in the current mode follows."""
    graphs = graphed._current_graphs()
    return graphs.entries[graphs.key].captured.state


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
            state = _state_of(policy)
            tensors = len(state.followed)
            parts = {
                "thread (threading.get_ident)": threading.get_ident,
                "autocast (torch._C._is_any_autocast_enabled)": torch._C._is_any_autocast_enabled,
                f"parameters and buffers ({tensors} tensors: State.fresh)": state.fresh,
                "whole replay (policy(td))": functools.partial(policy, td),
            }
            c_check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
            if c_check is not None:  # torch's one C call over the addresses (CUDA builds)
                holders = [e[1] for e in state.followed]
                keys = [e[2] for e in state.followed]
                ptrs = [e[4] for e in state.followed]
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


class _Agent:
    def __init__(self, device: str) -> None:
        self.net = _policy(device, 64, 2)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-3, capturable=True)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad()
        loss = self.net(x).square().mean()
        loss.backward()
        self.opt.step()
        return loss.detach()


def _sac_like(device: str) -> Any:
    """An update that reads five networks and two optimizers from its closure."""
    actor, q1, q2 = _policy(device, 64, 2), _policy(device, 64, 2), _policy(device, 64, 2)
    t1, t2 = (copy.deepcopy(q).requires_grad_(False) for q in (q1, q2))
    actor_opt = torch.optim.Adam(actor.parameters(), lr=1e-3, capturable=True)
    q_opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=1e-3, capturable=True)

    def update(x: torch.Tensor) -> torch.Tensor:
        q_opt.zero_grad()
        with torch.no_grad():
            target = t1(x) + t2(x)
        q_loss = (q1(x) - target).square().mean() + (q2(x) - target).square().mean()
        q_loss.backward()
        q_opt.step()
        actor_opt.zero_grad()
        actor_loss = -q1(actor(x)[:, :4].repeat(1, 4)).mean()
        actor_loss.backward()
        actor_opt.step()
        return q_loss.detach() + actor_loss.detach()

    return update


def bindings(device: str, backend: str) -> None:
    """``State.fresh`` with the bindings where the models and optimizers were found, and
    the same State without them."""
    agent = _Agent(device)
    cases = {
        "policy: lambda x, a=agent: a.net(x), no_grad": (lambda x, a=agent: a.net(x), False),
        "training step: agent.step (self.net, self.opt)": (agent.step, True),
        "SAC-like update: 5 networks, 2 optimizers (closure)": (_sac_like(device), True),
    }
    print("\nbindings of the models and optimizers (State.fresh):")
    for name, (fn, grad) in cases.items():
        graphed = CudaGraphModule(fn, backend=backend)  # type: ignore[arg-type]
        x = torch.randn(32, 16, device=device)
        with torch.set_grad_enabled(grad), capturable_on_cpu():
            for _ in range(5):
                graphed(x)
            state = _state_of(graphed)
        unbound = State([e[:4] for e in state.followed], identity=state.identity)
        with_them, without = _us(state.fresh), _us(unbound.fresh)
        print(
            f"  {name:52s} {with_them:6.3f} us, {without:6.3f} us without its "
            f"{len(state.bindings)} bindings ({', '.join(b[0] for b in state.bindings)})"
        )


def _address_checks(
    tensors: dict[str, torch.Tensor], net: nn.Module, helper: Any
) -> tuple[Any, Any]:
    """The library's list form of the address check, and the same with torch's helper."""
    getitem, data_ptr = operator.getitem, torch.Tensor.data_ptr
    chain, values = itertools.chain.from_iterable, dict.values
    children, modules = [net._modules], [*net._modules.values()]
    holders, keys = [tensors] * len(tensors), [*tensors]
    addresses = [t.data_ptr() for t in tensors.values()]
    expected, indices = [*addresses, *modules], [*range(len(tensors))]

    def listed() -> bool:
        held = map(data_ptr, map(getitem, holders, keys))
        return [*held, *chain(map(values, children))] == expected

    def native() -> bool:
        held = [*map(getitem, holders, keys)]
        same = helper(held, addresses, indices)
        return bool(same) and [*chain(map(values, children))] == modules

    return listed, native


def address_forms(device: str) -> None:
    """The state check's comparison of addresses, as the library makes it (one list of the
    addresses and the children's modules, mapped in C), beside torch's C++ helper
    ``torch._C._tensors_data_ptrs_at_indices_equal`` (CUDA builds) with the children
    compared after it, for 1 to 64 tensors."""
    helper = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    print("\naddresses compared (the library's list form; torch's C++ helper):")
    for n in (1, 2, 4, 8, 16, 32, 64):
        tensors = {f"t{i}": torch.zeros(4, device=device) for i in range(n)}
        listed, native = _address_checks(tensors, net, helper)
        assert listed() and (helper is None or native())
        line = f"  {n:3d} tensors: {_us(listed):6.3f} us"
        if helper is not None:
            line += f", {_us(native):6.3f} us with the C++ helper"
        print(line)


if __name__ == "__main__":
    main()
    address_forms("cuda" if torch.cuda.is_available() else "cpu")
    bindings(
        "cuda" if torch.cuda.is_available() else "cpu",
        "cuda" if torch.cuda.is_available() else "emulate",
    )
