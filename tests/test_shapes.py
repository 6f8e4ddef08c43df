"""``shapes=``: one graph per input shapes ("exact"), or batches padded to buckets ("buckets")."""

from __future__ import annotations

import copy
import random
import re
import warnings
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from cudagraph_td import Buckets, Exact, GraphLimitWarning, InputMismatchError

from .conftest import Backend, counting, regression_step, slow_replays

MODES = [
    pytest.param(Exact(max_graphs=128), id="exact"),
    pytest.param(Buckets(), id="buckets"),
    pytest.param(Buckets([8, 16, 32, 48, 64]), id="listed-buckets"),
]


def _policy(backend: Backend) -> tuple[TensorDictModule, nn.Module]:
    net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2)).to(backend.device)
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"]), net


def _td(backend: Backend, n: int) -> TensorDict:
    return TensorDict(observation=backend.randn(n, 4), batch_size=[n])


@torch.no_grad()
@pytest.mark.parametrize("shapes", MODES)
def test_policy_called_with_batch_sizes_1_to_64_in_random_order_equals_eager(
    backend: Backend, shapes: Exact | Buckets
) -> None:
    policy, net = _policy(backend)
    graphed = backend.wrap(policy, warmup=2, shapes=shapes)
    sizes = list(range(1, 65)) * 3
    random.Random(0).shuffle(sizes)
    kept = []
    for n in sizes:
        td = _td(backend, n)
        out = graphed(td)
        assert out is td and td.batch_size == (n,)
        obs = backend.randn(n, 4)
        action = graphed(observation=obs)  # the keyword call of a TensorDict module
        kept.append((td["action"], net(td["observation"]), action, net(obs)))
    backend.sync()
    for got, expected, kw_got, kw_expected in kept:  # fresh memory: unchanged by later calls
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(kw_got, kw_expected)
    infos = graphed.graphs()
    assert all(info.captured for info in infos)
    # Each graph replays from its third call (warmup=2); a bucket's, for every batch it serves.
    assert sum(info.replays for info in infos) >= 128
    if isinstance(shapes, Buckets):
        keys = sorted(info.key for info in infos)
        expected_keys = [(8,), (16,), (32,), (48,), (64,)] if shapes.sizes else None
        assert keys == (expected_keys or [(1 << k,) for k in range(7)])
        assert all(0 <= info.padded < 1 for info in infos)
        assert any(info.padded > 0 for info in infos)


@torch.no_grad()
def test_buckets_replay_smaller_batches_through_the_bucket_graph(backend: Backend) -> None:
    fn = counting(lambda x: {"y": x.tanh() * 2})
    graphed = backend.wrap(fn, warmup=2, shapes=Buckets([16]))
    for n in (5, 16, 3, 11, 11, 1):
        x = backend.randn(n, 3)
        out = graphed(x)
        assert out["y"].shape == (n, 3)
        torch.testing.assert_close(out["y"], x.tanh() * 2)
    (info,) = graphed.graphs()
    assert info.key == (16,) and info.replays == 4
    assert info.padded == pytest.approx(1 - (3 + 11 + 11 + 1) / 64)
    if backend.name == "cuda":  # a replay runs no Python: the padding check's three runs, a
        assert fn.calls == 6  # warm-up and the capture's two (its eager run and its recording)


@torch.no_grad()
def test_exact_captures_a_graph_per_shape_with_its_own_warmup(backend: Backend) -> None:
    fn = counting(lambda x, y: x @ y)
    graphed = backend.wrap(fn, warmup=2, shapes="exact")
    for n, m in [(2, 3), (2, 3), (2, 3), (4, 3), (4, 3), (4, 3), (2, 3)]:
        x, y = backend.randn(n, m), backend.randn(m, 5)
        torch.testing.assert_close(graphed(x, y), x @ y)
    infos = {info.key: info for info in graphed.graphs()}
    assert set(infos) == {((2, 3), (3, 5)), ((4, 3), (3, 5))}
    assert infos[((2, 3), (3, 5))].replays == 2 and infos[((4, 3), (3, 5))].replays == 1
    assert "2 of 2 graphs captured" in repr(graphed) and "shapes=Exact()" in repr(graphed)


def _agent(backend: Backend) -> tuple[Any, nn.Module, Any]:
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(backend.device)
    update, opt = regression_step(backend, net)
    return update, net, opt


