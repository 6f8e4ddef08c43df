"""The log records of `logging.getLogger("cudagraph_td")`: captures, recaptures, eager calls,
and the hint for a graph captured for autograd whose backward never runs."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from cudagraph_td import Buckets, Exact, GraphLimitWarning, RecaptureWarning

from .conftest import Backend

LOGGER = "cudagraph_td"


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int, str]]:
    """The library's records (its logger's, and any child's), not torch's."""
    return [
        (r.name, r.levelno, r.getMessage())
        for r in caplog.records
        if r.name.split(".")[0] == LOGGER
    ]


def test_the_library_adds_no_handler() -> None:
    # A program that configures no logging sees the WARNING records only (through logging's
    # last resort), and one that does decides where every record goes.
    import cudagraph_td._errors.log as log

    assert log.logger is logging.getLogger(LOGGER)
    assert log.logger.handlers == []


@torch.no_grad()
def test_a_capture_is_logged_and_a_replay_is_not(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2, shapes=Exact())
    graphed(backend.randn(8, 4))
    graphed(backend.randn(8, 4))
    (warmup, capture) = _records(caplog)
    label = "CudaGraphModule(Linear), mode 'no_grad, train', key ((8, 4),)"
    assert warmup == (LOGGER, logging.DEBUG, f"{label}: warm-up call 1 of 1 (eager).")
    assert capture[:2] == (LOGGER, logging.INFO)
    # The static buffers: the input (8 x 4) and the output (8 x 2), float32.
    memory = r"static inputs and outputs 192 bytes"
    if backend.name == "cuda":
        memory += r", CUDA memory reserved \+?-?[\d.]+ (bytes|KiB|MiB)"
    pattern = rf"{re.escape(label)}: captured a graph in [\d.]+ ms; {memory}\."
    assert re.fullmatch(pattern, capture[2]), capture[2]
    caplog.clear()
    for _ in range(3):
        graphed(backend.randn(8, 4))
    assert _records(caplog) == []  # the replay path logs nothing


def test_a_capture_for_autograd_names_its_two_graphs(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    def policy(x: torch.Tensor) -> torch.Tensor:
        return net(x).tanh()

    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(policy, warmup=1)
    graphed(backend.randn(8, 4)).sum().backward()
    ((name, level, message),) = _records(caplog)
    assert (name, level) == (LOGGER, logging.INFO)
    assert message.startswith(
        "CudaGraphModule(policy), mode 'grad': captured a forward and a backward graph "
        "(autograd) in "
    )


@torch.no_grad()
def test_a_recapture_is_logged_with_its_reason(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=1)
    graphed(backend.randn(8, 4))
    net.weight = nn.Parameter(torch.randn(2, 4, device=backend.device))
    caplog.clear()
    with pytest.warns(RecaptureWarning) as warned:
        x = backend.randn(8, 4)
        torch.testing.assert_close(graphed(x), net(x))
    recapture, capture = _records(caplog)
    label = "CudaGraphModule(Linear), mode 'no_grad, train'"
    assert recapture == (
        LOGGER,
        logging.INFO,
        f"{label}: captured again (from the warm-up): `module.weight` changed.",
    )
    assert "`module.weight`" in str(warned[0].message)  # which says why, the record once
    assert capture[1] == logging.INFO and capture[2].startswith(f"{label}: captured a graph in")


@torch.no_grad()
def test_eager_calls_are_logged_with_their_reason(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    graphed = backend.wrap(torch.tanh, warmup=1, shapes=Buckets([4, 8]))
    graphed(backend.randn(8, 2))
    caplog.clear()
    label = "CudaGraphModule(tanh), mode 'no_grad'"
    with pytest.warns(GraphLimitWarning, match="above its largest bucket 8"):
        graphed(backend.randn(9, 2))
    graphed(backend.randn(9, 2))
    assert _records(caplog) == [
        (
            LOGGER,
            logging.INFO,
            f"{label}: a call ran eagerly (above the largest bucket); 1 such call(s) so far.",
        ),
        (
            LOGGER,
            logging.DEBUG,
            f"{label}: a call ran eagerly (above the largest bucket); 2 such call(s) so far.",
        ),
    ]


HINT = (
    "was captured for autograd (grad mode was on, and its outputs require grad), and replayed "
    "100 times without a backward: each replay builds an autograd node that only a backward "
    "of the last replay could use. If these calls collect data or run inference, call the "
    "wrapper under `torch.no_grad()` (or `torch.inference_mode()`): it then replays a plain "
    "graph, without autograd."
)


def test_a_graph_for_autograd_whose_backward_never_runs_gives_a_hint_once(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    # A collector that forgot `torch.no_grad()`: the policy has trainable parameters, so its
    # graph is captured for autograd, and no backward ever runs.
    caplog.set_level(logging.WARNING, logger=LOGGER)
    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    for calls in range(1, 251):
        x = backend.randn(8, 4)
        out = graphed(x)
        if calls == 101:  # the capture (call 2) and 99 replays: no hint yet
            assert _records(caplog) == []
    torch.testing.assert_close(out, net(x))
    ((name, level, message),) = _records(caplog)
    assert (name, level) == (LOGGER, logging.WARNING)
    assert message == f"CudaGraphModule(Linear), mode 'grad, train' {HINT}"


@pytest.mark.parametrize("when", ["backward", "no_grad"])
def test_no_hint_when_a_backward_runs_or_under_no_grad(
    backend: Backend, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    net = nn.Linear(4, 2).to(backend.device)
    graphed = backend.wrap(net, warmup=2)
    for calls in range(250):
        x = backend.randn(8, 4)
        # The last result dropped before the next call, as Sharp edges asks: on CUDA, one
        # kept alive from a warm-up keeps its parameters' AccumulateGrad nodes of the side
        # stream, and torch warns once a process at the first backward of a replay.
        out = None
        if when == "no_grad":
            with torch.no_grad():
                out = graphed(x)
        else:
            out = graphed(x)
            if calls == 5:  # one backward is enough: the calls train
                out.sum().backward()
    torch.testing.assert_close(out, net(x))
    # The capture's record alone: no hint.
    ((name, level, message),) = _records(caplog)
    mode = "no_grad, train': captured a graph" if when == "no_grad" else "grad, train': captured a"
    assert (name, level) == (LOGGER, logging.INFO)
    assert message.startswith(f"CudaGraphModule(Linear), mode '{mode}")
