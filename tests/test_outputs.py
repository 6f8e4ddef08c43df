"""Outputs: a replay's result in the captured structure, in fresh memory; results of
TensorDicts built directly (``TensorDictResult``), every other result through optree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, tensorclass

from cudagraph_td import InputMismatchError
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


# Outputs that are inputs, or views of inputs: returned as eager returns them, on every call.


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _calls(n: int = 4) -> range:
    """Call numbers that cover a warm-up (1), the capture (2) and replays (3, 4)."""
    return range(n)


def test_a_returned_input_is_the_callers_tensor_on_every_call(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x)
    for _ in _calls():
        x = backend.randn(4, 3)
        out = graphed(x)
        assert out is x
        out.add_(1)  # reaches the caller's tensor, as in eager mode
        backend.sync()
        torch.testing.assert_close(x, out)


def test_a_returned_keyword_input_is_the_callers_tensor(backend: Backend) -> None:
    graphed = backend.wrap(lambda *, obs, scale: (obs, obs * scale))
    for _ in _calls():
        obs, scale = backend.randn(4, 3), backend.randn(3)
        same, scaled = graphed(obs=obs, scale=scale)
        assert same is obs
        torch.testing.assert_close(scaled, obs * scale)


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slice": lambda x: x[:, :2],
    "transpose": lambda x: x.t(),
    "row": lambda x: x[1],
    "reshape": lambda x: x.view(2, 6),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_a_view_of_an_input_is_the_same_view_of_the_callers_tensor(
    backend: Backend, view: str
) -> None:
    fn = VIEWS[view]
    graphed = backend.wrap(fn)
    for _ in _calls():
        x = backend.randn(4, 3)
        out, expected = graphed(x), fn(x)
        assert _same_memory(out, x)
        assert (out.shape, out.stride(), out.storage_offset()) == (
            expected.shape,
            expected.stride(),
            expected.storage_offset(),
        )
        out.mul_(0)  # reaches the caller's tensor, as in eager mode
        backend.sync()
        torch.testing.assert_close(fn(x), torch.zeros_like(expected))


def test_a_view_beside_a_computed_output_keeps_the_computed_one_fresh(backend: Backend) -> None:
    fn = lambda x: {"head": x[:2], "double": x * 2}  # noqa: E731
    graphed = backend.wrap(fn)
    kept = []
    for _ in _calls(5):
        x = backend.randn(4, 3)
        out = graphed(x)
        assert _same_memory(out["head"], x) and out["head"].storage_offset() == 0
        assert not _same_memory(out["double"], x)
        torch.testing.assert_close(out["double"], x * 2)
        kept.append((out["double"], (x * 2).clone()))
    backend.sync()
    for double, expected in kept:  # later replays changed no earlier result
        torch.testing.assert_close(double, expected)


def test_a_returned_input_written_in_place_is_the_callers_tensor(backend: Backend) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.mul_(2)
        return x, x + y

    graphed = backend.wrap(fn)
    for _ in _calls():
        x, y = backend.randn(4, 3), backend.randn(4, 3)
        before = x.clone()
        same, total = graphed(x, y)
        assert same is x
        torch.testing.assert_close(x, before * 2)
        torch.testing.assert_close(total, before * 2 + y)


def test_a_tensordict_entry_returned_is_the_callers_entry(backend: Backend) -> None:
    graphed = backend.wrap(lambda td: (td["obs"], td["obs"].sum(-1)))
    for _ in _calls():
        td = TensorDict(obs=backend.randn(4, 3), batch_size=[4])
        obs, total = graphed(td)
        assert obs is td["obs"]
        torch.testing.assert_close(total, td["obs"].sum(-1))


def test_a_module_that_writes_views_of_an_in_key_keeps_the_callers_memory(
    backend: Backend,
) -> None:
    from tensordict.nn import TensorDictModule

    module = TensorDictModule(
        lambda obs: (obs, obs[:, :2], obs * 2), in_keys=["obs"], out_keys=["obs", "head", "y"]
    )
    graphed = backend.wrap(module)
    for _ in _calls():
        obs = backend.randn(4, 3)
        td = TensorDict(obs=obs, batch_size=[4])
        assert graphed(td) is td
        assert td["obs"] is obs
        assert _same_memory(td["head"], obs)
        torch.testing.assert_close(td["head"], obs[:, :2])
        torch.testing.assert_close(td["y"], obs * 2)


def test_a_returned_input_that_requires_grad_is_the_callers_tensor(backend: Backend) -> None:
    weight = backend.randn(3, requires_grad=True)
    fn = lambda x: (x, x[:, :2], x * weight)  # noqa: E731
    graphed = backend.wrap(fn)
    for _ in _calls():
        x = backend.randn(4, 3, requires_grad=True)
        same, head, scaled = graphed(x)
        assert same is x and _same_memory(head, x)
        (same.sum() + (head * 3).sum() + scaled.pow(2).sum()).backward()
        grad, weight_grad = x.grad, weight.grad
        x.grad = weight.grad = None
        e_same, e_head, e_scaled = fn(x)
        (e_same.sum() + (e_head * 3).sum() + e_scaled.pow(2).sum()).backward()
        torch.testing.assert_close(grad, x.grad)
        torch.testing.assert_close(weight_grad, weight.grad)
        weight.grad = None


def test_a_view_of_an_input_in_another_layout_is_refused(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x[:, :2])
    for _ in _calls(3):
        graphed(backend.randn(4, 3))
    transposed = backend.randn(3, 4).t()
    with pytest.raises(
        InputMismatchError, match=r"output is a view of args\[0\].*strides \(3, 1\).*\(1, 4\)"
    ):
        graphed(transposed)


def test_an_output_in_an_inputs_memory_of_another_dtype_is_refused(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x.view(torch.int32))
    graphed(backend.randn(4, 3))  # the warm-up: eager's answer
    with pytest.raises(ValueError, match=r"returned output in the memory of args\[0\], but not"):
        graphed(backend.randn(4, 3))


# A plain function that returns its input TensorDict: the caller's, with the writes.


def _writes_y(td: TensorDict) -> TensorDict:
    td["y"] = td["x"] * 2
    td["next", "z"] = td["x"].sum(-1)
    return td


RETURNS_ITS_TENSORDICT: dict[str, Callable[..., Any]] = {
    "itself": lambda td: td,
    "written": _writes_y,
    "in-a-tuple": lambda td: (_writes_y(td), td["x"].mean()),
    "keyword": lambda *, td: _writes_y(td),
    "beside-a-tensor": lambda scale, td: _writes_y(td) if scale.ndim else td,
}


@pytest.mark.parametrize("case", list(RETURNS_ITS_TENSORDICT))
def test_a_plain_function_that_returns_its_tensordict_returns_the_callers(
    backend: Backend, case: str
) -> None:
    fn = RETURNS_ITS_TENSORDICT[case]
    graphed = backend.wrap(fn)
    for _ in _calls():
        x = backend.randn(4, 3)
        td = TensorDict(x=x, batch_size=[4])
        if case == "keyword":
            out = graphed(td=td)
        elif case == "beside-a-tensor":
            out = graphed(backend.randn(3), td)
        else:
            out = graphed(td)
        result = out[0] if case == "in-a-tuple" else out
        assert result is td
        assert td["x"] is x  # the entries it kept are the caller's own tensors
        if case != "itself":
            assert set(td.keys(True, True)) == {"x", "y", ("next", "z")}
            torch.testing.assert_close(td["y"], x * 2)
            torch.testing.assert_close(td["next", "z"], x.sum(-1))
        if case == "in-a-tuple":
            torch.testing.assert_close(out[1], x.mean())


def test_a_returned_tensordict_entry_set_to_another_input_is_the_callers(
    backend: Backend,
) -> None:
    def fn(td: TensorDict) -> TensorDict:
        td["prev"] = td["obs"]  # rebound to the caller's tensor
        td["head"] = td["obs"][:, :2]
        return td

    graphed = backend.wrap(fn)
    for _ in _calls():
        obs = backend.randn(4, 3)
        td = TensorDict(obs=obs, batch_size=[4])
        assert graphed(td) is td
        assert td["prev"] is obs
        assert _same_memory(td["head"], obs)
        torch.testing.assert_close(td["head"], obs[:, :2])


def test_a_returned_tensordict_in_grad_mode_backpropagates_as_eager(backend: Backend) -> None:
    net = torch.nn.Linear(3, 2).to(backend.device)

    def fn(td: TensorDict) -> TensorDict:
        td["y"] = net(td["x"])
        return td

    graphed = backend.wrap(fn)
    for _ in _calls():
        td = TensorDict(x=backend.randn(4, 3), batch_size=[4])
        assert graphed(td) is td
        td["y"].pow(2).sum().backward()
        grad = net.weight.grad.clone()
        net.zero_grad()
        net(td["x"]).pow(2).sum().backward()
        torch.testing.assert_close(grad, net.weight.grad)
        net.zero_grad()


@pytest.mark.parametrize(
    ("fn", "output"),
    [
        pytest.param(lambda x: x, "output", id="itself"),
        pytest.param(lambda x: x[:, :2], "output", id="slice"),
        pytest.param(lambda x: (x * 2, x.unsqueeze(1)), r"output\[1\]", id="in-a-tuple"),
    ],
)
def test_an_input_returned_under_buckets_is_refused_at_capture(
    backend: Backend, fn: Callable[[torch.Tensor], Any], output: str
) -> None:
    from cudagraph_td import Buckets

    message = rf"returns {output} as args\[0\] or a view of it.*\.clone\(\).*shapes=Exact\(\)"
    for rows in (3, 4):  # a padded capture, or one of the bucket's size: refused alike
        graphed = backend.wrap(fn, shapes=Buckets([4, 8]))
        with torch.no_grad():
            graphed(backend.randn(rows, 3))  # the warm-up, eager
            with pytest.raises(ValueError, match=message):
                graphed(backend.randn(rows, 3))