def test_training_step_with_a_short_last_minibatch_tracks_the_eager_twin(
    backend: Backend,
) -> None:
    update, net, opt = _agent(backend)
    twin_update, twin_net, twin_opt = _agent(backend)
    twin_net.load_state_dict(net.state_dict())
    graphed = backend.wrap(update, warmup=2, shapes="exact")
    data = TensorDict(obs=backend.randn(200, 3), target=backend.randn(200, 1), batch_size=[200])
    for epoch in range(4):
        for start in range(0, 200, 64):  # minibatches of 64, 64, 64 and 8 rows
            batch = data[start : start + 64]
            loss = graphed(batch)["loss"]
            torch.testing.assert_close(loss, twin_update(batch)["loss"], msg=f"epoch {epoch}")
    for p, q in zip(net.parameters(), twin_net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for state, twin_state in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        torch.testing.assert_close(state["exp_avg"], twin_state["exp_avg"], rtol=1e-4, atol=1e-5)
    assert sorted(info.key for info in graphed.graphs()) == [
        ((8, 3), (8, 1)),
        ((64, 3), (64, 1)),
    ]


def test_padding_is_refused_in_grad_mode(backend: Backend) -> None:
    _, net = _policy(backend)
    graphed = backend.wrap(net, warmup=1, shapes="buckets")
    message = 'CudaGraphModule(shapes="buckets") does not pad calls in grad mode'
    with pytest.raises(RuntimeError, match=re.escape(message)):
        graphed(backend.randn(5, 4))


def test_padding_is_refused_for_a_training_step(backend: Backend) -> None:
    update, _, _ = _agent(backend)
    graphed = backend.wrap(update, warmup=1, shapes="buckets")
    batch = TensorDict(obs=backend.randn(5, 3), target=backend.randn(5, 1), batch_size=[5])
    with pytest.raises(RuntimeError, match=re.escape("does not pad calls in grad mode")):
        graphed(batch)  # a training step runs in grad mode


def test_row_independent_pads_in_grad_mode_with_eager_gradients(backend: Backend) -> None:
    _, net = _policy(backend)
    twin = copy.deepcopy(net)
    graphed = backend.wrap(net, warmup=2, shapes=Buckets(row_independent=True))
    for n in (5, 7, 3, 8, 6):
        x = backend.randn(n, 4, requires_grad=True)
        x_twin = x.detach().clone().requires_grad_()
        out = graphed(x)
        assert out.shape == (n, 2)
        out.pow(2).sum().backward()
        twin(x_twin).pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x_twin.grad)
        del out  # no call's autograd graph alive at a new shape's capture (see Several shapes)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@torch.no_grad()
def test_outputs_computed_across_the_batch_are_refused(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: (x * 2, x.mean()), warmup=1, shapes="buckets")
    message = "slices every output back to the call's rows, but output[1] has shape []"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        graphed(backend.randn(5, 3))


@torch.no_grad()
def test_inputs_of_other_batch_dims_are_refused(backend: Backend) -> None:
    graphed = backend.wrap(lambda x, y: x + y.sum(), warmup=1, shapes="buckets")
    with pytest.raises(InputMismatchError, match=re.escape("args[0] has batch dims [5]")):
        graphed(backend.randn(5, 3), backend.randn(4))
    with pytest.raises(InputMismatchError, match=re.escape("but args[1] has shape []")):
        graphed(backend.randn(5, 3), backend.randn(()))


@torch.no_grad()
@pytest.mark.parametrize("shapes", ["exact", "buckets"])
def test_only_shapes_vary_other_differences_still_raise(backend: Backend, shapes: str) -> None:
    graphed = backend.wrap(lambda x, *, scale: x * scale, warmup=1, shapes=shapes)
    graphed(backend.randn(5, 3), scale=2.0)
    graphed(backend.randn(5, 3), scale=2.0)
    with pytest.raises(InputMismatchError, match=re.escape("float64")):
        graphed(backend.randn(6, 3, dtype=torch.float64), scale=2.0)
    with pytest.raises(InputMismatchError, match=re.escape('kwargs["scale"] = 2.0')):
        graphed(backend.randn(6, 3), scale=3.0)
    x = backend.randn(6, 4)  # another feature dim: a graph of its own, or not a batch to pad
    if shapes == "exact":
        torch.testing.assert_close(graphed(x, scale=2.0), x * 2.0)
    else:
        with pytest.raises(InputMismatchError, match=re.escape("shape")):
            graphed(x, scale=2.0)


