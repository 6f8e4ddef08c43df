"""How a captured training step finds the optimizers and parameters that it depends on."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from cudagraph_td._state.search import Search, find_state

from .conftest import Backend

NET = nn.Linear(2, 2)
OPT = torch.optim.SGD(NET.parameters(), lr=0.1)


def _global_step(x: torch.Tensor) -> None:
    OPT.zero_grad()
    NET(x).sum().backward()
    OPT.step()


class Agent:
    def __init__(self) -> None:
        self.nets = {"actor": nn.Linear(2, 2)}
        self.opts = [torch.optim.Adam(self.nets["actor"].parameters())]

    def update(self, x: torch.Tensor) -> None:
        self.opts[0].step()


def _closure() -> tuple[Any, str, torch.optim.Optimizer, str, nn.Module]:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

    return step, "opt", opt, "net", net


def _method() -> tuple[Any, str, torch.optim.Optimizer, str, nn.Module]:
    agent = Agent()
    return agent.update, "self.opts[0]", agent.opts[0], "self.nets.actor", agent.nets["actor"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (_global_step, "OPT", OPT, "NET", NET), id="globals"),
        pytest.param(_closure, id="closure"),
        pytest.param(_method, id="method"),
        pytest.param(
            lambda: (functools.partial(_global_step), "OPT", OPT, "NET", NET), id="partial"
        ),
        pytest.param(  # functools.wraps, as torch.compile does
            lambda: (functools.wraps(_global_step)(lambda x: x), "OPT", OPT, "NET", NET),
            id="wrapped",
        ),
    ],
)
def test_find_state_names_what_the_function_reaches(make: Any) -> None:
    fn, opt_path, optimizer, module_path, module = make()
    optimizers, modules = find_state(fn)
    assert optimizers[opt_path] is optimizer
    assert modules[module_path] is module


@pytest.mark.parametrize(
    ("make", "paths"),
    [
        pytest.param(lambda: _global_step, {"NET", "OPT"}, id="globals"),
        pytest.param(lambda: _closure()[0], {"net", "opt"}, id="closure"),
        pytest.param(
            lambda: Agent().update,
            {"self.nets", "self.nets.actor", "self.opts", "self.opts[0]"},
            id="method",
        ),
        pytest.param(
            lambda: _default(Agent()),
            {"a.nets", "a.nets.actor", "a.opts", "a.opts[0]"},
            id="default",
        ),
        pytest.param(lambda: functools.partial(_global_step), {"NET", "OPT"}, id="partial"),
    ],
)
def test_bindings_name_where_the_modules_and_optimizers_are_found(
    make: Any, paths: set[str]
) -> None:
    search = Search(make())
    bindings = search.bindings([*search.modules.values(), *search.optimizers.values()])
    assert {path for path, *_ in bindings} == paths
    for _, holder, key, value in bindings:
        assert holder[key] is value


def _default(agent: Agent) -> Any:
    return lambda x, a=agent: a.update(x)


class Holder:
    """A plain object that holds a model, as an agent does."""


HOLDER = Holder()
HOLDER.NET = NET  # an attribute named as the global that holds the same module


def test_bindings_leave_out_references_on_no_way_to_the_module() -> None:
    net = nn.Linear(2, 2)
    agent = Holder()
    agent.net = net
    net.owner = agent  # a reference back up
    search = Search(lambda x, a=agent: a.net(x))
    assert [path for path, *_ in search.bindings([net])] == ["a.net"]

    def step(x: torch.Tensor) -> torch.Tensor:  # `net` and `agent` met at the same depth
        return agent.net(x) + net(x)

    search = Search(step)
    assert {path for path, *_ in search.bindings([net])} == {"net", "agent", "agent.net"}

    # `HOLDER.NET` names the global `NET`, which the function does not read.
    search = Search(lambda x: HOLDER.NET(x))
    assert {path for path, *_ in search.bindings([NET])} == {"HOLDER", "HOLDER.NET"}


def test_find_state_skips_data_and_stops() -> None:
    big = {"tensors": [torch.zeros(1)] * 100_000, "text": "x" * 10}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + big["tensors"][0]

    assert find_state(fn) == ({}, {})


def test_two_steps_on_the_same_parameters_that_drop_their_gradients_alternate(
    backend: Backend,
) -> None:
    # CrossQ's two updates (torchrl): each sets the gradients to None, then computes its own;
    # eager mode binds new gradient tensors each time, whichever step ran before.
    def agent() -> tuple[Any, Any, nn.Module]:
        torch.manual_seed(0)
        net = nn.Linear(3, 1).to(backend.device)
        lr = torch.tensor(0.1, device=backend.device)
        opt = torch.optim.Adam(net.parameters(), lr=lr, capturable=True)

        def step(loss_of: Any) -> Any:
            def run(x: torch.Tensor) -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = loss_of(net(x))
                loss.backward()
                opt.step()
                return loss.detach()

            return run

        return step(lambda y: y.pow(2).mean()), step(lambda y: y.abs().mean()), net

    square, absolute, net = agent()
    twin_square, twin_absolute, twin = agent()
    graphed = [backend.wrap(square, warmup=2), backend.wrap(absolute, warmup=2)]
    for i in range(12):
        x = backend.randn(8, 3)
        which = i % 2 if i < 6 else int(i % 3 == 0)
        torch.testing.assert_close(graphed[which](x), (twin_square, twin_absolute)[which](x))
        torch.testing.assert_close(net.weight.grad, twin.weight.grad)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)
