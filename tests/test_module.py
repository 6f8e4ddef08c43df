"""CudaGraphModule on plain callables: values against eager, call counting, memory, state."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict, tensorclass
from torch import nn

from cudagraph_td import CudaGraphModule

from .conftest import Backend, counting, replays_as_eager


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def _td(backend: Backend) -> TensorDict:
    return TensorDict(
        obs=backend.randn(4, 3),
        next=TensorDict(obs=backend.randn(4, 3), done=backend.randn(4, 1) > 0, batch_size=[4]),
        batch_size=[4],
    )


# Each case: a function, and a maker of fresh random inputs (args, kwargs) on a backend.
CASES: dict[
    str, tuple[Callable[..., Any], Callable[[Backend], tuple[tuple[Any, ...], dict[str, Any]]]]
] = {
    "tensor": (lambda x: x.sin() * 2, lambda b: ((b.randn(5),), {})),
    "tuple-out": (lambda x, y: (x + y, x * y), lambda b: ((b.randn(3, 2), b.randn(3, 2)), {})),
    "dict-in-out": (
        lambda d: {"s": d["a"] + d["b"], "p": d["a"] * d["b"]},
        lambda b: (({"a": b.randn(4), "b": b.randn(4)},), {}),
    ),
    "keyword-tensors": (lambda x, *, w: x @ w, lambda b: ((b.randn(2, 3),), {"w": b.randn(3, 4)})),
    "nested-trees": (
        lambda pair, cfg: [pair[0] * cfg["k"][0], {"z": pair[1].exp(), "none": None}],
        lambda b: (((b.randn(3), b.randn(2)), {"k": [b.randn(3)]}), {}),
    ),
    "constants": (
        lambda x, mode, n=1: {"y": x * n, "mode": mode, "pair": (n, None)},
        lambda b: ((b.randn(3), "train"), {"n": 3}),
    ),
    "tensordict-in": (
        lambda td: td["obs"] * 2 + td["next", "obs"].where(td["next", "done"], 0.0),
        lambda b: ((_td(b),), {}),
    ),
    "tensordict-out": (
        lambda td: TensorDict(
            y=td["obs"] + 1,
            nested=TensorDict(z=td["next", "obs"] * 2, batch_size=td.batch_size),
            batch_size=td.batch_size,
        ),
        lambda b: ((_td(b),), {}),
    ),
    "tensorclass": (
        lambda t: Transition(obs=t.obs * 2, reward=t.reward.sum(-1, keepdim=True), batch_size=[4]),
        lambda b: ((Transition(obs=b.randn(4, 3), reward=b.randn(4, 2), batch_size=[4]),), {}),
    ),
    "integer-and-bool": (
        lambda i, m: (i * 2, m & (i > 0)),
        lambda b: ((torch.randint(-5, 5, (6,), device=b.device), b.randn(6) > 0), {}),
    ),
    "identity": (lambda x: x, lambda b: ((b.randn(3),), {})),
    "none-out": (lambda x: None, lambda b: ((b.randn(3),), {})),
}


def assert_tree_close(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        torch.testing.assert_close(actual, expected)
    elif isinstance(expected, (TensorDict, Transition)):
        assert type(actual) is type(expected)
        assert actual.batch_size == expected.batch_size
        torch.testing.assert_close(
            actual.to_dict()
            if isinstance(actual, TensorDict)
            else actual.to_tensordict().to_dict(),
            expected.to_dict()
            if isinstance(expected, TensorDict)
            else expected.to_tensordict().to_dict(),
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys()
        for key in expected:
            assert_tree_close(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_tree_close(a, e)
    else:
        assert actual == expected


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("warmup", [1, 2, 3])
def test_outputs_match_eager_and_are_not_overwritten(
    backend: Backend, case: str, warmup: int
) -> None:
    fn, make_inputs = CASES[case]
    graphed = backend.wrap(fn, warmup=warmup)
    replays_as_eager(
        backend, graphed, fn, lambda: make_inputs(backend), warmup + 3, assert_tree_close
    )


def test_output_is_fresh_memory_not_the_graph_buffer(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x * 2, warmup=1)
    x = backend.randn(3)
    first, second = graphed(x), graphed(x)
    third = graphed(x)
    assert first.data_ptr() != second.data_ptr() != third.data_ptr()
    second.zero_()  # the caller owns its result: writing into it changes no later result
    torch.testing.assert_close(graphed(x), x * 2)


def test_an_output_that_views_outer_state_is_its_value_at_the_call(backend: Backend) -> None:
    # LeanRL's SAC returns `alpha.detach()`, then updates `alpha` in place: eager's result is
    # `alpha`'s memory and follows it; a replay's is fresh memory, the value at the call, as
    # the contract has it for every output (tensordict's class copies too).
    alpha = torch.ones(1, device=backend.device)
    graphed = backend.wrap(lambda x: (x * alpha, alpha.detach()), warmup=2)
    for _ in range(2):
        graphed(backend.randn(1))
    for _ in range(3):
        _, got = graphed(backend.randn(1))
        at_call = alpha.clone()
        alpha.mul_(2)
        torch.testing.assert_close(got, at_call)
        assert got.data_ptr() != alpha.data_ptr()


def test_call_counting_follows_tensordict(backend: Backend) -> None:
    fn = counting(lambda x: x + 1)
    graphed = backend.wrap(fn, warmup=3)
    x = backend.randn(2)
    executions = []
    for _ in range(5):
        graphed(x)
        executions.append(fn.calls)
    assert graphed.counter == 3 and graphed.is_captured
    # Warm-up calls 1 and 2 run the function once; call 3 captures; later calls replay.
    # The capture runs it twice (an eager run for the result, then the recording); a replay
    # never does, on CUDA as on the emulation.
    assert executions == [1, 2, 4, 4, 4]


def test_effects_happen_once_per_call(backend: Backend) -> None:
    total = torch.zeros(3, device=backend.device)

    def accumulate(x: torch.Tensor) -> torch.Tensor:
        total.add_(x)
        return total * 1

    graphed = backend.wrap(accumulate, warmup=2)
    inputs = [backend.randn(3) for _ in range(6)]
    for i, x in enumerate(inputs):
        out = graphed(x)
        torch.testing.assert_close(out, torch.stack(inputs[: i + 1]).sum(0))
    torch.testing.assert_close(total, torch.stack(inputs).sum(0))


def test_inplace_updates_of_inputs_reach_the_caller(backend: Backend) -> None:
    def step(x: torch.Tensor, td: TensorDict) -> torch.Tensor:
        x.mul_(2)
        td["h"].add_(1)
        return x + td["h"]

    graphed = backend.wrap(step, warmup=2)
    for _ in range(4):
        x = backend.randn(3)
        td = TensorDict(h=backend.randn(3), batch_size=[3])
        x_eager, td_eager = x.clone(), td.clone()
        expected = step(x_eager, td_eager)
        out = graphed(x, td)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x, x_eager)
        torch.testing.assert_close(td["h"], td_eager["h"])


def test_module_under_no_grad_and_load_state_dict(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(backend.device)
    graphed = backend.wrap(net)
    x = backend.randn(5, 3)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(graphed(x), net(x))
        other = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(backend.device)
        graphed.load_state_dict(other.state_dict())  # copies in place: the graph sees it
        torch.testing.assert_close(graphed(x), other(x))
    assert graphed.state_dict().keys() == net.state_dict().keys()


def test_graph_captured_under_inference_mode(backend: Backend) -> None:
    # Inputs made under `torch.inference_mode()` are inference tensors: no version counters,
    # writable only in that mode. The graph is fed them, and later ones made outside it.
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(backend.device)
    total = torch.zeros(2, device=backend.device)

    def step(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.mul_(0.5)  # an input updated in place: the caller's tensor receives it
        y = net(x) + h
        total.add_(y.sum(0))  # state updated by each call
        return y

    graphed = backend.wrap(step, warmup=2)
    expected_total = torch.zeros(2, device=backend.device)
    for inference in (True, True, True, False, True):
        with torch.inference_mode(inference), torch.no_grad():
            x, h = backend.randn(5, 3), backend.randn(5, 2)
            assert x.is_inference() == inference
            h_eager = h.clone()
            expected = net(x) + h_eager.mul_(0.5)
            expected_total += expected.sum(0)
            out = graphed(x, h)
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(h, h_eager)
            assert graphed.is_captured or graphed.counter < 3
    torch.testing.assert_close(total, expected_total)


def test_state_dict_of_a_function() -> None:
    graphed = CudaGraphModule(lambda x: x, backend="emulate")
    assert graphed.state_dict() == {}
    graphed.load_state_dict({})
    with pytest.raises(TypeError, match="has no `load_state_dict`"):
        graphed.load_state_dict({"w": torch.zeros(1)})


def test_reset_drops_the_graph_and_warms_up_again(backend: Backend) -> None:
    fn = counting(lambda x: x.cumsum(0))
    graphed = backend.wrap(fn, warmup=2)
    for _ in range(3):
        graphed(backend.randn(4))
    graphed.reset()
    assert graphed.counter == 0 and not graphed.is_captured
    for _ in range(3):  # another shape is fine once the graph is dropped
        x = backend.randn(7)
        torch.testing.assert_close(graphed(x), x.cumsum(0))
    assert graphed.is_captured


def test_repr_shows_the_module_and_the_state() -> None:
    graphed = CudaGraphModule(nn.Linear(2, 2), warmup=3, backend="emulate")
    text = repr(graphed)
    assert text.startswith("CudaGraphModule(\n    module=Linear(in_features=2")
    assert "warmup=3" in text and "backend='emulate'" in text
    assert "0 of 2 warm-up calls done" in text
    with torch.no_grad():
        for _ in range(3):
            graphed(torch.randn(1, 2))
    assert "captured: calls replay the graph" in repr(graphed)


def test_without_cuda_warns_once_then_calls_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match=re.escape("created on a machine without CUDA")):
        graphed = CudaGraphModule(lambda x: x)
    x = torch.randn(3)
    for _ in range(3):
        assert graphed(x) is x  # the function's own result, no copy
    assert graphed.counter == 0 and not graphed.is_captured
    assert "eager (no CUDA)" in repr(graphed)


def test_without_cuda_a_training_step_with_a_capturable_optimizer_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The docs' training-step recipe, as written for a GPU, on a machine without CUDA: torch
    # refuses capturable=True for CPU parameters; the eager calls of the fallback allow it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    net = nn.Linear(3, 1)
    opt = torch.optim.Adam(net.parameters(), lr=torch.tensor(0.1), capturable=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    with pytest.warns(UserWarning, match=re.escape('pass backend="emulate"')):
        graphed = CudaGraphModule(step)
    before = net.weight.detach().clone()
    for _ in range(3):
        graphed(torch.randn(8, 3))
    assert not torch.equal(net.weight, before)  # it stepped
    with pytest.raises(Exception, match="capturable=True"):  # outside a call: torch's refusal
        step(torch.randn(8, 3))


def test_backend_cuda_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=re.escape("backend='cuda') needs CUDA")):
        CudaGraphModule(lambda x: x, backend="cuda")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup": 0}, "`warmup` must be an integer greater than 0, got 0."),
        ({"warmup": 1.5}, "`warmup` must be an integer greater than 0, got 1.5."),
        ({"warmup": True}, "`warmup` must be an integer greater than 0, got True."),
        (
            {"backend": "tpu"},
            "`backend` must be one of 'auto', 'cuda', 'emulate', 'eager', got 'tpu'.",
        ),
        (
            {"capture_error_mode": "strict"},
            "`capture_error_mode` must be one of 'global', 'thread_local', 'relaxed', got 'strict'.",
        ),
    ],
    ids=["warmup-zero", "warmup-float", "warmup-bool", "backend", "capture-error-mode"],
)
def test_invalid_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        CudaGraphModule(lambda x: x, **{"backend": "emulate", **kwargs})


@pytest.mark.parametrize("limit", [0, 1 << 24], ids=["cloned", "one-buffer-per-dtype"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "with-a-transpose"])
def test_several_outputs_are_fresh_either_way(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, limit: int, transposed: bool
) -> None:
    # Several outputs come back as views of one new buffer per dtype (small, contiguous
    # results) or as one clone each (large results, or any non-contiguous output).
    from cudagraph_td._values import outputs as _outputs

    monkeypatch.setattr(_outputs, "_PACK_LIMIT_BYTES", limit)

    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = x.t() if transposed else x * 1
        return {
            "a": x + 1,
            "b": (x > 0).int(),
            "c": x.double(),
            "d": x > 0.5,
            "y": y,
            "scalar": x.sum(),
            "row": x[1] * 3,  # at an offset in its buffer
            "empty": (x * 2)[:0],
        }

    graphed = backend.wrap(fn, warmup=1)
    results = []
    for _ in range(4):
        x = backend.randn(3, 3)
        out = graphed(x)
        assert out["y"].shape == fn(x)["y"].shape
        results.append((out, fn(x)))
    backend.sync()
    for out, expected in results:
        assert_tree_close(out, expected)
    first, second = results[-2][0], results[-1][0]
    assert first["a"].data_ptr() != second["a"].data_ptr()


@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=["scalars", "vectors", "matrices"])
def test_outputs_of_one_shape_are_fresh_and_independent(
    backend: Backend, shape: tuple[int, ...]
) -> None:
    # A step's losses and metrics (outputs of one dtype and one shape) come back stacked in
    # one new buffer per call: each its own values, none shared with another call's.
    def fn(x: torch.Tensor) -> dict[str, torch.Tensor]:
        base = x.reshape(-1)[: math.prod(shape)].reshape(shape) if shape else x.sum()
        return {"loss": base * 2, "entropy": base - 1, "kl": base.abs()}

    graphed = backend.wrap(fn, warmup=1)
    results = []
    for _ in range(4):
        x = backend.randn(6, 4)
        results.append((graphed(x), fn(x)))
    backend.sync()
    for out, expected in results:
        assert list(out) == list(expected)
        assert_tree_close(out, expected)
        assert all(t.shape == shape for t in out.values())
    last, before = results[-1][0], results[-2][0]
    assert last["loss"].data_ptr() != before["loss"].data_ptr()
    kept = {k: v.clone() for k, v in before.items()}
    last["loss"].add_(100)  # a write into one output changes no other, of any call
    assert_tree_close(before, kept)
    assert_tree_close(last["kl"], results[-1][1]["kl"])


def test_is_an_instance_of_tensordicts_class(backend: Backend) -> None:
    # Code that checks for tensordict's class (torchrl's collectors trust its instances)
    # takes this one, and gets this class's behaviour.
    import tensordict.nn

    graphed = backend.wrap(lambda x: x + 1, warmup=1)
    assert isinstance(graphed, tensordict.nn.CudaGraphModule)
    x = backend.randn(3)
    torch.testing.assert_close(graphed(x), x + 1)