@torch.no_grad()
def test_past_max_graphs_a_warning_then_eager_calls(backend: Backend) -> None:
    fn = counting(lambda x: x + 1)
    graphed = backend.wrap(fn, warmup=1, shapes=Exact(max_graphs=2))
    graphed(backend.randn(1))
    graphed(backend.randn(2))
    with pytest.warns(GraphLimitWarning, match=re.escape("reached max_graphs=2")):
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), x + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        x = backend.randn(4)
        torch.testing.assert_close(graphed(x), x + 1)
    assert len(graphed.graphs()) == 2
    assert graphed.graphs().eager_calls == {"past max_graphs": 2}
    strict = backend.wrap(fn, warmup=1, shapes=Exact(max_graphs=1, overflow="raise"))
    strict(backend.randn(1))
    with pytest.raises(RuntimeError, match=re.escape("reached max_graphs=1")):
        strict(backend.randn(2))


@torch.no_grad()
def test_above_the_largest_bucket_a_warning_then_eager_calls_or_an_error(backend: Backend) -> None:
    fn = counting(lambda x: x * 3)
    graphed = backend.wrap(fn, warmup=1, shapes=Buckets([4, 8]))
    graphed(backend.randn(8, 2))  # both buckets captured
    message = (
        "CudaGraphModule received batch dims [9], above its largest bucket 8 (sizes [4, 8]): "
        "such calls run eagerly, without a graph (this warning is issued once; "
        "`graphs().eager_calls` counts them). Add a larger size to Buckets, or pass "
        "Buckets(..., overflow='raise') to refuse them."
    )
    with pytest.warns(GraphLimitWarning, match=re.escape(message)):
        x = backend.randn(9, 2)
        fn.calls = 0
        torch.testing.assert_close(graphed(x), x * 3)
        assert fn.calls == 1  # eagerly
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        x = backend.randn(100, 2)
        torch.testing.assert_close(graphed(x), x * 3)
    assert graphed.graphs().eager_calls == {"above the largest bucket": 2}
    assert [info.key for info in graphed.graphs()] == [(8,), (4,)]  # still a list of graphs
    assert "    eager_calls={'above the largest bucket': 2}\n" in repr(graphed)
    graphed.reset()
    assert graphed.graphs().eager_calls == {}
    assert "    eager_calls=" not in repr(graphed)
    strict = backend.wrap(lambda x: x * 3, warmup=1, shapes=Buckets([4, 8], overflow="raise"))
    with pytest.raises(RuntimeError, match=re.escape("batch dims [9], above its largest bucket 8")):
        strict(backend.randn(9, 2))
    assert strict.graphs().eager_calls == {}  # refused, not run


@torch.no_grad()
def test_precapture_captures_every_bucket_largest_first(backend: Backend) -> None:
    policy, net = _policy(backend)
    graphed = backend.wrap(policy, warmup=3, shapes=Buckets([2, 8, 32]))
    graphed.precapture(_td(backend, 5))
    assert [info.key for info in graphed.graphs()] == [(32,), (8,), (2,)]
    assert all(info.captured and info.replays == 0 for info in graphed.graphs())
    td = _td(backend, 7)
    torch.testing.assert_close(graphed(td)["action"], net(td["observation"]))
    lazy = backend.wrap(policy, warmup=2, shapes="buckets")
    lazy.precapture(_td(backend, 20))
    assert [info.key for info in lazy.graphs()] == [(32,), (16,), (8,), (4,), (2,), (1,)]


@torch.no_grad()
def test_verify_checks_the_first_replay_of_each_new_graph(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x.tanh(), warmup=1, shapes="exact", verify=1)
    for n in (2, 2, 2, 3, 3, 3, 2):
        graphed(backend.randn(n))
    assert graphed._verifier is not None and graphed._verifier.done == 2


