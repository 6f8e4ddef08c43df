"""Whole-step capture: forward, backward, optimizer step and target update as one graph."""

from __future__ import annotations

import copy
import re
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
    opt = OPTIMIZERS[optimizer](net.parameters(), lr, True)

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
    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, Any]:
        w = torch.zeros(3, device=backend.device, requires_grad=True)
        lr = torch.tensor(0.1, device=backend.device)
        opt = torch.optim.Adam([w], lr=lr, capturable=True)
        # A scheduler writes into a tensor learning rate in place.
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            (w * x).pow(2).sum().backward()
            opt.step()
            return w.detach().clone()

        return step, lr, scheduler

    step, lr, scheduler = make()
    twin, twin_lr, twin_scheduler = make()
    graphed = backend.wrap(step, warmup=2)
    for i in range(10):
        if i == 7:  # by hand, in place
            lr.fill_(0.5)
            twin_lr.fill_(0.5)
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), twin(x), msg=f"call {i}")
        scheduler.step()
        twin_scheduler.step()
    assert lr.item() == twin_lr.item() == 0.5 * 0.5**2  # the hand-set value, halved twice


# Optimizers that have a capturable mode, built without it: torch refuses their step in a
# CUDA capture (a fused one too), and the emulation as torch does.
UNCAPTURABLE: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.1),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.1),
}


@pytest.mark.parametrize("optimizer", list(UNCAPTURABLE))
def test_optimizer_without_capturable_is_explained(backend: Backend, optimizer: str) -> None:
    w = torch.zeros(3, device=backend.device, requires_grad=True)
    opt = UNCAPTURABLE[optimizer]([w])

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        (w * x).sum().backward()
        opt.step()
        return w.detach().clone()

    graphed = backend.wrap(step, warmup=2)
    graphed(backend.randn(3))
    with pytest.raises(RuntimeError, match="build it with `capturable=True`") as info:
        graphed(backend.randn(3))
    assert f"an instance of {type(opt).__name__} but param_groups' capturable is False" in str(
        info.value
    )


def _sgd_step(backend: Backend, *, set_to_none: bool | None = True) -> tuple[Any, nn.Module, Any]:
    """An SGD step with `zero_grad(set_to_none=...)` inside, or none (``None``)."""
    net = nn.Linear(3, 1).to(backend.device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor) -> torch.Tensor:
        if set_to_none is not None:
            opt.zero_grad(set_to_none=set_to_none)
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return step, net, opt


def test_changed_float_learning_rate_is_reported(backend: Backend) -> None:
    step, net, opt = _sgd_step(backend)
    twin, twin_net, twin_opt = _sgd_step(backend)
    twin_net.load_state_dict(net.state_dict())
    graphed = backend.wrap(step, warmup=2)

    def both(x: torch.Tensor) -> None:
        torch.testing.assert_close(graphed(x), twin(x))

    for _ in range(3):
        both(backend.randn(8, 3))
    for lr in (0.01 * 1.0, 0.005):  # the same value in a new object is still valid
        opt.param_groups[0]["lr"] = twin_opt.param_groups[0]["lr"] = lr
    message = "param_groups[0]['lr'] = 0.01, which is now 0.005. A graph replays the value"
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        graphed(backend.randn(8, 3))
    assert "`lr=torch.tensor(...)`, with `capturable=True`" in str(info.value)
    graphed.reset()  # the documented way out: capture again with the new value
    for _ in range(4):
        both(backend.randn(8, 3))
    torch.testing.assert_close(net.weight, twin_net.weight)


def test_equal_hyperparameter_in_a_new_object_replays_and_a_deleted_one_is_reported(
    backend: Backend,
) -> None:
    step, net, opt = _sgd_step(backend)
    twin, twin_net, _ = _sgd_step(backend)
    twin_net.load_state_dict(net.state_dict())
    graphed = backend.wrap(step, warmup=2)
    for i in range(6):
        if i == 3:  # a scheduler that wrote the same number, as a new object
            opt.param_groups[0]["lr"] = float("0.01")
        torch.testing.assert_close(graphed(x := backend.randn(8, 3)), twin(x))
    torch.testing.assert_close(net.weight, twin_net.weight)
    del opt.param_groups[0]["momentum"]
    with pytest.raises(RuntimeError, match=re.escape("param_groups[0]['momentum'] = 0.9, which")):
        graphed(backend.randn(8, 3))


