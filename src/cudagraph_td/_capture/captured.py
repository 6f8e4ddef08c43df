"""A captured call: what every replay path needs of it, and its checked replay.

A capture (`_capture.graph.capture`) builds a captured call complete: a plain graph
(`_capture.graph.GraphCall`) or a forward and backward pair in one autograd node
(`_capture.autograd.DifferentiableCall`). ``Captured`` is what they have in common, which
the replay paths (`_call.replay`) and the graphs of several shapes (`_shapes`) read; ``call``
is the slow path's replay of one: the full check, which raises the error naming the leaf,
then the launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._state.state import State
from .._values.input_views import InputViews, into_callers
from .._values.outputs import Outputs
from .._values.signature import Signature

Args = tuple[Any, ...]
Kwargs = dict[str, Any]

# A plain graph with one tensor in and one out and nothing else to do: its static input
# list, static output and replay, which the replay path launches itself, without a call.
Bare = tuple[list[torch.Tensor], torch.Tensor, Callable[[], None]]


class Captured(Protocol):
    """A captured call, built complete at capture: what every replay path needs of it."""

    signature: Signature  # the inputs: static buffers, the full check and its errors
    outputs: Outputs  # the outputs: their structure, and the static tensors
    state: State | None  # the parameters, buffers, optimizers it reads (see `_state.state`)
    training_step: bool  # whether it updates parameters (a step cannot be verified)
    bare: Bare | None
    input_views: InputViews | None  # outputs that are inputs or views of them, if any

    def launch(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Replay on checked input tensors; return the output tensors in fresh memory."""
        ...


def call(captured: Captured, args: Args, kwargs: Kwargs) -> Any:
    """The slow path: the full check (which raises the error naming the leaf), then a replay."""
    tensors = captured.signature.match(args, kwargs)
    # A TensorDict argument returned: the caller's, its written entries set (see `IntoCallers`).
    return into_callers(args, kwargs, captured.outputs.rebuild(captured.launch(tensors)))