def test_exact_in_grad_mode_keeps_each_shapes_saved_tensors(backend: Backend) -> None:
    _, net = _policy(backend)
    twin = copy.deepcopy(net)
    graphed = backend.wrap(net, warmup=2, shapes="exact")
    # Both shapes captured first: a capture in grad mode while another result still holds
    # its autograd graph fails on CUDA (see the sharp edges page, "Several shapes").
    graphed.precapture(backend.randn(5, 4, requires_grad=True))
    graphed.precapture(backend.randn(8, 4))
    for _ in range(4):
        # Both shapes' forwards before either backward: each graph pair keeps what its
        # forward saved (a pool of its own), whatever the other replays in between.
        a, b = backend.randn(5, 4, requires_grad=True), backend.randn(8, 4)
        a_twin = a.detach().clone().requires_grad_()
        (graphed(a).pow(2).sum() + graphed(b).tanh().sum()).backward()
        (twin(a_twin).pow(2).sum() + twin(b).tanh().sum()).backward()
        torch.testing.assert_close(a.grad, a_twin.grad)
        for p, q in zip(net.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert [info.captured for info in graphed.graphs()] == [True, True]


@torch.no_grad()
def test_graphs_lists_the_static_graph_per_mode(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x * 2, warmup=2)
    assert graphed.graphs() == []
    for _ in range(5):
        graphed(backend.randn(3))
    (info,) = graphed.graphs()
    assert (info.mode, info.key, info.captured, info.replays, info.padded) == (
        "no_grad",
        None,
        True,
        3,
        0.0,
    )


@torch.no_grad()
def test_two_batch_dims_and_nested_tensordicts_are_padded_and_sliced(backend: Backend) -> None:
    def fn(td: TensorDict) -> TensorDict:
        return TensorDict(out=td["obs"].tanh() + td["next", "obs"], batch_size=td.batch_size)

    graphed = backend.wrap(fn, warmup=1, shapes=Buckets(batch_dims=2))
    for n, t in [(3, 5), (3, 5), (2, 7), (4, 8), (1, 1)]:
        td = TensorDict(
            obs=backend.randn(n, t, 2),
            next=TensorDict(obs=backend.randn(n, t, 2), batch_size=[n, t]),
            batch_size=[n, t],
        )
        out = graphed(td)
        assert out.batch_size == (n, t)
        torch.testing.assert_close(out["out"], fn(td)["out"])
    assert sorted(info.key for info in graphed.graphs()) == [(1, 1), (2, 8), (4, 8)]


@torch.no_grad()
def test_tensorclass_inputs_are_padded_and_counted(backend: Backend) -> None:
    from tensordict import tensorclass

    @tensorclass
    class Obs:
        x: torch.Tensor
        y: torch.Tensor

    def fn(o: Obs) -> torch.Tensor:
        return o.x * 2 + o.y

    graphed = backend.wrap(fn, warmup=1, shapes="buckets")
    for n in (3, 3, 2, 4, 3):
        o = Obs(x=backend.randn(n, 2), y=backend.randn(n, 2), batch_size=[n])
        torch.testing.assert_close(graphed(o), fn(o))
    infos = {info.key: info for info in graphed.graphs()}
    assert set(infos) == {(4,), (2,)}
    assert infos[(4,)].replays == 3  # 3, 4 and 3 rows of 4
    assert infos[(4,)].padded == pytest.approx(2 / 12)


# Padding checked, not assumed (see `_shapes.row_check`): functions whose rows depend on each other.
ROW_DEPENDENT = {
    "centred": lambda x: x - x.mean(0, keepdim=True),
    "softmax-over-the-batch": lambda x: torch.softmax(x, dim=0),
    "scaled-by-the-batch-max": lambda x: x / x.abs().amax(0, keepdim=True),
}


@pytest.mark.parametrize("case", list(ROW_DEPENDENT))
@pytest.mark.parametrize("buckets", [None, [8, 16]], ids=["powers-of-two", "listed"])
def test_a_function_whose_rows_depend_on_each_other_is_refused_at_its_first_padded_call(
    backend: Backend, case: str, buckets: list[int] | None
) -> None:
    fn = ROW_DEPENDENT[case]
    graphed = backend.wrap(fn, warmup=2, shapes=Buckets(buckets))
    message = "the rows of output that the call keeps changed when only the padded rows did"
    with torch.no_grad():
        x = backend.randn(8, 3)  # below the first listed bucket's warm-up (16): padded
        if buckets is None:  # a bucket of its own size: nothing padded, eager's answer
            for _ in range(3):
                torch.testing.assert_close(graphed(x), fn(x))
            x = backend.randn(5, 3)
        with pytest.raises(RuntimeError, match=re.escape(message)):
            graphed(x)  # never a padded answer, not even from a warm-up
        with pytest.raises(RuntimeError, match=re.escape(message)):
            graphed(x)


def test_a_row_independent_function_passes_the_check_once_per_bucket(backend: Backend) -> None:
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2)).to(backend.device)
    noisy = counting(lambda x: net(x) + 0.1 * torch.randn(x.shape[0], 2, device=x.device))
    graphed = backend.wrap(noisy, warmup=2, shapes="buckets")
    with torch.no_grad():
        for n in (5, 6, 7, 8, 3):  # buckets 8, 8, 8, 8 and 4
            assert graphed(backend.randn(n, 3)).shape == (n, 2)
    # Bucket 8: the check's three runs, a warm-up and the capture's two (its eager run and
    # its recording); bucket 4: the check's three runs and a warm-up.
    assert noisy.calls == 6 + 4
    declared = counting(net)
    graphed = backend.wrap(declared, warmup=2, shapes=Buckets(row_independent=True))
    with torch.no_grad():
        for n in (5, 6, 7):
            x = backend.randn(n, 3)
            torch.testing.assert_close(graphed(x), net(x))
    assert declared.calls == 3  # declared: no check (a warm-up, the capture's two runs)


