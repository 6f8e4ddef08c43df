"""The replay path: every reader with every writer, against one list of mismatched calls.

Each route (a call kind, read by its reader, written by its writer; in grad mode through
the autograd node) must replay good calls without the slow path, with results equal to
eager, and leave every mismatched call to the slow path, which raises the documented error
naming the leaf; a good call after it still matches eager.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import InputMismatchError
from cudagraph_td._capture.autograd import DifferentiableCall
from cudagraph_td._capture.entry import MISS
from cudagraph_td._values import routes as _routes
from cudagraph_td._values.signature import Signature

from .conftest import Backend, current_entry

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Route:
    """A kind of call: how to wrap it, build it from its input tensor, and run it eagerly."""

    reader: type
    writer: type
    path: str  # the path of the input tensor, as errors name it
    make: Callable[[Backend], tuple[Any, Callable[[torch.Tensor], Call]]]
    missing: type[Exception]  # the error for a call without the input
    extra_is_error: bool = True  # whether an extra input is an error (not for in_keys)


def _net(backend: Backend) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(backend.device)


def _positional(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    return _net(backend), lambda x: ((x,), {})


def _keywords(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    net = _net(backend)
    return (lambda *, x: net(x)), lambda x: ((), {"x": x})


def _batch(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    net = _net(backend)

    def step(td: TensorDict) -> dict[str, torch.Tensor]:
        return {"out": net(td["obs"]) * td["scale"], "sum": td["obs"].sum()}

    def make(x: torch.Tensor) -> Call:
        scale = torch.full((4, 1), 2.0, device=backend.device)
        return (TensorDict(obs=x, scale=scale, batch_size=[4]),), {}

    return step, make


def _flattening(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    net = _net(backend)
    return (lambda x, *, scale: net(x) * scale), lambda x: ((x,), {"scale": 2.0})


def _module(backend: Backend) -> TensorDictModule:
    return TensorDictModule(_net(backend), in_keys=["observation"], out_keys=["action"])


def _module_td(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    def make(x: torch.Tensor) -> Call:
        # Another entry than the in_keys, which the module ignores.
        return (TensorDict(observation=x, other=x.sum(-1), batch_size=[4]),), {}

    return _module(backend), make


def _module_keywords(backend: Backend) -> tuple[Any, Callable[[torch.Tensor], Call]]:
    return _module(backend), lambda x: ((), {"observation": x})


ROUTES = {
    "positional-tree": Route(
        _routes.Positional, _routes.OneTensor, "args[0]", _positional, ValueError
    ),
    "keywords-tree": Route(
        _routes.Keywords, _routes.OneTensor, 'kwargs["x"]', _keywords, ValueError
    ),
    "batch-tree": Route(
        _routes.TensorDictEntries, _routes.Tree, 'args[0]["obs"]', _batch, KeyError
    ),
    "flattening-tree": Route(
        _routes.Flattening, _routes.OneTensor, "args[0]", _flattening, ValueError
    ),
    "tensordict-into-caller": Route(
        _routes.TensorDictEntries,
        _routes.IntoTensorDict,
        'args[0]["observation"]',
        _module_td,
        KeyError,
        extra_is_error=False,
    ),
    "keywords-out-keys": Route(
        _routes.Keywords,
        _routes.OutKeyValues,
        'kwargs["observation"]',  # the keyword as the call passed it
        _module_keywords,
        KeyError,
    ),
}


def _mismatches(
    backend: Backend, route: Route, x: torch.Tensor
) -> dict[str, tuple[Call, Any, str]]:
    """Mismatched calls, each with the error it raises (a type, or None where it is no error)
    and the path that the error names."""
    other_device = torch.device("meta") if backend.name != "cuda" else torch.device("cpu")
    _, make = route.make(backend)
    args, kwargs = make(x)
    td = args[0] if args and isinstance(args[0], TensorDict) else None

    def without_input() -> Call:
        if td is not None:
            smaller = td.clone(recurse=False)
            del smaller[route.path.split('"')[1]]
            return (smaller,), kwargs
        if "x" in kwargs or "observation" in kwargs:
            return args, {}
        return (), kwargs

    def with_extra() -> tuple[Call, str]:
        if td is not None:
            larger = td.clone(recurse=False)
            larger["extra"] = x.clone()
            return ((larger,), kwargs), 'args[0]["extra"]'
        if kwargs:
            return (args, {**kwargs, "extra": x.clone()}), 'kwargs["extra"]'
        return ((*args, x.clone()), kwargs), "args[1]"

    extra_call, extra_path = with_extra()
    return {
        "shape": (make(torch.randn(4, 5, device=x.device)), ValueError, route.path),
        "dtype": (make(x.double()), ValueError, route.path),
        "device": (make(x.to(other_device)), ValueError, route.path),
        "requires-grad": (make(x.clone().requires_grad_()), RuntimeError, route.path),
        "missing": (without_input(), route.missing, route.path),
        "extra": (extra_call, ValueError if route.extra_is_error else None, extra_path),
    }


def _action(result: Any) -> Any:
    """What to compare with eager: a TensorDict module's action, or the result itself."""
    return result["action"] if isinstance(result, TensorDict) else result


