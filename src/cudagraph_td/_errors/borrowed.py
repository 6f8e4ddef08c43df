"""The messages of borrowed outputs (``outputs="borrowed"``): an output used after its graph
overwrote it or let it go, and a torch that cannot lend.

Beside `_errors.inputs`, with the same rules: what was asked, why it cannot be done, the fix.
"""

from __future__ import annotations

_FIX = (
    "`.clone()` the outputs you keep across calls (before the next call), or make the "
    'wrapper with `outputs="fresh"` (the default), whose outputs are copies'
)


def overwritten(label: str, replay: int) -> str:
    return (
        f'{label}: this output was borrowed from its graph (`outputs="borrowed"`), and '
        f"the graph's replay {replay} has overwritten it: a borrowed output, and every view "
        f"of it, is valid until the next replay of its graph. {_FIX}."
    )


def released(label: str) -> str:
    return (
        f'{label}: this output was borrowed from its graph (`outputs="borrowed"`), and '
        "that graph is gone (the wrapper was reset or deleted, or the graph captured again), "
        f"so its memory is no longer the output's. {_FIX}."
    )


def cannot_borrow(name: str) -> str:
    return (
        f"{name}: this torch cannot lend a graph's output memory with use-after-overwrite "
        "detection (`torch._C._set_storage_data_ptr_access_error_msg` is missing), so "
        '`outputs="borrowed"` returns outputs in fresh memory, as `outputs="fresh"` does.'
    )


def no_input_buffers(name: str, sample: bool) -> RuntimeError:
    which = "calls like this one" if sample else "it"
    return RuntimeError(
        f"{name}.input_buffers(): no graph of the {name} answers {which} yet, so there are no "
        "buffers to give. Call the wrapper with such inputs until it captures (`warmup` "
        "calls), or `precapture(...)` them, then ask again."
    )


def several_input_buffers(name: str, count: int) -> ValueError:
    return ValueError(
        f"{name}.input_buffers(): the {name} has {count} graphs (modes, shapes or static "
        "values), each with buffers of its own. Pass a sample call, "
        "`input_buffers(*args, **kwargs)`, to get the buffers of the graph that answers it."
    )
