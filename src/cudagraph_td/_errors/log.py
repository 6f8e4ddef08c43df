"""The log records of a wrapper: captures, recaptures, calls that ran eagerly, and the hint
for a graph captured for autograd whose backward never runs.

Everything goes to ``logging.getLogger("cudagraph_td")``, and only from the slow path (a
warm-up, a capture, an eager call): a replay logs nothing. The library adds no handler, so
that a program which configures no logging still sees the one WARNING (through logging's
last resort, on stderr) and none of the INFO or DEBUG records. To see them::

    logging.basicConfig()
    logging.getLogger("cudagraph_td").setLevel(logging.INFO)  # DEBUG: every eager call too
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger("cudagraph_td")

# How many replays of a graph captured for autograd, none of them followed by a backward,
# make the hint that the calls may belong under `torch.no_grad()`.
NO_BACKWARD_REPLAYS = 100


def function_name(fn: Any) -> str:
    """What a log record calls the wrapped function: its name, or its module's class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return str(getattr(fn, "__name__", None) or type(fn).__name__)


def graph_label(name: str, fn: Any, mode: str) -> str:
    """The graphs of one mode of a wrapper, as records name them:
    ``CudaGraphModule(policy), mode 'no_grad, eval'``."""
    return f"{name}({function_name(fn)}), mode {mode!r}"


def _size(n: int) -> str:
    if abs(n) < 1 << 10:
        return f"{n} bytes"
    if abs(n) < 1 << 20:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"


def static_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of a graph's static buffers (inputs and outputs): what the graph holds on
    any backend, measured without touching the device."""
    return sum(t.numel() * t.element_size() for t in tensors)


def captured(
    label: str, autograd: bool, elapsed: float, buffers: int, reserved: int | None
) -> None:
    """INFO: a graph captured (``elapsed`` in seconds; ``reserved``: the growth of the
    device's reserved memory during the capture, None off CUDA)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    kind = "a forward and a backward graph (autograd)" if autograd else "a graph"
    memory = f"static inputs and outputs {_size(buffers)}"
    if reserved is not None:
        memory += f", CUDA memory reserved {'+' if reserved >= 0 else ''}{_size(reserved)}"
    logger.info("%s: captured %s in %.1f ms; %s.", label, kind, elapsed * 1e3, memory)


def warmed_up(label: str, done: int, warmups: int) -> None:
    """DEBUG: a warm-up call, run eagerly before the capture."""
    logger.debug("%s: warm-up call %d of %d (eager).", label, done, warmups)


def recapturing(label: str, changed: str) -> None:
    """INFO: a graph dropped for a new capture, with the paths of the state ``changed`` (the
    ``RecaptureWarning`` says why, once)."""
    logger.info("%s: captured again (from the warm-up): %s changed.", label, changed)


def ran_eagerly(label: str, reason: str, calls: int) -> None:
    """INFO for the first call of a ``reason`` that ran eagerly, DEBUG for the next ones."""
    level = logging.INFO if calls == 1 else logging.DEBUG
    logger.log(level, "%s: a call ran eagerly (%s); %d such call(s) so far.", label, reason, calls)


def no_backward(label: str, replays: int) -> None:
    """WARNING, once per graph: a graph captured for autograd replayed ``replays`` times and
    none was followed by a backward."""
    logger.warning(
        "%s was captured for autograd (grad mode was on, and its outputs require grad), and "
        "replayed %d times without a backward: each replay builds an autograd node that only "
        "a backward of the last replay could use. If these calls collect data or run "
        "inference, call the wrapper under `torch.no_grad()` (or `torch.inference_mode()`): "
        "it then replays a plain graph, without autograd.",
        label,
        replays,
    )