def test_batchnorm_in_training_mode_is_refused_for_padding_and_its_statistics_kept(
    backend: Backend,
) -> None:
    # Observation normalisation while collecting: the running statistics must not move
    # with the padded rows.
    norm = nn.BatchNorm1d(4).to(backend.device)
    twin = copy.deepcopy(norm)
    graphed = backend.wrap(norm, warmup=2, shapes=Buckets([8]))
    with torch.no_grad():
        for _ in range(3):  # a full bucket: no padding, eager's statistics
            x = backend.randn(8, 4)
            torch.testing.assert_close(graphed(x), twin(x))
        message = "updates the state it reads in place (`module.running_mean`, `module.running_var`"
        with pytest.raises(RuntimeError, match=re.escape(message)):
            graphed(backend.randn(5, 4))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(norm, name), getattr(twin, name))
    norm.eval()  # in eval mode it reads its statistics only: padded, as eager
    twin.eval()
    with torch.no_grad():
        for n in (5, 3, 7):
            x = backend.randn(n, 4)
            torch.testing.assert_close(graphed(x), twin(x))


def _masked(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return x * 2 if mask is None else x * mask + 1


@torch.no_grad()
def test_exact_captures_a_graph_per_structure_of_an_optional_keyword(backend: Backend) -> None:
    fn = counting(_masked)
    graphed = backend.wrap(fn, warmup=2, shapes="exact")
    x, m = backend.randn(5), backend.randn(5)
    calls = [{"mask": None}, {"mask": m}, {}]  # None, a tensor, not passed
    for kwargs in calls:
        for _ in range(3):  # warm-up, capture, replay
            torch.testing.assert_close(graphed(x, **kwargs), _masked(x, **kwargs))
    assert len(graphed.graphs()) == 3 and all(info.captured for info in graphed.graphs())
    ran, slow = fn.calls, slow_replays(graphed)
    for i in range(9):  # alternating: each structure replays its own graph, on the fast path
        x, m = backend.randn(5), backend.randn(5)
        kwargs = [{"mask": None}, {"mask": m}, {}][i % 3]
        torch.testing.assert_close(graphed(x, **kwargs), _masked(x, **kwargs))
    assert fn.calls == ran and slow == [0]


@torch.no_grad()
def test_exact_counts_a_graph_per_structure_under_max_graphs(backend: Backend) -> None:
    graphed = backend.wrap(_masked, warmup=1, shapes=Exact(max_graphs=1, overflow="raise"))
    x = backend.randn(5)
    graphed(x, mask=None)
    with pytest.raises(RuntimeError, match=re.escape("reached max_graphs=1")):
        graphed(x, mask=backend.randn(5))


@torch.no_grad()
def test_exact_keys_tensor_and_constant_arguments_by_their_places(backend: Backend) -> None:
    fn = lambda a, b: a * b  # noqa: E731
    graphed = backend.wrap(fn, warmup=1, shapes="exact")
    x, y = backend.randn(3), backend.randn(3)
    for args in [(x, 2.0), (2.0, y), (x, 2.0), (2.0, y)]:
        torch.testing.assert_close(graphed(*args), fn(*args))
    assert len(graphed.graphs()) == 2


@torch.no_grad()
def test_static_refuses_another_structure_and_names_exact(backend: Backend) -> None:
    graphed = backend.wrap(_masked, warmup=1)
    x = backend.randn(5)
    graphed(x, mask=None)
    hint = 'make the CudaGraphModule with shapes="exact" (a graph per structure'
    with pytest.raises(InputMismatchError, match=re.escape('kwargs["mask"] of type NoneType')):
        graphed(x, mask=backend.randn(5))
    with pytest.raises(InputMismatchError, match=re.escape(hint)):
        graphed(x, mask=backend.randn(5))
    with pytest.raises(InputMismatchError, match=re.escape('missing: kwargs["mask"]')):
        graphed(x)
    with pytest.raises(InputMismatchError, match=re.escape(hint)):
        graphed(x)
