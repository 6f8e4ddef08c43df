"""Every wrong input is caught before any copy or replay, with the leaf path and the fix."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from cudagraph_td._values.tree import flatten_call

from .conftest import Backend, current_entry

HINT = "or call `reset()` to capture the graph again for the new inputs."


def _captured(backend: Backend) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """A wrapper captured with a tensor, a TensorDict, a nested dict and constants."""

    def fn(
        x: torch.Tensor, td: TensorDict, cfg: dict[str, Any], *, obs: torch.Tensor, mode: str
    ) -> Any:
        return x.sum() + td["next", "obs"].sum() + cfg["w"][0].sum() + obs.sum() + len(mode)

    args = (
        backend.randn(4, 3),
        TensorDict(next=TensorDict(obs=backend.randn(4, 2), batch_size=[4]), batch_size=[4]),
        {"w": [backend.randn(2)]},
    )
    kwargs = {"obs": backend.randn(3), "mode": "train"}
    graphed = backend.wrap(fn, warmup=1)
    graphed(*args, **kwargs)
    return graphed, args, kwargs


def _check_raises(
    graphed: Any, args: Any, kwargs: Any, error: type[Exception], message: str
) -> None:
    """The call raises ``error`` with ``message``, leaves the graph untouched and keeps working."""
    static_before = [t.clone() for t in current_entry(graphed).captured.signature.static_inputs]
    with pytest.raises(error, match=re.escape(message)):
        graphed(*args, **kwargs)
    for before, after in zip(
        static_before, current_entry(graphed).captured.signature.static_inputs, strict=True
    ):
        torch.testing.assert_close(before, after)  # nothing was copied into the graph


def test_wrong_shape(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    bad = {**kwargs, "obs": backend.randn(5)}
    _check_raises(
        graphed,
        args,
        bad,
        ValueError,
        'CudaGraphModule was captured with kwargs["obs"] of shape (3,), but received shape (5,). '
        "A CUDA graph replays fixed shapes: pass an input of the captured shape, make the "
        "CudaGraphModule with `shapes=Exact()` (a graph per shape) or `shapes=Buckets([...])` "
        f"(batch sizes padded to a few graphs), {HINT}",
    )


def test_wrong_entry_shape_in_a_tensordict(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    td = TensorDict(next=TensorDict(obs=backend.randn(4, 5), batch_size=[4]), batch_size=[4])
    _check_raises(
        graphed,
        (args[0], td, args[2]),
        kwargs,
        ValueError,
        'captured with args[1]["next", "obs"] of shape (4, 2), but received shape (4, 5).',
    )


def test_wrong_batch_size(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    td = TensorDict(next=TensorDict(obs=backend.randn(4, 2), batch_size=[4]), batch_size=[])
    _check_raises(
        graphed,
        (args[0], td, args[2]),
        kwargs,
        ValueError,
        "CudaGraphModule was captured with args[1] of batch size [4], but received batch size "
        "[]. A CUDA graph replays fixed shapes: pass a TensorDict of the captured batch size, "
        "make the CudaGraphModule with `shapes=Exact()` (a graph per shape) or "
        f"`shapes=Buckets([...])` (batch sizes padded to a few graphs), {HINT}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64], ids=str)
def test_wrong_dtype_is_not_cast(backend: Backend, dtype: torch.dtype) -> None:
    graphed, args, kwargs = _captured(backend)
    _check_raises(
        graphed,
        (args[0].to(dtype), *args[1:]),
        kwargs,
        ValueError,
        f"CudaGraphModule was captured with args[0] of dtype torch.float32, but received dtype "
        f"{dtype}. The replay does not cast inputs: convert it with `.to(torch.float32)`, {HINT}",
    )


def test_wrong_device(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    other = torch.device("cpu") if backend.name == "cuda" else torch.device("meta")
    bad = {"w": [args[2]["w"][0].to(other)]}
    _check_raises(
        graphed,
        (args[0], args[1], bad),
        kwargs,
        ValueError,
        f'captured with args[2]["w"][0] on device {backend.device}, but received it on device '
        f"{other}. A graph reads its inputs from one device: move it with `.to('{backend.device}')` "
        "before the call.",
    )


def test_wrong_device_at_capture(backend: Backend) -> None:
    other = torch.device("cpu") if backend.name == "cuda" else torch.device("meta")
    graphed = backend.wrap(lambda x, y: x + y.sum(), warmup=1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"CudaGraphModule captures its graph on {backend.device}, but args[1] is on {other}."
        ),
    ):
        graphed(backend.randn(2), torch.zeros(2, device=other))


def test_changed_constant(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    _check_raises(
        graphed,
        args,
        {**kwargs, "mode": "eval"},
        ValueError,
        "CudaGraphModule was captured with the non-tensor argument kwargs[\"mode\"] = 'train', but "
        "received 'eval'. The graph replays the captured value: pass values that change between "
        'calls as tensors, declare it static (`static=("mode",)`: a graph per value), use '
        f"one CudaGraphModule per value, {HINT}",
    )


def test_constant_of_another_type(backend: Backend) -> None:
    graphed = backend.wrap(lambda x, n: x * n, warmup=1)
    graphed(backend.randn(2), 1)
    with pytest.raises(ValueError, match=re.escape("argument args[1] = 1, but received 1.0")):
        graphed(backend.randn(2), 1.0)


def test_tensor_where_a_constant_was_captured(backend: Backend) -> None:
    graphed = backend.wrap(lambda x, n: x * n, warmup=1)
    graphed(backend.randn(2), 2.0)
    with pytest.raises(
        ValueError,
        match=re.escape("captured with args[1] of type float, but received type Tensor."),
    ):
        graphed(backend.randn(2), backend.randn(()))


def test_missing_and_extra_arguments(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    _check_raises(
        graphed,
        args[:2],
        {**kwargs, "extra": 1},
        ValueError,
        "CudaGraphModule was called with inputs of another structure than at capture:\n"
        "  missing: args[2]\n"
        '  extra: kwargs["extra"]\n'
        "The function cannot take this call either (missing a required argument: 'cfg'): "
        "pass the arguments it takes, as at capture.",
    )


def test_a_missing_required_keyword_is_answered_about_the_keyword(backend: Backend) -> None:
    # The function itself requires it: a graph per structure would not help.
    def fn(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x * scale

    graphed = backend.wrap(fn, warmup=1)
    graphed(backend.randn(3), scale=2.0)
    with pytest.raises(TypeError) as python:  # Python's own words, which its versions vary
        inspect.signature(fn).bind(backend.randn(3))
    _check_raises(
        graphed,
        (backend.randn(3),),
        {},
        ValueError,
        "CudaGraphModule was called with inputs of another structure than at capture:\n"
        '  missing: kwargs["scale"]\n'
        f"The function cannot take this call either ({python.value}): "
        "pass the arguments it takes, as at capture.",
    )


def test_a_missing_optional_argument_is_answered_with_a_graph_per_structure(
    backend: Backend,
) -> None:
    graphed = backend.wrap(lambda x, y=None: x if y is None else x + y, warmup=1)
    graphed(backend.randn(3), y=backend.randn(3))
    _check_raises(
        graphed,
        (backend.randn(3),),
        {},
        ValueError,
        "CudaGraphModule was called with inputs of another structure than at capture:\n"
        '  missing: kwargs["y"]\n'
        "A graph replays the captured call: pass the same arguments and keys, make the "
        'CudaGraphModule with shapes="exact" (a graph per structure and shapes: an optional '
        f"argument passed or None, say), {HINT}",
    )


def test_a_missing_required_argument_of_a_graphed_callable(backend: Backend) -> None:
    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
            return x * scale

    graphed = backend.graph_callables(
        Scaled(), (backend.randn(3, requires_grad=True),), sample_kwargs={"scale": 2.0}
    )
    with pytest.raises(TypeError) as python:  # Python's own words, which its versions vary
        inspect.signature(Scaled.forward).bind(None, backend.randn(3))
    message = (
        "make_graphed_callables(Scaled) was called with inputs of another structure than at "
        "capture:\n"
        '  missing: kwargs["scale"]\n'
        f"The function cannot take this call either ({python.value})"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        graphed(backend.randn(3))


def test_missing_tensordict_key_is_a_key_error(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    td = TensorDict(next=TensorDict(batch_size=[4]), batch_size=[4])
    _check_raises(
        graphed,
        (args[0], td, args[2]),
        kwargs,
        KeyError,
        'CudaGraphModule input lacks the key(s) args[1]["next", "obs"] that the captured graph '
        "reads. Pass a TensorDict with every entry it had at capture.",
    )


def test_extra_tensordict_key(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    td = args[1].clone()
    td["other"] = backend.randn(4)
    _check_raises(graphed, (args[0], td, args[2]), kwargs, ValueError, '  extra: args[1]["other"]')


def test_input_that_requires_grad(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    bad = {**kwargs, "obs": backend.randn(3, requires_grad=True)}
    _check_raises(
        graphed,
        args,
        bad,
        RuntimeError,
        'CudaGraphModule received kwargs["obs"], a tensor that requires grad, but the graph is '
        "not captured for autograd",
    )


def test_input_that_requires_grad_at_capture(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x * 2, warmup=2)
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match=re.escape("args[0], a tensor that requires grad")),
    ):
        graphed(backend.randn(3, requires_grad=True))


def test_input_that_requires_grad_with_detached_outputs(backend: Backend) -> None:
    # Grad mode is on, but the function returns detached values: no graph for autograd, so
    # an input that requires grad would silently get no gradient.
    graphed = backend.wrap(lambda x: (x * 2).detach(), warmup=1)
    with pytest.raises(RuntimeError, match=re.escape("args[0], a tensor that requires grad")):
        graphed(backend.randn(3, requires_grad=True))


def test_uncomparable_constant_is_refused_at_capture(backend: Backend) -> None:
    class NoBool:
        def __eq__(self, other: object) -> Any:
            return torch.zeros(2)

        __hash__ = object.__hash__

    graphed = backend.wrap(lambda x, c: x, warmup=1)
    with pytest.raises(
        TypeError, match=re.escape("cannot check the non-tensor argument args[1] of type NoBool")
    ):
        graphed(backend.randn(2), NoBool())


def test_good_call_after_errors_matches_eager(backend: Backend) -> None:
    graphed, args, kwargs = _captured(backend)
    for bad in ({**kwargs, "obs": backend.randn(5)}, {**kwargs, "mode": "eval"}):
        with pytest.raises(ValueError):
            graphed(*args, **bad)
    x = backend.randn(4, 3)
    expected = graphed.module(x, *args[1:], **kwargs)
    torch.testing.assert_close(graphed(x, *args[1:], **kwargs), expected)


def test_tensordict_key_order_is_not_structure(backend: Backend) -> None:
    graphed = backend.wrap(lambda td: td["a"] - td["b"], warmup=1)
    for _ in range(2):
        graphed(TensorDict(a=backend.randn(2), b=backend.randn(2), batch_size=[2]))
    a, b = backend.randn(2), backend.randn(2)
    torch.testing.assert_close(graphed(TensorDict(b=b, a=a, batch_size=[2])), a - b)


def _batch(backend: Backend, n: int = 4, **overrides: Any) -> TensorDict:
    entries = {"obs": backend.randn(n, 3), "reward": backend.randn(n, 1), "done": backend.randn(n)}
    entries.update(overrides)
    return TensorDict(entries, batch_size=[n])


def _batch_step(td: TensorDict) -> dict[str, torch.Tensor]:
    return {"value": td["obs"].sum(-1, keepdim=True) + td["reward"], "done": td["done"] * 2}


def test_one_tensordict_batch_is_read_by_key_and_matches_eager(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphed = backend.wrap(_batch_step, warmup=2)
    for _ in range(2):
        graphed(_batch(backend))
    full_checks = 0
    entry = current_entry(graphed)
    signature = entry.captured.signature

    def counting(check: Any) -> Any:
        def counted(*args: Any) -> Any:
            nonlocal full_checks
            full_checks += 1
            return check(*args)

        return counted

    # Flattening reads (the general reader) and full checks (the slow path) are counted.
    monkeypatch.setattr(signature, "read", counting(signature.read))
    monkeypatch.setattr(signature, "match", counting(signature.match))
    graphed._select(flatten_call((_batch(backend),), {}))
    results = []
    for _ in range(3):
        td = _batch(backend)
        # Keys set in another order than at capture: the same layout.
        td = TensorDict({k: td[k] for k in ("reward", "done", "obs")}, batch_size=[4])
        results.append((graphed(td), _batch_step(td)))
    for actual, expected in results:  # every result is its own memory
        torch.testing.assert_close(actual, expected)
    assert full_checks == 0


@pytest.mark.parametrize(
    "mutation",
    [
        "missing key",
        "extra key",
        "batch size",
        "entry shape",
        "entry dtype",
        "nested TensorDict entry",
        "dimension names",
        "entry device",
    ],
)
def test_one_tensordict_batch_that_differs_is_refused(backend: Backend, mutation: str) -> None:
    graphed = backend.wrap(_batch_step, warmup=1)
    graphed(_batch(backend))
    td = _batch(backend)
    error: type[Exception] = ValueError
    if mutation == "missing key":
        del td["reward"]
        error, message = KeyError, 'lacks the key(s) args[0]["reward"]'
    elif mutation == "extra key":
        td["other"] = backend.randn(4)
        message = '  extra: args[0]["other"]'
    elif mutation == "batch size":
        td = _batch(backend, n=5)
        message = "captured with args[0] of batch size [4], but received batch size [5]."
    elif mutation == "entry shape":
        td["obs"] = backend.randn(4, 2)
        message = 'captured with args[0]["obs"] of shape (4, 3), but received shape (4, 2).'
    elif mutation == "entry dtype":
        td["done"] = td["done"].double()
        message = 'captured with args[0]["done"] of dtype torch.float32, but received dtype'
    elif mutation == "nested TensorDict entry":
        td["done"] = TensorDict(x=backend.randn(4), batch_size=[4])
        message = 'args[0]["done"]'
    elif mutation == "dimension names":
        td.names = ["batch"]
        message = "names"
    else:
        other = torch.device("meta") if backend.name == "emulate" else torch.device("cpu")
        td = TensorDict({k: v.to(other) for k, v in td.items()}, batch_size=[4])
        message = 'args[0]["done"] on device'
    _check_raises(graphed, (td,), {}, error, message)
    good = _batch(backend)
    torch.testing.assert_close(graphed(good), _batch_step(good))
