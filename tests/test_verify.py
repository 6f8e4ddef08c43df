"""``verify=``: the first replays checked against eager runs, and the errors that name the leaf."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import CudaGraphModule, VerificationError

from .conftest import Backend, counting, requires_cuda


def test_verified_replays_run_the_function_eagerly_then_stop(backend: Backend) -> None:
    fn = counting(lambda x, *, scale: {"y": x * scale, "sum": x.sum()})
    graphed = backend.wrap(fn, warmup=2, verify=3)
    for _ in range(2):  # a warm-up call and the capture
        graphed(backend.randn(4), scale=2.0)
    # A replay runs no Python (on CUDA as on the emulation): each verified replay runs the
    # function once, eagerly.
    per_replay = 1
    for i in range(5):
        calls = fn.calls
        x = backend.randn(4)
        out = graphed(x, scale=2.0)
        torch.testing.assert_close(out["y"], x * 2.0)
        torch.testing.assert_close(out["sum"], x.sum())
        expected = per_replay if i < 3 else per_replay - 1
        assert fn.calls - calls == expected
    assert graphed._verifier is not None and graphed._verifier.done == 3
    assert graphed._table.entries()  # in the table, after the last check


def test_random_numbers_are_reported_with_the_leaf(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: {"noisy": x + torch.rand_like(x)}, warmup=1, verify=2)
    graphed(backend.randn(3))
    with pytest.raises(VerificationError) as info:
        graphed(backend.randn(3))
    message = str(info.value)
    assert message.startswith(
        'CudaGraphModule replay 1 (verify=) returned output["noisy"] unlike an eager run of the '
        "function on the same inputs: Tensor-likes are not close!"
    )
    assert "random numbers, which the replay and the eager run draw differently" in message
    assert isinstance(info.value, RuntimeError)


def test_inputs_updated_in_place_are_compared_too(backend: Backend) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    graphed = backend.wrap(step, warmup=1, verify=3)
    for _ in range(4):
        x = backend.randn(5)
        expected_x = x * 2
        torch.testing.assert_close(graphed(x), expected_x.sum())
        torch.testing.assert_close(x, expected_x)  # updated once, not once more by the check


@requires_cuda
def test_a_python_value_read_at_capture_is_named() -> None:
    settings = {"scale": 2.0}

    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"same": x + 1, "scaled": x * settings["scale"]}

    graphed = CudaGraphModule(fn, warmup=1, verify=2)
    x = torch.randn(3, device="cuda")
    graphed(x)
    graphed(x)  # verified: nothing changed
    settings["scale"] = 3.0  # the graph keeps 2.0
    with pytest.raises(
        VerificationError,
        match=re.escape('replay 2 (verify=) returned output["scaled"] unlike an eager run'),
    ) as info:
        graphed(x)
    assert "a Python value read at capture" in str(info.value)


@requires_cuda
def test_an_input_updated_in_place_is_named() -> None:
    settings = {"scale": 2.0}

    def fn(x: torch.Tensor, td: TensorDict) -> torch.Tensor:
        td["obs"].mul_(settings["scale"])
        return x + 1

    graphed = CudaGraphModule(fn, warmup=1, verify=1)
    x = torch.randn(3, device="cuda")
    graphed(x, TensorDict(obs=torch.randn(2, device="cuda"), batch_size=[2]))
    settings["scale"] = 3.0
    with pytest.raises(
        VerificationError,
        match=re.escape('replay 1 (verify=) updated args[1]["obs"] in place unlike an eager run'),
    ):
        graphed(x, TensorDict(obs=torch.randn(2, device="cuda"), batch_size=[2]))


def test_module_state_is_left_as_the_replay_left_it(backend: Backend) -> None:
    # Batch norm in training mode updates its running statistics in place: the eager run of
    # a verified replay must not update them a second time.
    torch.manual_seed(0)
    net = nn.BatchNorm1d(3).to(backend.device)
    twin = nn.BatchNorm1d(3).to(backend.device)
    graphed = backend.wrap(net, warmup=2, verify=4)
    with torch.no_grad():
        for _ in range(6):
            x = backend.randn(8, 3)
            torch.testing.assert_close(graphed(x), twin(x))
    for name, buffer in twin.named_buffers():
        torch.testing.assert_close(dict(net.named_buffers())[name], buffer)


def test_a_tensor_attribute_is_left_as_the_replay_left_it(backend: Backend) -> None:
    # A module's tensor attribute (neither parameter nor buffer) counted in place: the eager
    # run of a verified replay puts it back, as it does buffers.
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = torch.zeros((), device=backend.device)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return x * 2

    counter = Counter()
    graphed = backend.wrap(counter, warmup=1, verify=3)
    with torch.no_grad():
        for _ in range(5):
            graphed(backend.randn(3))
    assert counter.calls.item() == 5


def test_a_training_step_is_refused(backend: Backend) -> None:
    net = nn.Linear(3, 1).to(backend.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    graphed = backend.wrap(step, warmup=1, verify=1)
    graphed(backend.randn(4, 3))
    with pytest.raises(RuntimeError, match=re.escape("it is a training step")):
        graphed(backend.randn(4, 3))


@torch.no_grad()
@pytest.mark.parametrize("call", ["tensordict", "keywords"])
def test_tensordict_module_calls_are_verified(backend: Backend, call: str) -> None:
    policy = TensorDictModule(
        nn.Linear(3, 2).to(backend.device), in_keys=["obs"], out_keys=["action"]
    )
    graphed = backend.wrap(policy, warmup=2, verify=2)
    for _ in range(5):
        obs = backend.randn(4, 3)
        if call == "keywords":
            torch.testing.assert_close(graphed(obs=obs), policy.module(obs))
        else:
            td = graphed(TensorDict(obs=obs, batch_size=[4]))
            torch.testing.assert_close(td["action"], policy.module(obs))
    assert graphed._verifier is not None and graphed._verifier.done == 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"], ids=repr)
def test_invalid_verify(value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape("`verify` must be an integer of 0 or more")):
        CudaGraphModule(lambda x: x, backend="emulate", verify=value)
