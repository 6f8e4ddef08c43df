"""Whole-step capture: forward, backward, optimizer step and target update as one graph."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from .conftest import Backend

# capturable=True on CUDA; torch refuses it for CPU parameters, where the emulation runs.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda params, lr, cap: torch.optim.Adam(params, lr=lr, capturable=cap),
    "adamw": lambda params, lr, cap: torch.optim.AdamW(
        params, lr=lr, weight_decay=0.1, capturable=cap
    ),
    # SGD has no capturable mode; with a tensor lr its step syncs the host: a float lr.
    "sgd-momentum": lambda params, lr, cap: torch.optim.SGD(params, lr=lr.item(), momentum=0.9),
}


def _agent(
    backend: Backend, optimizer: str
) -> tuple[Callable[[TensorDict], TensorDict], nn.Module, nn.Module, Any]:
    net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1)).to(backend.device)
    target = copy.deepcopy(net).requires_grad_(False)
    lr = torch.tensor(1e-2, device=backend.device)
    opt = OPTIMIZERS[optimizer](net.parameters(), lr, backend.name == "cuda")

    def update(td: TensorDict) -> TensorDict:
        opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            bootstrap = td["reward"] + 0.99 * target(td["next_obs"])
        loss = (net(td["obs"]) - bootstrap).pow(2).mean()
        loss.backward()
        opt.step()
        with torch.no_grad():  # a soft target update, in place
            torch._foreach_lerp_(list(target.parameters()), list(net.parameters()), 0.05)
        return TensorDict(loss=loss.detach())

    return update, net, target, opt


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_whole_step_tracks_the_eager_twin(backend: Backend, optimizer: str) -> None:
    torch.manual_seed(0)
    update, net, target, opt = _agent(backend, optimizer)
    twin_update, twin_net, twin_target, twin_opt = _agent(backend, optimizer)
    twin_net.load_state_dict(net.state_dict())
    twin_target.load_state_dict(target.state_dict())
    graphed = backend.wrap(update, warmup=2)
    for step in range(12):
        td = TensorDict(
            obs=backend.randn(64, 3),
            next_obs=backend.randn(64, 3),
            reward=backend.randn(64, 1),
            batch_size=[64],
        )
        loss = graphed(td)["loss"]
        assert not loss.requires_grad
        torch.testing.assert_close(loss, twin_update(td)["loss"], msg=f"step {step}")
    for module, twin in ((net, twin_net), (target, twin_target)):
        for p, q in zip(module.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for state, twin_state in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        for key in state:
            torch.testing.assert_close(state[key], twin_state[key], rtol=1e-4, atol=1e-5)


def test_tensor_learning_rate_changes_take_effect(backend: Backend) -> None:
    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        w = torch.zeros(3, device=backend.device, requires_grad=True)
        lr = torch.tensor(0.1, device=backend.device)
        opt = torch.optim.Adam([w], lr=lr, capturable=backend.name == "cuda")

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            (w * x).pow(2).sum().backward()
            opt.step()
            return w.detach().clone()

        return step, lr

    step, lr = make()
    twin, twin_lr = make()
    graphed = backend.wrap(step, warmup=2)
    for i in range(8):
        if i == 5:  # changed in place, as a scheduler writing into a tensor lr does
            lr.fill_(0.5)
            twin_lr.fill_(0.5)
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), twin(x))


def test_optimizer_without_capturable_is_explained(cuda: Backend) -> None:
    w = torch.zeros(3, device="cuda", requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.1)  # capturable=False

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        (w * x).sum().backward()
        opt.step()
        return w.detach().clone()

    graphed = cuda.wrap(step, warmup=2)
    graphed(cuda.randn(3))
    with pytest.raises(RuntimeError, match="build it with `capturable=True`"):
        graphed(cuda.randn(3))