def test_replaced_tensor_learning_rate_is_reported(backend: Backend) -> None:
    w = torch.zeros(3, device=backend.device, requires_grad=True)
    opt = torch.optim.Adam([w], lr=torch.tensor(0.1, device=backend.device), capturable=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        (w * x).sum().backward()
        opt.step()
        return w.detach().clone()

    graphed = backend.wrap(step, warmup=2)
    for _ in range(3):
        graphed(backend.randn(3))
    opt.param_groups[0]["lr"] = torch.tensor(0.2, device=backend.device)
    with pytest.raises(
        RuntimeError, match=r"Change a tensor hyperparameter in place \(`.fill_\(\)`\)"
    ):
        graphed(backend.randn(3))


def test_zero_grad_inside_the_step_keeps_grads_as_eager(backend: Backend) -> None:
    # tensordict's documented pattern: `opt.zero_grad()` (set_to_none=True) inside the step.
    step, net, _ = _sgd_step(backend)
    twin, twin_net, _ = _sgd_step(backend)
    twin_net.load_state_dict(net.state_dict())
    graphed = backend.wrap(step, warmup=2)
    for i in range(5):
        x = backend.randn(8, 3)
        torch.testing.assert_close(graphed(x), twin(x))
        # After the capturing call (i == 1) too, `.grad` holds this call's gradient.
        for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=f"call {i}")


