"""Random input trees against the replay's checks: each call raises the documented error or
returns what eager mode returns, and a good call after an error still does.

Hypothesis draws a tree of arguments (dicts, tuples, TensorDicts, tensors of several shapes
and dtypes, constants), the wrapper captures a function of it, then each call receives a
mutated copy: new values only, or one change that the DESIGN error table lists.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from .conftest import Backend, record

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]

# A description of a tree: ("tensor", shape, dtype), ("const", value), ("dict", {key: tree}),
# ("tuple", [trees]) or ("td", batch_size, {key: tensor description}).
shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
tensors = st.tuples(st.just("tensor"), shapes, st.sampled_from(DTYPES))
consts = st.tuples(st.just("const"), st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b"])))
keys = st.sampled_from(["a", "b", "c", "obs"])


@st.composite
def tensordicts(draw: st.DrawFn) -> tuple[Any, ...]:
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=1).map(tuple))
    entries = draw(st.dictionaries(keys, tensors, min_size=1, max_size=3))
    return (
        "td",
        batch,
        {k: ("tensor", batch + shape, dtype) for k, (_, shape, dtype) in entries.items()},
    )


trees = st.recursive(
    st.one_of(tensors, tensors, consts, tensordicts()),
    lambda children: st.one_of(
        st.tuples(st.just("dict"), st.dictionaries(keys, children, min_size=1, max_size=3)),
        st.tuples(st.just("tuple"), st.lists(children, min_size=1, max_size=3)),
    ),
    max_leaves=6,
)


def build(desc: tuple[Any, ...], device: torch.device) -> Any:
    """A tree of fresh random values, as ``desc`` describes."""
    kind = desc[0]
    if kind == "tensor":
        _, shape, dtype = desc
        if dtype == torch.bool:
            return torch.rand(shape, device=device) > 0.5
        if dtype == torch.int64:
            return torch.randint(-5, 5, shape, device=device)
        return torch.randn(shape, device=device, dtype=dtype)
    if kind == "const":
        return desc[1]
    if kind == "dict":
        return {k: build(v, device) for k, v in desc[1].items()}
    if kind == "tuple":
        return tuple(build(v, device) for v in desc[1])
    _, batch, entries = desc
    return TensorDict({k: build(v, device) for k, v in entries.items()}, batch_size=batch)


def compute(tree: Any) -> Any:
    """The captured function: a new value for every tensor, constants passed through."""
    if isinstance(tree, torch.Tensor):
        return ~tree if tree.dtype == torch.bool else tree * 2 + 1
    if isinstance(tree, TensorDict):
        return TensorDict({k: compute(v) for k, v in tree.items()}, batch_size=tree.batch_size)
    if isinstance(tree, dict):
        return {k: compute(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(compute(v) for v in tree)
    return tree


def mutations(desc: tuple[Any, ...]) -> list[tuple[str, tuple[Any, ...], type[Exception]]]:
    """Every single change of ``desc`` that the error table lists, with the error it must raise."""
    kind = desc[0]
    found: list[tuple[str, tuple[Any, ...], type[Exception]]] = []
    if kind == "tensor":
        _, shape, dtype = desc
        found.append(("shape", ("tensor", (*shape, 2), dtype), ValueError))
        other = torch.float64 if dtype != torch.float64 else torch.float32
        found.append(("dtype", ("tensor", shape, other), ValueError))
    elif kind == "const":
        found.append(("constant", ("const", "changed"), ValueError))
    elif kind in ("dict", "td"):
        children = desc[1] if kind == "dict" else desc[2]
        for key, child in children.items():
            for what, new, error in mutations(child):
                changed = {**children, key: new}
                found.append((f"{key}.{what}", _with(desc, changed), error))
            if len(children) > 1:
                rest = {k: v for k, v in children.items() if k != key}
                found.append(
                    (f"missing {key}", _with(desc, rest), KeyError if kind == "td" else ValueError)
                )
        extra = {
            **children,
            "extra": ("tensor", (1,) if kind == "dict" else desc[1], torch.float32),
        }
        found.append(("extra key", _with(desc, extra), ValueError))
        if kind == "td":
            batch = (*desc[1], 1) if len(desc[1]) == 0 else ()
            if batch != desc[1]:
                found.append(
                    (
                        "batch size",
                        ("td", batch, {k: ("tensor", batch, v[2]) for k, v in children.items()}),
                        ValueError,
                    )
                )
    else:  # tuple
        for i, child in enumerate(desc[1]):
            for what, new, error in mutations(child):
                items = list(desc[1])
                items[i] = new
                found.append((f"[{i}].{what}", ("tuple", items), error))
    return found


def _with(desc: tuple[Any, ...], children: dict[str, Any]) -> tuple[Any, ...]:
    return ("dict", children) if desc[0] == "dict" else ("td", desc[1], children)


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected)
    elif isinstance(expected, TensorDict):
        assert isinstance(actual, TensorDict) and actual.batch_size == expected.batch_size
        assert set(actual.keys()) == set(expected.keys())
        for key in expected.keys():  # noqa: SIM118  # a TensorDict's keys, not a dict's
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (dict, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        pairs = (
            zip(actual.values(), expected.values(), strict=True)
            if isinstance(expected, dict)
            else zip(actual, expected, strict=True)
        )
        for a, e in pairs:
            assert_same(a, e)
    else:
        assert actual == expected


@settings(
    # CATALOG_EXAMPLES raises the count for a longer run (the GPU check uses 200).
    max_examples=int(os.environ.get("CATALOG_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(desc=trees, data=st.data())
def test_random_trees_raise_as_documented_or_match_eager(
    backend: Backend, desc: tuple[Any, ...], data: st.DataObject
) -> None:
    graphed = backend.wrap(compute, warmup=1)
    for _ in range(2):  # the capture, then a replay
        tree = build(desc, backend.device)
        assert_same(graphed(tree), compute(tree))
    options = mutations(desc)
    drawn = data.draw(st.lists(st.sampled_from(options), min_size=1, max_size=4)) if options else []
    figures = {"documented error": 0, "other error": 0, "silent wrong answer": 0, "good calls": 1}
    try:
        for _, mutated, error in drawn:
            try:
                graphed(build(mutated, backend.device))
            except error:
                figures["documented error"] += 1
            except Exception:
                figures["other error"] += 1
                raise
            else:  # a mutated call that returned: whatever it returned is not eager's
                figures["silent wrong answer"] += 1
                pytest.fail(f"{mutated} was accepted where {error.__name__} was documented")
            # After the error the wrapper is intact: a good call still matches eager mode.
            tree = build(desc, backend.device)
            assert_same(graphed(tree), compute(tree))
            figures["good calls"] += 1
    finally:
        record(f"catalog ({backend.name})", trees=1, **{"mutated calls": len(drawn)}, **figures)


# One case per row of the DESIGN.md error table: the call that breaks the row's rule, the
# documented error type, and the leaf path its message must name. Captured with
# `table_fn(x, td, n=3)`; the TensorDict-module rows with a policy of in_key "obs".
def table_fn(x: torch.Tensor, td: TensorDict, *, n: int) -> torch.Tensor:
    return x * n + td["obs"].sum()


def _table_inputs(device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    td = TensorDict(obs=torch.randn(4, 2, device=device), batch_size=[4])
    return (torch.randn(3, device=device), td), {"n": 3}


TABLE: dict[str, tuple[Any, type[Exception], str]] = {
    "shape": (lambda a, k, d: ((a[0][:2], a[1]), k), ValueError, "args[0] of shape (3,)"),
    "batch size": (
        lambda a, k, d: ((a[0], TensorDict(obs=a[1]["obs"][0], batch_size=[])), k),
        ValueError,
        "args[1] of batch size [4]",
    ),
    "dtype": (lambda a, k, d: ((a[0].double(), a[1]), k), ValueError, "args[0] of dtype"),
    "device": (
        lambda a, k, d: ((a[0].to("meta" if d.type == "cpu" else "cpu"), a[1]), k),
        ValueError,
        "args[0] on device",
    ),
    "non-tensor argument": (lambda a, k, d: (a, {"n": 4}), ValueError, 'kwargs["n"] = 3'),
    "missing key": (
        lambda a, k, d: ((a[0], TensorDict(batch_size=[4], device=None)), k),
        KeyError,
        'args[1]["obs"]',
    ),
    "extra key and other number of arguments": (
        lambda a, k, d: ((a[0], a[1], a[0]), {**k, "m": 1}),
        ValueError,
        'extra: args[2], kwargs["m"]',
    ),
    "input that requires grad": (
        lambda a, k, d: ((a[0].requires_grad_(), a[1]), k),
        RuntimeError,
        "args[0], a tensor that requires grad",
    ),
}


@pytest.mark.parametrize("row", list(TABLE))
def test_error_table_row(backend: Backend, row: str) -> None:
    change, error, leaf = TABLE[row]
    graphed = backend.wrap(table_fn, warmup=1)  # in grad mode: a plain graph, no grad needed
    args, kwargs = _table_inputs(backend.device)
    graphed(*args, **kwargs)
    args, kwargs = _table_inputs(backend.device)
    bad_args, bad_kwargs = change(args, kwargs, backend.device)
    with pytest.raises(error) as info:
        graphed(*bad_args, **bad_kwargs)
    assert leaf in str(info.value), str(info.value)
    args, kwargs = _table_inputs(backend.device)  # the wrapper is intact
    torch.testing.assert_close(graphed(*args, **kwargs), table_fn(*args, **kwargs))


def test_error_table_row_missing_in_key(backend: Backend) -> None:
    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(lambda obs: obs * 2, in_keys=["obs"], out_keys=["action"])
    graphed = backend.wrap(policy, warmup=1)
    graphed(TensorDict(obs=torch.randn(4, 2, device=backend.device), batch_size=[4]))
    with pytest.raises(KeyError, match="obs"):
        graphed(TensorDict(other=torch.randn(4, 2, device=backend.device), batch_size=[4]))


# The last row, an operation that cannot be captured (a host synchronisation, a copy from
# CPU memory), is tested case by case in test_capture.py
# (test_capture_failure_on_cuda_is_explained_and_leaves_a_clean_context).
