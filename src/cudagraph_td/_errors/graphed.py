"""The messages about the arguments of ``make_graphed_callables``: samples, modules, autocast.

Beside `_errors.inputs` (inputs, captures), with the same rules: each says what was received and
how to fix it.
"""

from __future__ import annotations

from typing import Any

import torch


def sample_args_not_tuples(received: Any) -> TypeError:
    """``received``: the callable's sample arguments that are not a tuple (nor a list of
    tuples)."""
    got = f"a {type(received).__name__}"
    if isinstance(received, torch.Tensor):
        got = "a bare tensor: pass `(x,)`, a tuple of the arguments"
    elif isinstance(received, list) and any(isinstance(x, torch.Tensor) for x in received):
        got = "a list of tensors: pass a tuple of the arguments, or a list of such tuples"
    return TypeError(
        "`sample_args` must be a tuple of arguments for one callable (or a list of such "
        "tuples, one graph pair per shape), or a tuple of those for a tuple of callables; "
        f"got {got}."
    )


def sample_kwargs_not_dicts() -> TypeError:
    return TypeError(
        "`sample_kwargs` must be a dict (or a list of dicts, one per shape) for one callable, "
        "or a tuple of those."
    )


def sample_counts(callables: int, args: int, kwargs: int) -> TypeError:
    return TypeError(
        f"{callables} callables need as many sample argument tuples; got {args} "
        f"`sample_args` and {kwargs} `sample_kwargs`."
    )


def hooks_registered(module: str, where: str, kind: str) -> ValueError:
    return ValueError(
        f"make_graphed_callables({module}): {where} has {kind} hooks registered. Hooks cannot "
        "run inside a graph: register them after make_graphed_callables (they then run around "
        "the graphed forward), or remove them."
    )


def buffer_requires_grad(module: str, buffer: str) -> ValueError:
    return ValueError(
        f"make_graphed_callables({module}): the buffer `{buffer}` requires grad. Only "
        "parameters may be trainable: make it an `nn.Parameter`, or call "
        "`requires_grad_(False)` on it."
    )


def autocast_cache() -> RuntimeError:
    return RuntimeError(
        "make_graphed_callables cannot capture under autocast with its cache enabled: the "
        "cache would keep casts made during the capture. Use "
        "`torch.autocast(..., cache_enabled=False)`."
    )
