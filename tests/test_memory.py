"""The memory rule: what a replay overwrites, for every set of graphs that share memory.

A borrowed output is valid until the next replay of the graph that lent it, whichever other
graph replays meanwhile: another shape's or bucket's graph of the wrapper, its graph of
another mode, its training step's, another wrapper's that shares its pool
(``pool=``), another callable's of one ``make_graphed_callables``. A handed-out input buffer
holds what was last put into it. Each test interleaves graphs that share memory and reads
what was kept, with the same body on the CPU emulation and on CUDA: eager's values, or the
documented error, never other values. Also here: the emulation's lent tensors under the
copies that CUDA makes (``.cpu()``, ``copy.deepcopy``, pickling), and padding that no data
can fool (``Buckets``' row check).
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections.abc import Callable

import pytest
import torch
from tensordict import TensorDict

from cudagraph_td import Buckets, Exact

from .conftest import Backend, regression_step

OVERWRITTEN = "has overwritten it: a borrowed output, and every view of it, is valid until"


def _net(backend: Backend, width: int = 64) -> torch.nn.Module:
    # Linear-Tanh-Linear-Tanh-Linear: intermediates larger than its output, as in the report.
    net = torch.nn.Sequential(
        torch.nn.Linear(4, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 2),
    )
    return net.to(backend.device)


def _calls(graphed: Callable[..., torch.Tensor], x: torch.Tensor, n: int = 3) -> torch.Tensor:
    for _ in range(n):
        y = graphed(x)
    return y


@torch.no_grad()
@pytest.mark.parametrize("first", [8, 5], ids=["larger-first", "smaller-first"])
def test_another_shapes_replay_leaves_a_borrowed_output(backend: Backend, first: int) -> None:
    # The report's pattern: one shape's graph captured and replayed, then another's, whose
    # output is kept while the first shape's graph replays.
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed", shapes=Exact())
    second = 13 - first
    _calls(graphed, backend.randn(first, 4))
    x = backend.randn(second, 4)
    kept = _calls(graphed, x)
    for _ in range(3):
        graphed(backend.randn(first, 4))
    torch.testing.assert_close(kept, net(x))


@torch.no_grad()
def test_another_buckets_replay_leaves_a_borrowed_output(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed", shapes=Buckets([8, 16]))
    for rows in (8, 8, 8, 16, 16, 16):
        graphed(backend.randn(rows, 4))
    x = backend.randn(5, 4)  # bucket 8
    kept = _calls(graphed, x)
    graphed(backend.randn(16, 4))
    graphed(backend.randn(13, 4))  # bucket 16 again, padded
    torch.testing.assert_close(kept, net(x))
    graphed(backend.randn(7, 4))  # bucket 8: the graph that lent it
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        kept.sum()


@torch.no_grad()
def test_a_wrapper_sharing_anothers_pool_keeps_its_borrowed_output(backend: Backend) -> None:
    net1, net2 = _net(backend), _net(backend)
    first = backend.wrap(net1, outputs="borrowed")
    _calls(first, backend.randn(8, 4))
    second = backend.wrap(net2, outputs="borrowed", pool=first.pool())
    x = backend.randn(8, 4)
    kept = _calls(second, x)
    for _ in range(3):
        first(backend.randn(8, 4))
    torch.testing.assert_close(kept, net2(x))


def test_the_other_modes_replay_leaves_a_borrowed_output(backend: Backend) -> None:
    net = _net(backend)
    twin = copy.deepcopy(net)
    graphed = backend.wrap(net, outputs="borrowed")
    x = backend.randn(8, 4)
    with torch.no_grad():
        kept = _calls(graphed, x)  # the no_grad graph's
    for _ in range(3):  # the grad-mode graph's, with its backward
        graphed(backend.randn(8, 4)).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(kept, twin(x))
        kept_in_no_grad = kept
    y = graphed(x)  # grad mode: kept while the no_grad graph replays
    with torch.no_grad():
        graphed(backend.randn(8, 4))
        torch.testing.assert_close(y.detach(), twin(x))
        graphed(backend.randn(8, 4))  # the no_grad graph's next replay
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        kept_in_no_grad.sum()


def test_a_training_steps_losses_across_its_shapes(backend: Backend) -> None:
    net = torch.nn.Linear(5, 1).to(backend.device)
    twin = copy.deepcopy(net)
    step, _ = regression_step(backend, net)
    twin_step, _ = regression_step(backend, twin)
    graphed = backend.wrap(step, outputs="borrowed", shapes=Exact())

    def data(rows: int) -> TensorDict:
        return TensorDict(
            obs=backend.randn(rows, 5), target=backend.randn(rows, 1), batch_size=[rows]
        )

    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rows in (16, 16, 16, 8, 8, 8, 16, 16, 8, 16):
        batch = data(rows)
        loss = graphed(batch)["loss"]
        expected = twin_step(batch.clone())["loss"]
        torch.testing.assert_close(loss, expected)
        kept[rows] = (loss, expected)
        other = kept.get(24 - rows)
        if other is not None:  # the other shape's last loss, through this replay
            torch.testing.assert_close(*other)


def test_make_graphed_callables_outputs_across_its_callables(backend: Backend) -> None:
    nets = [_net(backend), _net(backend)]
    twins = [copy.deepcopy(n) for n in nets]
    samples = ((backend.randn(8, 4),), (backend.randn(8, 4),))
    graphed = backend.graph_callables(tuple(nets), samples, outputs="borrowed")
    x0, x1 = backend.randn(8, 4), backend.randn(8, 4)
    y0 = graphed[0](x0)
    y1 = graphed[1](x1)
    y1.sum().backward()
    y0.sum().backward()
    for _ in range(2):  # the other callable's graphs replay, forward and backward
        nets[1].zero_grad(set_to_none=True)  # its lent gradients are not accumulated into
        graphed[1](backend.randn(8, 4)).sum().backward()
    torch.testing.assert_close(y0.detach(), twins[0](x0).detach())


def test_a_borrowed_gradient_kept_or_accumulated(backend: Backend) -> None:
    # torch's loop keeps `.grad` until the next backward; keeping it longer, or accumulating
    # into it, gives eager's values or the documented error: never the next gradient.
    net = _net(backend)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(8, 4),), outputs="borrowed")
    x1, x2 = backend.randn(8, 4), backend.randn(8, 4) * 3
    net.zero_grad(set_to_none=True)
    graphed(x1).sum().backward()
    kept = net[0].weight.grad
    assert kept is not None
    net.zero_grad(set_to_none=True)
    graphed(x2).sum().backward()
    (first,) = torch.autograd.grad(twin(x1).sum(), twin[0].weight)
    try:
        value = kept.clone()
    except RuntimeError as err:  # CUDA: the storage is the graph's, and it was overwritten
        assert re.search(OVERWRITTEN, str(err))
    else:  # the emulation: autograd took it in memory of its own
        assert backend.name == "emulate"
        torch.testing.assert_close(value, first)
    # Two micro-batches accumulated after `zero_grad(set_to_none=True)`.
    net.zero_grad(set_to_none=True)
    graphed(x1).sum().backward()
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        graphed(x2).sum().backward()


@torch.no_grad()
def test_input_buffers_hold_what_was_put_in_them(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed", shapes=Exact())
    for rows in (8, 5):
        _calls(graphed, backend.randn(rows, 4))
    (buffer8,), _ = graphed.input_buffers(backend.randn(8, 4))
    (buffer5,), _ = graphed.input_buffers(backend.randn(5, 4))
    buffer8.copy_(backend.randn(8, 4))
    buffer5.copy_(backend.randn(5, 4))
    put8, put5 = buffer8.clone(), buffer5.clone()
    y5 = graphed(buffer5)
    for _ in range(3):
        graphed(buffer8)
    torch.testing.assert_close(buffer5, put5)
    torch.testing.assert_close(buffer8, put8)
    torch.testing.assert_close(y5, net(put5))


# --- the emulation's lent tensors under the copies CUDA makes --------------------------------


@torch.no_grad()
def test_copies_of_a_borrowed_output_where_cuda_copies(backend: Backend) -> None:
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed")
    x = backend.randn(8, 4)
    out = _calls(graphed, x)
    expected = net(x).cpu()
    host = out.cpu()
    array = out.cpu().numpy()
    moved = out.to("cpu")
    deep = copy.deepcopy(out)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    pickled = pickle.dumps(out)
    alias = copy.copy(out)  # a tensor over the same memory, on CUDA too
    graphed(backend.randn(8, 4))
    for each in (host, moved, deep.cpu(), torch.from_numpy(array)):
        assert type(each) is torch.Tensor
        torch.testing.assert_close(each, expected)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer).cpu(), expected)
    torch.testing.assert_close(pickle.loads(pickled).cpu(), expected)
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        alias.sum()
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        out.cpu()


@torch.no_grad()
def test_a_gym_loop_keeps_its_actions_as_arrays(backend: Backend) -> None:
    # The docs' loop: each action used before the next call, through `.cpu()`.
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed")
    kept, expected = [], []
    for _ in range(6):
        obs = backend.randn(8, 4)
        kept.append(graphed(obs).cpu().numpy())
        expected.append(net(obs).cpu().numpy())
    for a, b in zip(kept, expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b))


# --- padding that no data can fool -----------------------------------------------------------

REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "amax": lambda x: x / x.abs().amax(0, keepdim=True),
    "max": lambda x: x - x.max(0, keepdim=True).values,
    "min": lambda x: x - x.min(0, keepdim=True).values,
    "sort": lambda x: x.sort(0).values,
    "topk": lambda x: x - x.topk(2, dim=0).values.sum(0, keepdim=True),
    "median": lambda x: x - x.median(0, keepdim=True).values,
    "logsumexp": lambda x: x - x.logsumexp(0, keepdim=True),
    "norm": lambda x: x / x.norm(dim=0, keepdim=True),
    "cummax": lambda x: x.cummax(0).values,  # causal: its real rows never see the padding
    "softmax": lambda x: x.softmax(0),
    "mean": lambda x: x - x.mean(0, keepdim=True),
}
BATCHES = (8, 8, 8, 5, 3, 8, 13, 7, 16, 9)
PADDING = "the rows of output that the call keeps changed when only the padded rows did"


@torch.no_grad()
@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_no_data_fools_the_padding_check(backend: Backend, reduction: str) -> None:
    # The report's sequence of batches, on many seeds: every call gives eager's rows, or
    # the padding error, whatever the values drawn.
    fn = REDUCTIONS[reduction]
    seeds = 200 if backend.name == "emulate" else 25
    refused = 0
    for seed in range(seeds):
        torch.manual_seed(seed)
        graphed = backend.wrap(fn, shapes=Buckets([8, 16]))
        for rows in BATCHES:
            x = backend.randn(rows, 4) * 3 + 1
            try:
                y = graphed(x)
            except RuntimeError as err:
                assert PADDING in str(err)
                refused += 1
                break
            torch.testing.assert_close(y, fn(x), msg=lambda m: f"seed {seed}, {rows} rows: {m}")  # noqa: B023
    if reduction == "cummax":
        assert refused == 0
    else:  # refused at the first padded call, on every seed
        assert refused == seeds


def test_input_buffers_are_the_current_modes_graphs(backend: Backend) -> None:
    # A wrapper with a grad-mode and a no_grad graph of one shape: under no_grad, the no_grad
    # graph's buffer, which its calls read in place (not the other's, which they copy into).
    net = _net(backend)
    graphed = backend.wrap(net, outputs="borrowed")
    x = backend.randn(8, 4)
    _calls(lambda t: graphed(t).sum().backward(), x)
    with torch.no_grad():
        _calls(graphed, x)
        (buffer,), _ = graphed.input_buffers(x)
        put = backend.randn(8, 4)
        graphed(put)  # copied into the no_grad graph's buffer
        torch.testing.assert_close(buffer, put)
        buffer.copy_(backend.randn(8, 4))
        put = buffer.clone()
        torch.testing.assert_close(graphed(buffer), net(put))
    graphed(backend.randn(8, 4))  # the grad-mode graph's call leaves it
    torch.testing.assert_close(buffer, put)