def test_gradients_of_a_graphed_backward_feed_an_eager_step(backend: Backend) -> None:
    # Forward and backward in the graph, the optimizer step outside: `.grad` must hold each
    # call's gradient, the capturing call's included, when the eager step reads it.
    def make() -> tuple[Any, nn.Module, torch.optim.Optimizer]:
        net = nn.Linear(3, 2).to(backend.device)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)

        def backward(x: torch.Tensor) -> torch.Tensor:
            net.zero_grad()  # set_to_none=True
            loss = net(x).square().mean()
            loss.backward()
            return loss.detach()

        return backward, net, opt

    backward, net, opt = make()
    twin, twin_net, twin_opt = make()
    twin_net.load_state_dict(net.state_dict())
    graphed = backend.wrap(backward, warmup=2)
    for _ in range(5):
        x = backend.randn(4, 3)
        torch.testing.assert_close(graphed(x), twin(x))
        opt.step()
        twin_opt.step()
    for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_gradients_set_to_none_between_replays_accumulate_from_zero(backend: Backend) -> None:
    # Gradient accumulation: the graph adds into the captured `.grad` tensors.
    net = nn.Linear(3, 1).to(backend.device)

    def accumulate(x: torch.Tensor) -> torch.Tensor:
        loss = net(x).pow(2).mean()
        loss.backward()
        return loss.detach()

    graphed = backend.wrap(accumulate, warmup=2)
    for _ in range(3):
        graphed(backend.randn(8, 3))
    expected = net.weight.grad.clone() + _grad_of(net, x := backend.randn(8, 3))
    graphed(x)
    torch.testing.assert_close(net.weight.grad, expected)  # accumulated, as in eager
    net.zero_grad(set_to_none=False)  # zeroes in place: the graph's tensors stay
    graphed(x)
    torch.testing.assert_close(net.weight.grad, _grad_of(net, x))
    captured = net.weight.grad
    net.zero_grad()  # set_to_none=True: `None` is zero, as eager mode reads it
    graphed(x)
    assert net.weight.grad is captured  # the graph's tensor, given back
    torch.testing.assert_close(net.weight.grad, _grad_of(net, x))
    graphed(x)
    torch.testing.assert_close(net.weight.grad, 2 * _grad_of(net, x))
    # Another tensor in its place: the graph would not add into it.
    net.weight.grad = torch.zeros_like(captured)
    message = (
        "`net.weight.grad` was replaced since the capture "
        "(captured: a tensor of shape (1, 3); now: a tensor of shape (1, 3))"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        graphed(x)
    assert "call `zero_grad(set_to_none=False)` outside the function" in str(info.value)
    assert "another tensor" in str(info.value)


def test_gradients_set_to_none_before_a_step_that_reads_them_are_reported(
    backend: Backend,
) -> None:
    # The step reads gradients that a backward outside computes: eager mode would skip a
    # parameter whose gradient is None, which a graph cannot do.
    w = torch.zeros(3, device=backend.device, requires_grad=True)
    opt = torch.optim.Adam([w], lr=torch.tensor(0.1, device=backend.device), capturable=True)

    def step() -> torch.Tensor:
        opt.step()
        return w.detach().clone()

    graphed = backend.wrap(step, warmup=2)
    for _ in range(3):
        (w * backend.randn(3)).sum().backward()
        graphed()
    opt.zero_grad()  # set_to_none=True
    message = (
        "`opt.param_groups[0]['params'][0].grad` was replaced since the capture "
        "(captured: a tensor of shape (3,); now: None)"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        graphed()
    assert "computed outside the function" in str(info.value)
    assert w.grad is None  # untouched by the refused call


def test_a_refused_replay_leaves_gradients_set_to_none(backend: Backend) -> None:
    step, net, opt = _sgd_step(backend, set_to_none=None)
    graphed = backend.wrap(step, warmup=2)
    for _ in range(3):
        graphed(backend.randn(8, 3))
    opt.zero_grad()  # set_to_none=True: the replay would zero and give back the tensors...
    opt.param_groups[0]["lr"] = 0.005  # ...but it is refused for the new learning rate
    with pytest.raises(RuntimeError, match=re.escape("['lr'] = 0.01, which is now 0.005")):
        graphed(backend.randn(8, 3))
    assert net.weight.grad is None and net.bias.grad is None


def _grad_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = net.weight.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x, w, net.bias.detach()).pow(2).mean().backward()
    assert w.grad is not None
    return w.grad


def test_policy_sharing_parameters_with_an_eager_learner_is_not_a_step(backend: Backend) -> None:
    # A graphed no-grad policy reads the actor that an eager loop trains with zero_grad():
    # the graph uses no gradient, so the learner's set_to_none is fine.
    actor = nn.Linear(3, 2).to(backend.device)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    policy = backend.wrap(actor, warmup=2)
    for _ in range(4):
        obs = backend.randn(5, 3)
        with torch.no_grad():
            torch.testing.assert_close(policy(obs), actor(obs))
        opt.zero_grad()
        actor(obs).square().mean().backward()
        opt.step()


def test_undetached_loss_of_a_step_is_explained(backend: Backend) -> None:
    step, _, _ = _sgd_step(backend)

    def undetached(x: torch.Tensor) -> dict[str, torch.Tensor]:
        step(x)
        return {"loss": step.__closure__[0].cell_contents(x).pow(2).mean()}  # type: ignore[index]

    graphed = backend.wrap(undetached, warmup=2)
    graphed(backend.randn(8, 3))
    message = 'returns output["loss"], a tensor that still requires grad'
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        graphed(backend.randn(8, 3))
    assert "return `loss.detach()`" in str(info.value)


# Warnings that torch's own code raises while Dynamo traces it (and inductor's TF32 hint).
@pytest.mark.filterwarnings("ignore::UserWarning:torch", "ignore::DeprecationWarning:torch")
@pytest.mark.parametrize("warmup", [2, 3])
def test_compiled_step_inside(backend: Backend, warmup: int) -> None:
    # Inductor on the GPU; on the CPU, where inductor would spend a long time in a C++
    # compiler, the same Dynamo and AOTAutograd path without code generation.
    compiler = "inductor" if backend.name == "cuda" else "aot_eager"
    torch._dynamo.reset()
    update, net, target, opt = _agent(backend, "adam")
    twin_update, twin_net, twin_target, twin_opt = _agent(backend, "adam")
    twin_net.load_state_dict(net.state_dict())
    twin_target.load_state_dict(target.state_dict())
    graphed = backend.wrap(torch.compile(update, backend=compiler), warmup=warmup)
    for step in range(8):
        if step == 5:  # a tensor learning rate still takes effect through the compiled step
            for optimizer in (opt, twin_opt):
                optimizer.param_groups[0]["lr"].fill_(0.05)
        td = TensorDict(
            obs=backend.randn(64, 3),
            next_obs=backend.randn(64, 3),
            reward=backend.randn(64, 1),
            batch_size=[64],
        )
        torch.testing.assert_close(graphed(td)["loss"], twin_update(td)["loss"], msg=f"step {step}")
    assert graphed.is_captured
    for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_a_step_that_sets_its_own_learning_rate_is_not_a_change(backend: Backend) -> None:
    def make() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        w = torch.zeros(3, device=backend.device, requires_grad=True)
        base = torch.tensor(0.1, device=backend.device)
        count = torch.zeros((), device=backend.device)
        opt = torch.optim.Adam([w], lr=base.clone(), capturable=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            (w * x).pow(2).sum().backward()
            count.add_(1)
            opt.param_groups[0]["lr"] = base * 0.9**count  # a schedule inside the step
            opt.step()
            return w.detach().clone()

        return step, w

    step, _ = make()
    twin, _ = make()
    graphed = backend.wrap(step, warmup=2)
    for i in range(6):
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), twin(x), msg=f"call {i}")


