"""Graphs per device: a wrapper made without ``device=`` follows its inputs to their device.

A graph reads and writes one device's memory, and replays on that device's current stream.
A call whose inputs sit on another CUDA device than the wrapper's graphs gets graphs of its
own there (warmed up and captured on that device's side stream), when the function can
follow: none of the parameters, buffers, tensor attributes or optimizer state it reaches
sits on another CUDA device. When it cannot, the call raises before anything runs, naming
the input and the state that disagree (an eager call would fail inside the function).
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import inputs as _errors
from .._state.search import find_state
from .._state.state import modules_followed
from .._values.tree import Call


def call_device(leaves: list[Any], fixed: Any) -> torch.device:
    """The device of a call's graphs: the wrapper's ``device=`` (``fixed``) if given with an
    index, else the device of the first CUDA tensor of the call's ``leaves``, else the
    current CUDA device."""
    if fixed is not None and fixed.index is not None:
        return fixed  # type: ignore[no-any-return]
    if fixed is None:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                return leaf.device
    return torch.device("cuda", torch.cuda.current_device())


def first_on(device: torch.device, call: Call) -> str:
    """The path of the first tensor input on ``device`` (the one a call followed)."""
    for path, leaf in zip(call.paths(), call.leaves, strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.device == device:
            return path
    return "the current CUDA device"


def check_follows(
    name: str,
    fn: Any,
    device: torch.device,
    home: torch.device,
    call: Call,
) -> None:
    """Raise if ``fn`` reaches state on another CUDA device than ``device``, where a call
    asks for new graphs while the wrapper's others are on ``home``."""
    optimizers, modules = find_state(fn)
    tensors = [(e[0], e[3]) for e in modules_followed(modules) if isinstance(e[3], torch.Tensor)]
    for path, opt in optimizers.items():
        for i, state in enumerate(opt.state.values()):
            tensors.extend(
                (f"{path}.state[{i}][{key!r}]", t)
                for key, t in state.items()
                if isinstance(t, torch.Tensor)
            )
    for path, t in tensors:
        if t.device.type == "cuda" and t.device != device:
            where = first_on(device, call)
            raise _errors.cannot_follow(name, where, home, device, path, t.device)
