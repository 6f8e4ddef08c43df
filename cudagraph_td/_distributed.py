"""DistributedDataParallel around a graph: what its capture needs, checked up front.

A training step that calls a DDP module captures its gradients' all-reduce too (NCCL 2.9.6
or later). torch's recipe for it, which the wrapper applies or asks for:

1. Eager DDP iterations before the capture: DDP rebuilds its gradient buckets after its
   first iteration, and torch asks for 11 (``warmup=12``: 11 warm-ups, then the capture).
2. The capture in the ``"thread_local"`` error mode: the process group's watchdog thread
   polls its collectives' events while a step is captured, which the ``"global"`` mode
   forbids (the capture fails on one rank, and the others wait for it).
3. DDP built on the capture stream (:func:`capture_stream`): DDP keeps the parameters'
   gradient accumulators, which autograd ties to the stream they were made on.

4. The same graphs on every rank (each replay runs the captured collectives): only
   ``shapes="static"``.

Checked when the wrapper is made, from the objects that the function reaches: every rank
makes the same wrapper, so every rank raises the same error, and none waits for another.
A DDP module wrapped directly (a forward in grad mode) is refused: its backward hooks need
the forward that DDP runs, which a replay skips.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from . import _training
from ._shapes import ShapeOptions

DDP_WARMUP = 12
"""The least ``warmup`` for a step that calls a DDP module: 11 eager iterations, a capture."""


def ddp_paths(fn: Any) -> list[str]:
    """The paths of the DistributedDataParallel modules that ``fn`` reaches."""
    modules = _training.find_state(fn)[1]
    return [path for path, m in modules.items() if isinstance(m, DistributedDataParallel)]


def checked_mode(name: str, fn: Any, warmup: int, mode: str, options: ShapeOptions) -> str:
    """The capture error mode for ``fn``: ``mode``, or ``"thread_local"`` for a function
    that calls a DDP module (see above), after checking what else that needs."""
    shapes = options.shapes
    if isinstance(fn, DistributedDataParallel):
        raise TypeError(
            f"{name} cannot replay a DistributedDataParallel module's forward: DDP's "
            "gradient hooks need the forward that DDP runs, which a replay skips. Graph the "
            "module before DDP wraps it (`DDP(make_graphed_callables(module, (sample,)))`), "
            "or capture the whole training step (forward, backward and `optimizer.step()`, "
            "see the Several GPUs page of the docs)."
        )
    paths = ddp_paths(fn)
    if not paths:
        return mode
    if warmup < DDP_WARMUP:
        raise ValueError(
            f"{name} captures a step that calls a DistributedDataParallel module "
            f"(`{paths[0]}`), with warmup={warmup}: DDP rebuilds its gradient buckets during "
            f"its first iterations, and its capture needs {DDP_WARMUP - 1} eager ones "
            f"before it. Pass `warmup={DDP_WARMUP}` or more."
        )
    if shapes != "static":
        raise ValueError(
            f"{name} captures a step that calls a DistributedDataParallel module "
            f"(`{paths[0]}`), with shapes={shapes!r}: each of its graphs holds collectives, "
            "so every rank must capture and replay the same graphs in the same order, and a "
            "rank whose batch has another size would pick another graph and wait for the "
            "others. Use shapes='static', with batches of one size on every rank (pad a short "
            "last batch, and mask its padded rows out of the loss)."
        )
    return "thread_local" if mode == "global" else mode
