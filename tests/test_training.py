"""How a captured training step finds the optimizers and parameters that it depends on."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cudagraph_td import RecaptureWarning
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


# Host state that a captured step bakes in, changed after the capture: `requires_grad` flags
# (a layer frozen or unfrozen) and the optimizer's parameter groups (`add_param_group`).


def _mlp(backend: Backend) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)


def _adam(backend: Backend, params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=torch.tensor(1e-2, device=backend.device), capturable=True)


def _training_step(
    net: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        loss = (net(x) - y).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _assert_same_training(net: nn.Module, twin: nn.Module, opt: Any, twin_opt: Any) -> None:
    """Parameters, their ``.grad`` (``None`` where eager's is) and optimizer state as eager's."""
    for (name, p), q in zip(net.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert len(opt.state) == len(twin_opt.state)
    for state, twin_state in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        for key in state:
            torch.testing.assert_close(state[key], twin_state[key])


def _changed_after_three_calls(
    backend: Backend,
    net: nn.Module,
    stepped: Callable[[nn.Module], Any],
    change: Callable[[nn.Module, torch.optim.Optimizer], None],
    named: str,
    set_to_none: bool = True,
) -> torch.optim.Optimizer:
    """A captured step of ``net`` and its eager twin (a deep copy of ``net`` made before the
    first call), each with an Adam of its own on the ``stepped(net)`` parameters, called on the
    same inputs; ``change`` applied to both after three calls. Returns the step's optimizer.
    (Not a deep copy of the optimizer: torch's `Optimizer.__getstate__` drops
    the flag that keeps a capturable optimizer's eager steps from warning on CUDA.)"""
    twin_net = copy.deepcopy(net)
    opt, twin_opt = _adam(backend, stepped(net)), _adam(backend, stepped(twin_net))
    graphed = backend.wrap(_training_step(net, opt, set_to_none), warmup=2)
    twin = _training_step(twin_net, twin_opt, set_to_none)
    for i in range(9):
        x, y = backend.randn(16, 4), backend.randn(16, 1)
        if i == 3:
            change(net, opt)
            change(twin_net, twin_opt)
            with pytest.warns(RecaptureWarning, match=re.escape(named)):
                loss = graphed(x, y)
        else:
            loss = graphed(x, y)
        torch.testing.assert_close(loss, twin(x, y), msg=f"call {i}")
        _assert_same_training(net, twin_net, opt, twin_opt)
    assert graphed.is_captured
    return opt


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_a_layer_frozen_after_the_capture_trains_as_in_eager(
    backend: Backend, set_to_none: bool
) -> None:
    net = _mlp(backend)
    frozen: dict[str, torch.Tensor] = {}

    def freeze(model: nn.Module, _: Any) -> None:
        model[0].requires_grad_(False)
        frozen.setdefault("weight", model[0].weight.detach().clone())

    _changed_after_three_calls(
        backend,
        net,
        nn.Module.parameters,
        freeze,
        "`net[0].weight.requires_grad (set to False)`",
        set_to_none,
    )
    if set_to_none:  # no gradient: Adam leaves the layer alone, as in eager mode
        assert net[0].weight.grad is None
        torch.testing.assert_close(net[0].weight, frozen["weight"], rtol=0, atol=0)


def test_a_layer_unfrozen_after_the_capture_trains_from_then_on(backend: Backend) -> None:
    net = _mlp(backend)
    net[0].requires_grad_(False)
    before = net[0].weight.detach().clone()

    def unfreeze(model: nn.Module, _: Any) -> None:
        model[0].requires_grad_(True)

    _changed_after_three_calls(
        backend, net, nn.Module.parameters, unfreeze, "`net[0].weight.requires_grad (set to True)`"
    )
    assert not torch.equal(net[0].weight, before)


def test_a_parameter_group_added_after_the_capture_is_stepped(backend: Backend) -> None:
    net = _mlp(backend)

    def add_group(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.add_param_group({"params": list(model[0].parameters())})

    opt = _changed_after_three_calls(
        backend,
        net,
        lambda model: model[2].parameters(),
        add_group,
        "`opt.param_groups (a group added or removed)`",
    )
    assert all(p in opt.state for p in net[0].parameters())


@pytest.mark.parametrize("layers", [[0], [0, 2]], ids=["one-layer", "all-layers"])
def test_a_policy_called_in_grad_mode_follows_requires_grad(
    backend: Backend, layers: list[int]
) -> None:
    # Layers frozen at the capture (every layer: a plain graph, not a differentiable one),
    # unfrozen after three calls, frozen again after six. Unfrozen, they need gradients the
    # graph never computed: a new capture. Frozen again, they need none: autograd drops
    # their gradients, as in eager mode (any other RecaptureWarning is an error here).
    net = _mlp(backend)
    for layer in layers:
        net[layer].requires_grad_(False)
    twin = copy.deepcopy(net)
    graphed = backend.wrap(net, warmup=2)
    for i in range(10):
        if i in (3, 6):
            for model in (net, twin):
                for layer in layers:
                    model[layer].requires_grad_(i == 3)
        x = backend.randn(8, 4)
        for model in (net, twin):
            model.zero_grad(set_to_none=True)
        if i == 3:
            with pytest.warns(RecaptureWarning, match=re.escape("`module[0].weight.requires_grad")):
                out = graphed(x)
        else:
            out = graphed(x)
        expected = twin(x)
        torch.testing.assert_close(out, expected)
        assert out.requires_grad == expected.requires_grad, f"call {i}"
        if expected.requires_grad:
            out.square().sum().backward()
            expected.square().sum().backward()
        for p, q in zip(net.parameters(), twin.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"call {i}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad)
        # No autograd graph of this call alive at the next: on CUDA, a recapture's warm-up
        # (on the library's side stream) would reuse the parameters' AccumulateGrad nodes
        # made on this stream, and torch warns of the mismatch at its backward.
        del out, expected