def _first_tensor(result: Any) -> torch.Tensor:
    result = _action(result)
    return result if isinstance(result, torch.Tensor) else next(iter(result.values()))


def _count_slow_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the slow path's full checks (`Signature.match`) from now on."""
    count = [0]
    match = Signature.match

    def counted(self: Signature, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return match(self, *args, **kwargs)

    monkeypatch.setattr(Signature, "match", counted)
    return count


@pytest.mark.parametrize("grad", [False, True], ids=["plain-graph", "autograd-node"])
@pytest.mark.parametrize("name", list(ROUTES))
def test_every_route_replays_good_calls_and_leaves_mismatches_to_the_slow_path(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, name: str, grad: bool
) -> None:
    route = ROUTES[name]
    fn, make = route.make(backend)
    graphed = backend.wrap(fn, warmup=2)

    def good_call() -> None:
        x = backend.randn(4, 3)
        args, kwargs = make(x)
        result = graphed(*args, **kwargs)
        with torch.no_grad():
            eager_args, eager_kwargs = make(x.clone())
            expected = fn(*eager_args, **eager_kwargs)
        torch.testing.assert_close(_action(result), _action(expected))
        if route.writer is _routes.IntoTensorDict:
            assert result is args[0]  # the caller's TensorDict, with the outputs written
        # In grad mode, the result comes out of the autograd node, with its backward.
        assert _first_tensor(result).requires_grad == grad

    with torch.set_grad_enabled(grad):
        for _ in range(2):  # a warm-up call, then the capture
            args, kwargs = make(backend.randn(4, 3))
            graphed(*args, **kwargs)
        entry = current_entry(graphed)
        assert entry is not None and entry.captured is not None
        assert (type(entry.captured) is DifferentiableCall) == grad
        # The reader and the writer of this call kind are among the graph's routes.
        captured = entry.captured
        routes = graphed._routes(captured.signature, captured.outputs)
        assert (route.reader, route.writer) in [(type(r), type(w)) for r, w in routes]
        slow = _count_slow_path(monkeypatch)
        for _ in range(3):
            good_call()
        assert slow[0] == 0, "a good call took the slow path"
        for case, (call, error, path) in _mismatches(backend, route, backend.randn(4, 3)).items():
            args, kwargs = call
            if error is None:  # accepted: the module ignores other entries
                torch.testing.assert_close(_action(graphed(*args, **kwargs)), _action(fn(*args)))
            else:
                entries = graphed._table.entries()
                assert entries and all(e.replay(args, kwargs) is MISS for e in entries), case
                with pytest.raises(error, match=re.escape(path)) as info:
                    graphed(*args, **kwargs)
                if case in ("shape", "dtype", "device"):
                    assert isinstance(info.value, InputMismatchError), case
                    assert info.value.path == path
            good_call()
