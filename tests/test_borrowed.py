"""Borrowed outputs (``outputs="borrowed"``) and inputs in place (``input_buffers``).

Every test body runs on the CPU emulation and, with a GPU, on CUDA: a borrowed output has
eager's value until its graph's next replay, and every use of it (or of a view of it) after
that raises an error that names the wrapper and the fix, on both backends.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import random
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from cudagraph_td import CudaGraphModule, _compat
from cudagraph_td._call import module as _module
from cudagraph_td._capture import backend as _backend
from cudagraph_td._capture import captured as _captured

from .conftest import Backend, regression_step

OVERWRITTEN = "has overwritten it: a borrowed output, and every view of it, is valid until"
GONE = "that graph is gone"
FIX = "`.clone()` the outputs you keep across calls"


def _policy(backend: Backend) -> tuple[torch.nn.Module, CudaGraphModule]:
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net = net.to(backend.device)
    return net, backend.wrap(net, outputs="borrowed")


def _warm(graphed: Callable[..., Any], make: Callable[[], Any], calls: int = 3) -> None:
    for _ in range(calls):
        graphed(make())


# --- values -------------------------------------------------------------------------------


@torch.no_grad()
def test_a_borrowed_output_has_eagers_value_until_the_next_replay(backend: Backend) -> None:
    net, graphed = _policy(backend)
    _warm(graphed, lambda: backend.randn(4, 5))
    for _ in range(3):
        x = backend.randn(4, 5)
        y = graphed(x)
        torch.testing.assert_close(y, net(x))
        kept = y.clone()  # what a caller keeps across calls
        graphed(backend.randn(4, 5))
        torch.testing.assert_close(kept, net(x))


@torch.no_grad()
def test_borrowed_outputs_of_several_tensors_and_a_tree(backend: Backend) -> None:
    lin = torch.nn.Linear(5, 3).to(backend.device)

    def fn(x: torch.Tensor) -> dict[str, Any]:
        y = lin(x)
        return {"y": y, "parts": (y[:, :1] * 2, y.sum()), "n": 3}

    graphed = backend.wrap(fn, outputs="borrowed")
    _warm(graphed, lambda: backend.randn(4, 5))
    x = backend.randn(4, 5)
    out = graphed(x)
    expected = fn(x)
    torch.testing.assert_close(out["y"], expected["y"])
    torch.testing.assert_close(out["parts"][0], expected["parts"][0])
    torch.testing.assert_close(out["parts"][1], expected["parts"][1])
    assert out["n"] == 3
    graphed(backend.randn(4, 5))
    for t in (out["y"], out["parts"][0], out["parts"][1]):
        with pytest.raises(RuntimeError, match=OVERWRITTEN):
            t.sum()


@torch.no_grad()
def test_a_tensordict_module_writes_borrowed_entries_into_the_callers_tensordict(
    backend: Backend,
) -> None:
    net = torch.nn.Linear(5, 3).to(backend.device)
    policy = backend.wrap(TensorDictModule(net, ["obs"], ["action"]), outputs="borrowed")

    def td() -> TensorDict:
        return TensorDict(obs=backend.randn(4, 5), batch_size=[4], device=backend.device)

    _warm(policy, td)
    data = td()
    out = policy(data)
    assert out is data
    torch.testing.assert_close(out["action"], net(data["obs"]))
    action = policy(obs=backend.randn(4, 5))  # keywords: the out_key's value
    assert action.shape == (4, 3)
    policy(td())
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        data["action"] + 1
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        action + 1


def test_a_training_step_returns_borrowed_losses(backend: Backend) -> None:
    net = torch.nn.Linear(5, 1).to(backend.device)
    twin = copy.deepcopy(net)
    step, _ = regression_step(backend, net)
    twin_step, _ = regression_step(backend, twin)
    graphed = backend.wrap(step, outputs="borrowed")
    losses = []
    for _ in range(5):
        data = TensorDict(obs=backend.randn(8, 5), target=backend.randn(8, 1), batch_size=[8])
        loss = graphed(data)["loss"]
        torch.testing.assert_close(loss, twin_step(data.clone())["loss"])
        losses.append(loss)
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        losses[-2].item()


@torch.no_grad()
def test_exact_and_buckets_lend_per_graph(backend: Backend) -> None:
    lin = torch.nn.Linear(5, 3).to(backend.device)
    for shapes in ("exact", "buckets"):
        graphed = backend.wrap(lin, outputs="borrowed", shapes=shapes)
        for rows in (4, 8, 3) * 3:
            graphed(backend.randn(rows, 5))
        x8, x4 = backend.randn(8, 5), backend.randn(3, 5)
        y8 = graphed(x8)
        y4 = graphed(x4)  # another graph (exact), or another rows' view of one (buckets)
        torch.testing.assert_close(y4, lin(x4))
        if shapes == "exact":  # each graph's outputs last until its own next replay
            torch.testing.assert_close(y8, lin(x8))
        graphed(backend.randn(3, 5))
        with pytest.raises(RuntimeError, match=OVERWRITTEN):
            y4.sum()


def test_grad_mode_outputs_are_borrowed_through_autograd(backend: Backend) -> None:
    net, graphed = _policy(backend)
    twin = copy.deepcopy(net)
    _warm(lambda x: graphed(x).sum().backward(), lambda: backend.randn(4, 5))
    net.zero_grad(set_to_none=True)
    x = backend.randn(4, 5)
    y = graphed(x)
    torch.testing.assert_close(y, twin(x))
    y.pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    graphed(backend.randn(4, 5))
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        y.detach().sum()


def test_make_graphed_callables_lends_outputs_and_gradients(backend: Backend) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net = net.to(backend.device)
    twin = copy.deepcopy(net)
    graphed = backend.graph_callables(net, (backend.randn(16, 5),), outputs="borrowed")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(4):  # torch's documented loop
        x = backend.randn(16, 5)
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
        y, expected = graphed(x), twin(x)
        torch.testing.assert_close(y.detach(), expected.detach(), rtol=1e-4, atol=1e-5)
        y.pow(2).mean().backward()
        expected.pow(2).mean().backward()
        opt.step()
        twin_opt.step()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    graphed(backend.randn(16, 5))
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        y.detach().sum()


@torch.no_grad()
def test_a_borrowed_output_fed_back_as_the_next_calls_input(backend: Backend) -> None:
    # A recurrent state: the call reads it before its replay overwrites it.
    lin = torch.nn.Linear(4, 4).to(backend.device)

    def step(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(x) + h)

    graphed = backend.wrap(step, outputs="borrowed")
    h = expected = backend.randn(2, 4)
    for _ in range(6):
        x = backend.randn(2, 4)
        h, expected = graphed(x, h), step(x, expected)
        torch.testing.assert_close(h, expected)


@torch.no_grad()
def test_a_borrowed_output_updated_in_place_as_an_input_raises(backend: Backend) -> None:
    # Its memory is the graph's output memory, which the replay has just overwritten with
    # the new output: the in-place update cannot reach it. A clone of it can be updated.
    def bump(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h.add_(1)
        return h * 2 + x

    graphed = backend.wrap(bump, outputs="borrowed")
    h = backend.randn(3)
    _warm(lambda x: graphed(x, h.clone()), lambda: backend.randn(3))
    y = graphed(backend.randn(3), h.clone())
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        graphed(backend.randn(3), y)
        backend.sync()
    kept = graphed(backend.randn(3), h.clone()).clone()
    before, x = kept.clone(), backend.randn(3)
    torch.testing.assert_close(graphed(x, kept), (before + 1) * 2 + x)
    torch.testing.assert_close(kept, before + 1)  # the update reached the caller's tensor


# --- every use after overwrite raises -----------------------------------------------------


def _uses(backend: Backend) -> dict[str, Callable[[torch.Tensor], Any]]:
    other = backend.wrap(lambda t: t * 2)
    with torch.no_grad():
        _warm(other, lambda: backend.randn(4, 3))
    weight = backend.randn(4, 3, requires_grad=True)
    return {
        "read": lambda y: y + 1,
        "a view's read": lambda y: y[0].sum(),
        "a view taken before": None,  # see the test
        "an in-place op": lambda y: y.mul_(2),
        ".cpu()": lambda y: y.cpu(),
        "print": lambda y: print(y),
        "torch.save": lambda y: torch.save(y, io.BytesIO()),
        ".tolist()": lambda y: y.tolist(),
        "a DLPack export": lambda y: torch.from_dlpack(y),
        "another wrapper's input": lambda y: other(y),
        "autograd": lambda y: (y * weight).sum().backward(),
    }


@pytest.mark.parametrize(
    "use",
    [
        "read",
        "a view's read",
        "a view taken before",
        "an in-place op",
        ".cpu()",
        "print",
        "torch.save",
        ".tolist()",
        "a DLPack export",
        "another wrapper's input",
        "autograd",
    ],
)
def test_every_use_after_overwrite_raises(backend: Backend, use: str) -> None:
    _, graphed = _policy(backend)
    with torch.no_grad():
        _warm(graphed, lambda: backend.randn(4, 5))
        y = graphed(backend.randn(4, 5))
        view = y[1:, :2]
        uses = _uses(backend)
        graphed(backend.randn(4, 5))
    act = uses[use]
    message = re.escape("CudaGraphModule(Sequential)") + ".*" + OVERWRITTEN + ".*" + re.escape(FIX)
    with pytest.raises(RuntimeError, match=message):
        if act is None:
            view.sum()
        else:
            act(y)
        backend.sync()


def test_another_threads_call_overwrites_a_borrowed_output(backend: Backend) -> None:
    # "The next replay" is the next one by any caller: a wrapper shared by threads.
    net, graphed = _policy(backend)
    with torch.no_grad():
        _warm(graphed, lambda: backend.randn(4, 5))
        x, other = backend.randn(4, 5), backend.randn(4, 5)
        y = graphed(x)
        torch.testing.assert_close(y, net(x))  # valid until the next replay

        def call() -> None:
            with torch.no_grad():
                theirs.append(graphed(other).clone())

        theirs: list[torch.Tensor] = []
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        torch.testing.assert_close(theirs[0], net(other))
    with pytest.raises(RuntimeError, match=OVERWRITTEN):
        y.sum()
        backend.sync()


@pytest.mark.parametrize("end", ["reset", "deleted", "captured again"])
def test_an_output_of_a_graph_that_is_gone_raises(backend: Backend, end: str) -> None:
    net, graphed = _policy(backend)
    with torch.no_grad():
        _warm(graphed, lambda: backend.randn(4, 5))
        y = graphed(backend.randn(4, 5))
        view = y[0]
        if end == "reset":
            graphed.reset()
        elif end == "deleted":
            del graphed
        else:  # a replaced parameter: a new capture (warned), the old graph dropped
            net[0].weight = torch.nn.Parameter(net[0].weight.detach().clone())
            with pytest.warns(UserWarning):
                _warm(graphed, lambda: backend.randn(4, 5), calls=4)
            graphed.reset()  # the table's last reference to the old graph goes too
        gc.collect()
    for t in (y, view):
        with pytest.raises(RuntimeError, match=GONE):
            t.sum()


@pytest.mark.parametrize("end", ["reset", "deleted", "captured again"])
@pytest.mark.parametrize("shapes", ["static", "exact"])
def test_a_graph_still_held_elsewhere_ends_its_loans_when_it_goes(
    backend: Backend, end: str, shapes: str
) -> None:
    # Something else holds the graph (here the wrapper's table entries; in a soak, a
    # reference cycle that the garbage collector had not reached yet): its last outputs are
    # unreadable as soon as it goes, not when it is collected. The collector stays off.
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net = net.to(backend.device)
    graphed = backend.wrap(net, outputs="borrowed", shapes=shapes)
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            _warm(graphed, lambda: backend.randn(4, 5))
            y = graphed(backend.randn(4, 5))
            held = graphed._table.entries()
            assert held
            if end == "reset":
                graphed.reset()
            elif end == "deleted":
                del graphed
            else:  # a replaced parameter: the next call captures again (warned)
                net[0].weight = torch.nn.Parameter(net[0].weight.detach().clone())
                with pytest.warns(UserWarning, match="captured again"):
                    graphed(backend.randn(4, 5))
        with pytest.raises(RuntimeError, match=GONE):
            y.sum()
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("end", ["reset", "deleted"])
def test_borrowing_graphs_are_freed_without_the_garbage_collector(
    backend: Backend, end: str
) -> None:
    # With borrowed outputs, two shapes and the input buffers handed out, no reference
    # cycle keeps a graph alive once it goes: the collector off, its captured call is freed
    # at once, and its last output raises.
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net = net.to(backend.device)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        graphed = backend.wrap(net, outputs="borrowed", shapes="exact")
        with torch.no_grad():
            outputs = []
            for rows in (4, 8):
                _warm(graphed, lambda rows=rows: backend.randn(rows, 5))
                (buffers,), _ = graphed.input_buffers(backend.randn(rows, 5))
                buffers.copy_(backend.randn(rows, 5))
                outputs.append(graphed(buffers))
            calls = [weakref.ref(entry.captured) for entry in graphed._table.entries()]
            assert len(calls) == 2 and all(call() is not None for call in calls)
            del buffers
        if end == "reset":
            graphed.reset()
        else:
            del graphed
        assert [call() for call in calls] == [None, None]
        for y in outputs:
            with pytest.raises(RuntimeError, match=GONE):
                y.sum()
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("seed", range(8))
def test_a_random_run_keeps_every_loan_honest(backend: Backend, seed: int) -> None:
    # A sequence a real run makes, drawn at random (as scripts/soak.py draws it on CUDA):
    # calls of two shapes, some with the input buffers, resets and replaced parameters (new
    # captures), the garbage collector off. Every output is eager's; the previous output
    # of the graph that replayed raises; so does the last output before a reset, at once.
    rng = random.Random(seed)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    net = net.to(backend.device)
    graphed = backend.wrap(net, outputs="borrowed", shapes="exact", warmup=rng.choice([1, 2]))
    last: dict[int, torch.Tensor] = {}  # the last lent output of each graph, by its rows
    ending: dict[int, torch.Tensor] = {}  # those of graphs that the next call captures again
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(40):
            rows = rng.choice([4, 8])
            roll = rng.random()
            if roll < 0.1:  # every graph goes, and with them their last outputs
                graphed.reset()
                for gone in (*last.values(), *ending.values()):
                    with pytest.raises(RuntimeError, match=GONE):
                        gone.sum()
                last.clear()
                ending.clear()
            elif roll < 0.2:  # a replaced parameter: each graph is captured again (warned)
                net[0].weight = torch.nn.Parameter(net[0].weight.detach().clone())
                ending.update(last)  # each ends when its graph is captured again
                last.clear()
            x = backend.randn(rows, 5)
            before = sum(info.replays for info in graphed.graphs())
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the recaptures' warnings
                buffers = None
                if rng.random() < 0.3:
                    with contextlib.suppress(RuntimeError, ValueError):  # none of this shape yet
                        (buffers,), _ = graphed.input_buffers(x)
                if buffers is not None:
                    buffers.copy_(x)
                    y = graphed(buffers)
                else:
                    y = graphed(x)
                torch.testing.assert_close(y, net(x))
            gone = ending.pop(rows, None)
            if gone is not None:  # this call captured its graph again
                with pytest.raises(RuntimeError, match=GONE):
                    gone.sum()
            replayed = sum(info.replays for info in graphed.graphs()) > before
            previous = last.pop(rows, None)
            if replayed:
                if previous is not None:
                    with pytest.raises(RuntimeError, match=OVERWRITTEN):
                        previous.sum()
                last[rows] = y
            backend.sync()
    finally:
        if collecting:
            gc.enable()


@torch.no_grad()
def test_fresh_outputs_are_unchanged_by_the_option(backend: Backend) -> None:
    net = torch.nn.Linear(5, 3).to(backend.device)
    graphed = backend.wrap(net)
    _warm(graphed, lambda: backend.randn(4, 5))
    x = backend.randn(4, 5)
    y = graphed(x)
    graphed(backend.randn(4, 5))
    torch.testing.assert_close(y, net(x))  # a copy: the next replay leaves it


@torch.no_grad()
def test_the_option_shows_and_a_borrowed_output_prints_as_a_tensor(backend: Backend) -> None:
    _, graphed = _policy(backend)
    assert "outputs='borrowed'" in repr(graphed)
    _warm(graphed, lambda: backend.randn(4, 5))
    y = graphed(backend.randn(4, 5))
    assert repr(y).startswith("tensor(")  # the emulation's LentTensor too
    assert isinstance(y, torch.Tensor)


def test_outputs_takes_fresh_or_borrowed() -> None:
    with pytest.raises(ValueError, match=re.escape("`outputs` must be one of 'fresh', 'borrowed'")):
        CudaGraphModule(torch.nn.Linear(2, 2), backend="emulate", outputs="lent")  # type: ignore[arg-type]


def test_a_torch_that_cannot_lend_warns_and_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "CAN_BORROW", False)
    with pytest.warns(UserWarning, match="returns outputs in fresh memory"):
        assert not _backend.can_borrow("CudaGraphModule", "cuda")
    assert _backend.can_borrow("CudaGraphModule", "emulate")


# --- inputs in place ----------------------------------------------------------------------


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the multi-tensor copies of inputs into static buffers, from now on."""
    count = [0]
    copy_ = _compat.foreach_copy_

    def counted(dst: Any, src: Any) -> None:
        count[0] += 1
        copy_(dst, src)

    # Every launch copies its inputs in `_capture.captured` (`copy_inputs`, `launch_one`).
    monkeypatch.setattr(_captured, "foreach_copy_", counted)
    return count