def _model(backend: Backend) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(backend.device)
    return model, _adam(model, backend)


def _adam(model: nn.Module, backend: Backend) -> torch.optim.Optimizer:
    lr = torch.tensor(0.01, device=backend.device)
    return torch.optim.Adam(model.parameters(), lr=lr, capturable=True)


def _twin(model: nn.Module, backend: Backend) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An eager twin of a model and its fresh optimizer: built, not deep-copied, since a
    deep copy of a capturable optimizer loses torch's flag that keeps its uncaptured steps
    from warning (on CUDA)."""
    twin = copy.deepcopy(model)
    return twin, _adam(twin, backend)


def _assert_tracks(model: nn.Module, twin: nn.Module, when: str) -> None:
    """Parameters and gradients (``None`` or values) as the eager twin's."""
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}, {when}")
        if q.grad is None:
            assert p.grad is None, f"{name}.grad, {when}"
        else:
            assert p.grad is not None, f"{name}.grad, {when}"
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}.grad, {when}")


def _batch(backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    return backend.randn(16, 3), backend.randn(16, 1)


@pytest.mark.parametrize("warmup", [1, 2, 3])
@pytest.mark.parametrize(
    ("inside", "outside", "before"),
    [
        pytest.param(None, True, False, id="zero_grad-after"),
        pytest.param(None, True, True, id="zero_grad-before"),
        pytest.param(None, False, False, id="zero_grad-in-place-after"),
        pytest.param(True, None, False, id="zero_grad-inside"),
        pytest.param(True, True, False, id="zero_grad-inside-and-after"),
        pytest.param(False, True, False, id="zero_grad-in-place-inside-and-after"),
    ],
)
def test_whole_step_with_zero_grad_outside_tracks_eager(
    backend: Backend, warmup: int, inside: bool | None, outside: bool | None, before: bool
) -> None:
    # `zero_grad(set_to_none=...)` inside the step (`inside`) and/or by the caller, before or
    # after each call (`outside`): the graph gives eager mode's answer at every call.
    model, opt = _model(backend)
    twin, twin_opt = _twin(model, backend)

    def make(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if inside is not None:
                opt.zero_grad(set_to_none=inside)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    graphed, eager = backend.wrap(make(model, opt), warmup=warmup), make(twin, twin_opt)
    for i in range(7):
        if outside is not None and before:
            opt.zero_grad(set_to_none=outside)
            twin_opt.zero_grad(set_to_none=outside)
        x, y = _batch(backend)
        torch.testing.assert_close(graphed(x, y), eager(x, y), msg=f"call {i}")
        _assert_tracks(model, twin, f"call {i}")
        if outside is not None and not before:
            opt.zero_grad(set_to_none=outside)
            twin_opt.zero_grad(set_to_none=outside)
            _assert_tracks(model, twin, f"after call {i}")
    assert graphed.is_captured


@pytest.mark.parametrize("warmup", [1, 2, 3, 4, 5])
def test_gradient_accumulation_with_an_eager_step_tracks_eager(
    backend: Backend, warmup: int
) -> None:
    # Forward and backward graphed; every 4 calls, `opt.step(); opt.zero_grad()` eagerly
    # (set_to_none=True). The capture falls at each position of the cycle in turn.
    model, opt = _model(backend)
    twin, twin_opt = _twin(model, backend)

    def make(model: nn.Module) -> Any:
        def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss.detach()

        return fwd_bwd

    graphed, eager = backend.wrap(make(model), warmup=warmup), make(twin)
    for i in range(14):
        x, y = _batch(backend)
        torch.testing.assert_close(graphed(x, y), eager(x, y), msg=f"call {i}")
        _assert_tracks(model, twin, f"call {i}")
        if i % 4 == 3:
            for optimizer in (opt, twin_opt):
                optimizer.step()
                optimizer.zero_grad()
            _assert_tracks(model, twin, f"step after call {i}")
    assert graphed.is_captured
