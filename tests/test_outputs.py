"""Outputs: a replay's result in the captured structure, in fresh memory; results of
TensorDicts built directly (``TensorDictResult``), every other result through optree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, tensorclass

from cudagraph_td._values.outputs import Outputs

from .conftest import Backend, replays_as_eager


@tensorclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor


def _flat(x: torch.Tensor) -> TensorDict:
    # Keys set out of sorted order: the result lists them as the function set them.
    return TensorDict(critic_loss=x.sum(), actor_loss=x.mean(), alpha=x.max(), batch_size=[])


def _nested(x: torch.Tensor) -> TensorDict:
    return TensorDict(
        obs=x * 2,
        next=TensorDict(reward=x.sum(-1, keepdim=True), done=x[:, :1] > 0, batch_size=[4]),
        action=x.tanh(),
        empty=TensorDict(batch_size=[4]),
        batch_size=[4],
    )


def _named(x: torch.Tensor) -> TensorDict:
    inner = TensorDict(z=x.cos(), batch_size=[4, 3])
    # non_blocking=False: a TensorDict made on the CPU in a process that uses CUDA would
    # otherwise synchronise CUDA (tensordict's `_sync_all`), which a capture refuses.
    return TensorDict(
        y=x + 1,
        inner=inner,
        batch_size=[4, 3],
        device=x.device,
        names=["env", "time"],
        non_blocking=False,
    )


def _in_containers(x: torch.Tensor) -> Any:
    return (
        _flat(x),
        {"b": x.sum(0), "a": [_nested(x), x.exp()]},
    )


# Each case: a function of a (4, 3) tensor whose result holds TensorDicts.
CASES: dict[str, Callable[[torch.Tensor], Any]] = {
    "flat": _flat,
    "nested": _nested,
    "names-device-batch-dims": _named,
    "in-a-tuple-and-a-dict": _in_containers,
}


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, TensorDictBase):
        return list(tree.values(True, True))
    values = tree.values() if isinstance(tree, dict) else tree
    return [leaf for value in values for leaf in _leaves(value)]


def _assert_same(actual: Any, expected: Any) -> None:
    """The same structure, types, keys in the same order, metadata and values."""
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected)
    elif isinstance(expected, TensorDictBase):
        assert list(actual.keys()) == list(expected.keys())
        assert actual.batch_size == expected.batch_size
        assert actual.device == expected.device
        assert actual.names == expected.names
        for key in expected.keys():  # noqa: SIM118  # a TensorDict's keys, not its rows
            _assert_same(actual.get(key), expected.get(key))
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_same(actual[key], expected[key])
    else:
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("warmup", [1, 2])
def test_tensordict_results_match_eager_in_fresh_memory(
    backend: Backend, case: str, warmup: int
) -> None:
    fn = CASES[case]
    graphed = backend.wrap(fn, warmup=warmup)
    results = replays_as_eager(
        backend, graphed, fn, lambda: ((backend.randn(4, 3),), {}), warmup + 3, _assert_same
    )
    # Two replays' results share no memory: writing into one changes no other.
    first, second = results[-2][0], results[-1][0]
    ptrs = {t.data_ptr() for t in _leaves(first) if t.numel()}
    assert ptrs.isdisjoint(t.data_ptr() for t in _leaves(second) if t.numel())
    snapshot = [t.clone() for t in _leaves(second)]
    for t in _leaves(first):
        t.zero_()
    for t, before in zip(_leaves(second), snapshot, strict=True):
        torch.testing.assert_close(t, before)


@pytest.mark.parametrize("case", list(CASES))
def test_tensordict_results_are_built_without_optree(case: str) -> None:
    out = CASES[case](torch.randn(4, 3))
    outputs = Outputs("fn", out, torch.device("cpu"))
    assert outputs.tensordicts is not None
    _assert_same(outputs.rebuild(outputs.copies.make()), out)


class _Sub(TensorDict):
    pass


def _with_non_tensor(x: torch.Tensor) -> TensorDict:
    td = TensorDict(y=x * 2, batch_size=[4])
    td.set_non_tensor("mode", "train")
    return td


# Results that keep optree's rebuild: a TensorDict subclass, a lazy stack, a tensorclass, a
# non-tensor entry, a constant beside a TensorDict, no TensorDict at all.
OTHER_RESULTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "subclass": lambda x: _Sub(y=x * 2, batch_size=[4]),
    "lazy-stack": lambda x: LazyStackedTensorDict(
        TensorDict(y=x[0]), TensorDict(y=x[1]), stack_dim=0
    ),
    "tensorclass": lambda x: _Pair(first=x * 2, second=x.sum(-1), batch_size=[4]),
    "non-tensor-entry": _with_non_tensor,
    "constant-beside": lambda x: (_flat(x), "train"),
    "tensors-only": lambda x: {"b": x * 2, "a": (x.sum(), x.exp())},
}


@pytest.mark.parametrize("case", list(OTHER_RESULTS))
def test_other_results_keep_the_optree_rebuild(backend: Backend, case: str) -> None:
    fn = OTHER_RESULTS[case]
    x = backend.randn(4, 3)
    assert Outputs("fn", fn(x), backend.device).tensordicts is None
    graphed = backend.wrap(fn, warmup=1)
    for _ in range(3):
        x = backend.randn(4, 3)
        out, expected = graphed(x), fn(x)
        assert type(out) is type(expected)
        assert [t.tolist() for t in _leaves_of(out)] == [t.tolist() for t in _leaves_of(expected)]
        if case == "non-tensor-entry":
            assert out["mode"] == expected["mode"] == "train"
        # A plain TensorDict lists its keys as the function set them, as eager's does.
        assert _key_orders(out) == _key_orders(expected)


def _key_orders(tree: Any) -> list[list[Any]]:
    """The keys of each plain TensorDict of ``tree``, in their order."""
    if type(tree) is TensorDict:
        return [list(tree.keys())]
    if isinstance(tree, tuple | list):
        return [order for value in tree for order in _key_orders(value)]
    return []


def _leaves_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, TensorDicts' in sorted key order (optree's rebuild sorts)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, _Pair):
        return [tree.first, tree.second]
    if isinstance(tree, TensorDictBase):
        values = [tree.get(key) for key in sorted(tree.keys(True, True), key=str)]
        return [value for value in values if isinstance(value, torch.Tensor)]
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves_of(tree[key])]
    if isinstance(tree, tuple | list):
        return [leaf for value in tree for leaf in _leaves_of(value)]
    return []