@torch.no_grad()
@pytest.mark.parametrize("outputs", ["fresh", "borrowed"])
def test_an_input_in_its_buffer_is_not_copied(
    backend: Backend, outputs: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = torch.nn.Linear(5, 3).to(backend.device)
    policy = backend.wrap(TensorDictModule(net, ["obs"], ["action"]), outputs=outputs)

    def td() -> TensorDict:
        return TensorDict(obs=backend.randn(4, 5), batch_size=[4], device=backend.device)

    with pytest.raises(RuntimeError, match="no graph of the CudaGraphModule answers it yet"):
        policy.input_buffers()
    _warm(policy, td)
    (buffers,), kwargs = policy.input_buffers()
    assert kwargs == {} and isinstance(buffers, TensorDict)
    copies = _count_copies(monkeypatch)
    for _ in range(3):
        x = backend.randn(4, 5)
        buffers["obs"].copy_(x)
        out = policy(buffers)
        assert out is buffers
        torch.testing.assert_close(out["action"], net(x))
    assert copies == [0]
    policy(td())  # any other TensorDict is copied in, as before
    assert copies == [1]
    # Keyword calls get their buffers by name; the checks still run.
    args, named = policy.input_buffers(obs=backend.randn(4, 5))
    assert args == () and list(named) == ["obs"]
    with pytest.raises(ValueError, match="dtype"):
        policy(obs=named["obs"].double())


@torch.no_grad()
def test_input_buffers_of_a_function_in_the_calls_structure(backend: Backend) -> None:
    def fn(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x * scale

    graphed = backend.wrap(fn, shapes="exact")
    for rows in (4, 4, 4, 2, 2, 2):
        graphed(backend.randn(rows, 3), scale=backend.randn(1))
    with pytest.raises(ValueError, match="has 2 graphs"):
        graphed.input_buffers()
    (x,), kwargs = graphed.input_buffers(backend.randn(2, 3), scale=backend.randn(1))
    assert x.shape == (2, 3) and list(kwargs) == ["scale"]
    x.fill_(2.0)
    kwargs["scale"].fill_(3.0)
    torch.testing.assert_close(graphed(x, **kwargs), torch.full((2, 3), 6.0, device=backend.device))


def test_input_buffers_is_public() -> None:
    assert "input_buffers" in dir(_module.CudaGraphModule)
