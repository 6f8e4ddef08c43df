"""Copies of a wrapper: ``copy.deepcopy`` and ``torch.save``/``torch.load`` give a new,
uncaptured wrapper of a copy of what it wraps, with the same options."""

from __future__ import annotations

import copy
import io
import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule, Exact

from .conftest import Backend


def _net(backend: Backend) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(backend.device)


def _captured(graphed: CudaGraphModule, *args: Any) -> None:
    for _ in range(3):  # warm-up, capture, replay (warmup=2)
        graphed(*args)
    assert graphed.is_captured


def _saved_and_loaded(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@torch.no_grad()
def test_deepcopy_of_a_captured_wrapper_is_a_new_wrapper_of_a_copy(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(net, shapes=Exact(max_graphs=3))
    x = backend.randn(4, 3)
    _captured(graphed, x)
    target = copy.deepcopy(graphed)
    assert type(target) is CudaGraphModule and target.module is not net
    assert not target.is_captured and target.counter == 0 and not target.graphs()
    assert "shapes=Exact(max_graphs=3)" in repr(target)
    for p, q in zip(net.parameters(), target.module.parameters(), strict=True):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()
    torch.nn.init.zeros_(target.module[2].bias)  # the copy's, not the original's
    target.module[2].bias.add_(1.0)
    for _ in range(3):
        x = backend.randn(4, 3)
        torch.testing.assert_close(graphed(x), net(x))
        torch.testing.assert_close(target(x), target.module(x))
    assert not torch.equal(target(x), graphed(x))
    assert target.is_captured and [i.replays for i in graphed.graphs()] == [5]


@torch.no_grad()
def test_target_network_soft_updated_in_place_tracks_its_eager_twin(backend: Backend) -> None:
    # LeanRL's pattern: the target is a deep copy of the policy, lerped towards it in place.
    net = _net(backend)
    policy = backend.wrap(net)
    target = copy.deepcopy(policy)
    twin, twin_target = copy.deepcopy(net), copy.deepcopy(net)
    for _ in range(6):
        for params in (list(net.parameters()), list(twin.parameters())):
            torch._foreach_add_(params, 0.01)  # a training step, the same for both
        torch._foreach_lerp_(list(target.module.parameters()), list(net.parameters()), 0.1)
        torch._foreach_lerp_(list(twin_target.parameters()), list(twin.parameters()), 0.1)
        x = backend.randn(4, 3)
        torch.testing.assert_close(policy(x), twin(x))
        torch.testing.assert_close(target(x), twin_target(x))
    assert policy.is_captured and target.is_captured


def _actor(backend: Backend) -> TensorDictModule:
    return TensorDictModule(_net(backend), in_keys=["observation"], out_keys=["action"])


@torch.no_grad()
def test_deepcopy_of_a_tensordict_module_wrapper(backend: Backend) -> None:
    policy = backend.wrap(_actor(backend))
    _captured(policy, TensorDict(observation=backend.randn(4, 3), batch_size=[4]))
    target = copy.deepcopy(policy)
    assert target.in_keys == ["observation"] and target.out_keys == ["action"]
    target.module.module[0].weight.mul_(2.0)
    for _ in range(3):
        td = TensorDict(observation=backend.randn(4, 3), batch_size=[4])
        assert target(td) is td
        torch.testing.assert_close(td["action"], target.module.module(td["observation"]))
        torch.testing.assert_close(policy(td)["action"], policy.module.module(td["observation"]))
        action = target(observation=td["observation"])
        torch.testing.assert_close(action, target.module.module(td["observation"]))


class Agent(nn.Module):
    """An agent that holds its network and a wrapper of it, and a wrapper of its own method."""

    def __init__(self, backend: Backend):
        super().__init__()
        self.net = _net(backend)
        self.policy = backend.wrap(self.net)
        self.act = backend.wrap(self.explore)

    def explore(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).tanh()


@torch.no_grad()
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_module_that_holds_wrappers_copies_them_with_it(backend: Backend, how: str) -> None:
    agent = Agent(backend)
    x = backend.randn(4, 3)
    _captured(agent.policy, x)
    _captured(agent.act, x)
    other = copy.deepcopy(agent) if how == "deepcopy" else _saved_and_loaded(agent)
    assert other.policy.module is other.net and other.act.module.__self__ is other
    assert not other.policy.is_captured and not other.act.is_captured
    other.net[0].bias.add_(1.0)
    for _ in range(3):
        x = backend.randn(4, 3)
        torch.testing.assert_close(other.policy(x), other.net(x))
        torch.testing.assert_close(other.act(x), other.net(x).tanh())
        torch.testing.assert_close(agent.act(x), agent.net(x).tanh())


@torch.no_grad()
@pytest.mark.parametrize("wrapped", ["module", "tensordict-module"])
def test_torch_save_and_load_give_an_uncaptured_wrapper(backend: Backend, wrapped: str) -> None:
    module = _net(backend) if wrapped == "module" else _actor(backend)
    graphed = backend.wrap(module, warmup=3, shapes="exact")
    net = module if wrapped == "module" else module.module

    def call(g: CudaGraphModule, x: torch.Tensor) -> torch.Tensor:
        if wrapped == "module":
            return g(x)
        return g(TensorDict(observation=x, batch_size=x.shape[:1]))["action"]

    for _ in range(4):
        call(graphed, backend.randn(4, 3))
    assert graphed.is_captured
    loaded = _saved_and_loaded(graphed)
    assert type(loaded) is CudaGraphModule and not loaded.is_captured
    assert "warmup=3" in repr(loaded) and "shapes=Exact()" in repr(loaded)
    loaded_net = loaded.module if wrapped == "module" else loaded.module.module
    assert loaded_net[0].weight.data_ptr() != net[0].weight.data_ptr()
    torch.testing.assert_close(loaded.state_dict(), graphed.state_dict())
    for _ in range(4):
        x = backend.randn(4, 3)
        torch.testing.assert_close(call(loaded, x), loaded_net(x))
    assert loaded.is_captured


def test_copy_copy_is_a_new_uncaptured_wrapper_of_the_same_module(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(net)
    with torch.no_grad():
        _captured(graphed, backend.randn(4, 3))
        other = copy.copy(graphed)
        assert other.module is net and not other.is_captured and graphed.is_captured


@torch.no_grad()
def test_deepcopy_of_a_function_that_reaches_no_state_wraps_it_again(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x.sin() * 2)
    _captured(graphed, backend.randn(3))
    other = copy.deepcopy(graphed)
    assert other.module is graphed.module and not other.is_captured
    x = backend.randn(3)
    torch.testing.assert_close(other(x), x.sin() * 2)


def test_deepcopy_of_a_function_that_reaches_a_module_or_optimizer_raises(
    backend: Backend,
) -> None:
    net = _net(backend)
    opt = torch.optim.Adam(
        net.parameters(), lr=torch.tensor(0.01, device=backend.device), capturable=True
    )

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = net(x).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    for fn, what in [(lambda x: net(x), "net"), (step, "opt")]:
        graphed = backend.wrap(fn)
        with pytest.raises(
            TypeError,
            match=re.escape("CudaGraphModule cannot deep-copy <function ")
            + f".*: the copy would share .*{what}.*"
            + re.escape("Wrap a deep copy of the module instead"),
        ):
            copy.deepcopy(graphed)


def test_pickling_a_wrapper_of_a_local_function_raises_a_clear_error(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(lambda x: net(x))
    with pytest.raises(TypeError, match=re.escape("CudaGraphModule cannot be pickled")) as info:
        torch.save(graphed, io.BytesIO())
    assert "torch.save(wrapper.state_dict(), f)" in str(info.value)
