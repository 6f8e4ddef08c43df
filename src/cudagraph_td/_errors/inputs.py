"""The errors a user can meet, and the words that explain them.

Every user error names the offending leaf by its path, shows what was captured and what was
received, and says how to fix it. Every message is built here, or, for the state around a
graph (parameters, optimizers, training steps), in ``_errors.state``, for ``shapes=`` in
``_errors.shapes``, for the arguments of ``make_graphed_callables`` in ``_errors.graphed``,
for copies of a wrapper in ``_errors.copies``, so that the wording stays consistent across
the library; ``docs/sharp-edges.md`` lists them by case. A message is built first, then
returned as its error (with, for an ``InputMismatchError``, the path, the captured value and
the received one), for the caller to raise.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from typing import Any

from .causes import CAPTURE_CAUSES

# The start of the name of every callable graphed by `make_graphed_callables`: its errors
# say what to do without a wrapper's `reset()`.
GRAPHED_CALLABLES = "make_graphed_callables"


def reset_hint(name: str) -> str:
    """How to start again for other inputs: a wrapper's `reset()`; for a callable graphed by
    `make_graphed_callables` (which has none), graphing it again."""
    if name.startswith(GRAPHED_CALLABLES):
        return "or graph the callable again with `make_graphed_callables` for the new inputs"
    return "or call `reset()` to capture the graph again for the new inputs"


class InputMismatchError(ValueError):
    """A call's input differs from the captured one (shape, dtype, device, value, structure),
    or shares memory with another input where the graph writes into one of them.

    A ``ValueError``, as tensordict raises for such calls, that says where and how:

    Attributes:
        path: The input, as the user wrote it (``args[0]["next", "obs"]``, ``kwargs["x"]``),
            or ``"(args, kwargs)"`` for the structure of the whole call; for inputs that
            share memory, the one that the graph writes.
        captured: What the capture had there (a shape, a dtype, a device, a value; for a
            structure, the paths that are missing now; ``"memory of its own"``).
        received: What the call passed (for a structure, the paths that are new;
            ``"memory shared with args[1]"``).
    """

    def __init__(self, message: str, path: str, captured: Any, received: Any):
        super().__init__(message)
        self.path = path
        self.captured = captured
        self.received = received


InputMismatchError.__module__ = "cudagraph_td"  # where users import it from


class InputKeyError(KeyError):
    """A TensorDict input lacks an entry that the captured graph reads.

    A ``KeyError``, as tensordict raises for a missing ``in_key``, whose message prints
    as written (``KeyError`` alone would print its message quoted).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


InputKeyError.__module__ = "cudagraph_td"  # where users import it from


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any, limit: int = 80) -> str:
    return _clip(repr(value), limit)


def invalid_option(option: str, value: Any, valid: Any) -> ValueError:
    """An option given a value outside ``valid`` (a tuple of values, or a description)."""
    choices = f"one of {', '.join(map(repr, valid))}" if isinstance(valid, tuple) else valid
    return ValueError(f"`{option}` must be {choices}, got {value!r}.")


def _several_shapes(name: str) -> str:
    if name.startswith(GRAPHED_CALLABLES):
        return "give `sample_args` a list of samples, one per shape (a graph pair for each)"
    return (
        f"make the {name} with `shapes=Exact()` (a graph per shape) or `shapes=Buckets([...])` "
        "(batch sizes padded to a few graphs)"
    )


def _several_structures(name: str) -> str:
    """The fixes of a call of another structure, after "pass the same ... as at capture, "."""
    if name.startswith(GRAPHED_CALLABLES):
        return reset_hint(name)
    return (
        f'make the {name} with shapes="exact" (a graph per structure and shapes: an optional '
        f"argument passed or None, say), {reset_hint(name)}"
    )


def shape_mismatch(
    name: str, path: str, captured: tuple[int, ...], received: tuple[int, ...]
) -> InputMismatchError:
    message = (
        f"{name} was captured with {path} of shape {tuple(captured)}, but received shape "
        f"{tuple(received)}. A CUDA graph replays fixed shapes: pass an input of the captured "
        f"shape, {_several_shapes(name)}, {reset_hint(name)}."
    )
    return InputMismatchError(message, path, tuple(captured), tuple(received))


def batch_size_mismatch(name: str, path: str, captured: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} was captured with {path} of batch size {list(captured)}, but received batch "
        f"size {list(received)}. A CUDA graph replays fixed shapes: pass a TensorDict of the "
        f"captured batch size, {_several_shapes(name)}, {reset_hint(name)}."
    )
    return InputMismatchError(message, path, tuple(captured), tuple(received))


def dtype_mismatch(name: str, path: str, captured: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} was captured with {path} of dtype {captured}, but received dtype {received}. "
        f"The replay does not cast inputs: convert it with `.to({captured})`, {reset_hint(name)}."
    )
    return InputMismatchError(message, path, captured, received)


def device_mismatch(name: str, path: str, captured: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} was captured with {path} on device {captured}, but received it on device "
        f"{received}. A graph reads its inputs from one device: move it with "
        f"`.to('{captured}')` before the call."
    )
    return InputMismatchError(message, path, captured, received)


def overlapping_inputs(name: str, written: str, other: str) -> InputMismatchError:
    message = (
        f"{name} received {written} and {other} in overlapping memory, and its graph writes "
        f"into {written} in place. The graph works on its own copy of each input, so {other} "
        f"would not see that write, as it does in an eager call: pass tensors that share no "
        f"memory (`.clone()` one of them), or return the new value of {written} instead of "
        "writing into it."
    )
    return InputMismatchError(message, written, "memory of its own", f"memory shared with {other}")


def input_view_layout(
    name: str, output: str, path: str, captured: Any, received: Any
) -> InputMismatchError:
    message = (
        f"{name}'s {output} is a view of {path}, taken at the capture from a tensor of "
        f"strides {tuple(captured)}; this call's {path} has strides {tuple(received)}, in "
        f"which the same view cannot be taken. Pass {path} in the capture's layout "
        f"(`.contiguous()`, if it was), or return a copy of the view (`.clone()`), "
        f"{reset_hint(name)}."
    )
    return InputMismatchError(message, path, tuple(captured), tuple(received))


def untakeable_input_view(name: str, output: str, path: str) -> ValueError:
    return ValueError(
        f"{name} returned {output} in the memory of {path}, but not as a view of {path} "
        "that a replay can take again from the caller's tensor (another dtype, or memory "
        f"outside {path}). Return a copy (`.clone()`) or a view of {path} of its dtype."
    )


def cannot_follow(
    name: str, path: str, home: Any, device: Any, state: str, state_device: Any
) -> InputMismatchError:
    message = (
        f"{name} has graphs on {home}, and received {path} on {device}: a graph there would "
        f"read `{state}`, which is on {state_device}. Move the inputs with "
        f"`.to('{state_device}')`, or the module and its optimizer to {device} (the wrapper "
        "follows them with a new capture)."
    )
    return InputMismatchError(message, path, home, device)


def wrong_device_at_capture(name: str, path: str, device: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} captures its graph on {device}, but {path} is on {received}. Every tensor "
        f"input of a graph must be on the graph's device: move it with `.to('{device}')`, or "
        "read it from the enclosing scope if it is a constant of the function."
    )
    return InputMismatchError(message, path, device, received)


def memoryless_input(name: str, path: str, received: Any) -> TypeError:
    kind = type(received)
    return TypeError(
        f"{name} cannot read the memory of {path}, a {kind.__module__}.{kind.__qualname__}: a "
        "tensor subclass whose storage holds no memory, and that gives none through its "
        "`untyped_storage()` (a wrapper subclass without a payload of its own). A graph copies "
        "each tensor input into a buffer of its own at every call, and tells inputs that share "
        f"memory apart by their storages. Pass the tensor that the {kind.__qualname__} wraps "
        "instead, or give the subclass an `untyped_storage()` that returns its payload's (as "
        "tensordict's UnbatchedTensor does)."
    )


def requires_grad(name: str, path: str) -> RuntimeError:
    return RuntimeError(
        f"{name} received {path}, a tensor that requires grad, but the graph is not captured "
        "for autograd: gradients would not flow back to it. Pass `.detach()`ed inputs, call "
        "under `torch.no_grad()`, or read trainable tensors (parameters) from the enclosing "
        "scope instead of passing them as arguments."
    )


def no_longer_requires_grad(name: str, path: str) -> RuntimeError:
    return RuntimeError(
        f"{name} was captured for autograd with {path} requiring grad, but received a tensor "
        "that does not: the graph's backward computes a gradient for it. Pass a tensor that "
        "requires grad, as at capture, or wrap the call with its own CudaGraphModule."
    )


def ungraded_backward(name: str, paths: tuple[str, ...]) -> RuntimeError:
    return RuntimeError(
        f"{name}: backward through a call with {', '.join(paths)} requiring grad, where the "
        "samples did not: the captured backward computes no such gradient (nor would torch's "
        "function). To train through it, give `make_graphed_callables` samples that require "
        "grad where the real inputs do; `.detach()`ed inputs, or `torch.no_grad()`, replay "
        "the forward alone."
    )


def outputs_require_grad(name: str, path: str) -> RuntimeError:
    return RuntimeError(
        f"{name} captured an output that requires grad ({path}), which this version cannot "
        "differentiate through a graph: its gradients would be lost. Call the wrapper under "
        "`torch.no_grad()` or `torch.inference_mode()`, or return `.detach()`ed outputs (as a "
        "function that runs `loss.backward()` and `optimizer.step()` inside does)."
    )


def constant_mismatch(name: str, path: str, captured: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} was captured with the non-tensor argument {path} = {_short(captured)}, but "
        f"received {_short(received)}. The graph replays the captured value: pass values "
        f"that change between calls as tensors,{_static_hint(name, path)} use one {name} per "
        f"value, {reset_hint(name)}."
    )
    return InputMismatchError(message, path, captured, received)


def _static_hint(name: str, path: str) -> str:
    """How to declare the top-level argument at ``path`` static (``CudaGraphModule``)."""
    top_level = re.fullmatch(r'args\[(\d+)\]|kwargs\["([^"]*)"\]', path)
    if name.startswith(GRAPHED_CALLABLES) or top_level is None:
        return ""
    index, keyword = top_level.groups()
    declared = index if keyword is None else f'"{keyword}"'
    return f" declare it static (`static=({declared},)`: a graph per value),"


def leaf_kind_mismatch(name: str, path: str, captured: Any, received: Any) -> InputMismatchError:
    message = (
        f"{name} was captured with {path} of type {type(captured).__name__}, but received "
        f"type {type(received).__name__}. Pass the same kind of argument as at capture, "
        f"{_several_structures(name)}."
    )
    return InputMismatchError(message, path, type(captured), type(received))


def uncomparable_constant(name: str, path: str, value: Any) -> TypeError:
    return TypeError(
        f"{name} cannot check the non-tensor argument {path} of type {type(value).__name__}: "
        "comparing it with `==` does not give a bool, so a changed value could not be "
        "detected. Pass it as a tensor, or bind it with `functools.partial` before wrapping."
    )


def structure_mismatch(
    name: str, missing: list[str], extra: list[str], other: list[str], unbound: str | None = None
) -> InputMismatchError:
    """A call of another structure than the capture's. ``unbound``: why the function itself
    could not take the call (Python's words), whose fix is then the only advice."""
    lines = [f"{name} was called with inputs of another structure than at capture:"]
    if missing:
        lines.append(f"  missing: {', '.join(missing)}")
    if extra:
        lines.append(f"  extra: {', '.join(extra)}")
    lines.extend(f"  {line}" for line in other)
    if unbound is not None:
        lines.append(
            f"The function cannot take this call either ({unbound}): pass the arguments it "
            "takes, as at capture."
        )
    else:
        lines.append(
            "A graph replays the captured call: pass the same arguments and keys, "
            f"{_several_structures(name)}."
        )
    return InputMismatchError("\n".join(lines), "(args, kwargs)", missing, extra)


def missing_keys(name: str, missing: list[str]) -> InputKeyError:
    return InputKeyError(
        f"{name} input lacks the key(s) {', '.join(missing)} that the captured graph reads. "
        "Pass a TensorDict with every entry it had at capture."
    )


def missing_keywords(name: str, missing: list[str]) -> InputKeyError:
    """A keyword call of a TensorDict module without some of the tensors its graph reads."""
    return InputKeyError(
        f"{name} received no {', '.join(missing)}, which the captured graph reads (an in_key "
        "of the module). Pass every in_key by keyword, or a TensorDict with every in_key."
    )


def missing_in_keys(name: str, missing: list[Any]) -> InputKeyError:
    return InputKeyError(
        f"{name} input lacks the in_keys {missing} that the module reads. Pass a TensorDict "
        "with every in_key, or keyword tensors named by them."
    )


def capture_failure(name: str, stage: str, err: BaseException, device: Any = None) -> RuntimeError:
    """The error raised when the function fails while a graph is warmed up or captured: the
    cause found first, where in the user's code, then what to do. ``device``: the graph's;
    a CUDA capture (not the emulation's, on the CPU) may leave the context capturing."""
    text = str(err)
    unknown = (
        f"the function itself raised {type(err).__name__} (shown above). Fix it, and check "
        "that it runs eagerly with the same inputs."
    )
    cause = next(
        (hint for phrases, hint in CAPTURE_CAUSES.items() if any(p in text for p in phrases)),
        unknown,
    )
    retry = (
        "Nothing was graphed: call `make_graphed_callables` again once it is fixed."
        if name.startswith(GRAPHED_CALLABLES)
        else "The wrapper is still usable: call it again to retry, or call `reset()` to start "
        "the warm-up again."
    )
    cuda = device is None or device.type == "cuda"
    context = " The CUDA context was left out of capture mode." if cuda else ""
    return RuntimeError(
        f"{name} could not {stage}{_user_line(err)}: {cause} {retry}{context} Original error: "
        f"{type(err).__name__}: {_short(text, 300)}"
    )


# The frames of these packages are not the user's code (nor Python's own modules).
_NOT_USER_CODE = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}tensordict{os.sep}",
    f"{os.sep}cudagraph_td{os.sep}",
    f"{os.sep}optree{os.sep}",
    os.path.dirname(os.__file__) + os.sep,
)


def _user_line(err: BaseException) -> str:
    """`` at file:line (`source`)`` for the innermost frame of the user's code where ``err``
    was raised, or "" if none is found."""
    found = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _NOT_USER_CODE) and not filename.startswith("<"):
            found = (filename, lineno)
    if found is None:
        return ""
    filename, lineno = found
    source = linecache.getline(filename, lineno).strip()
    shown = os.path.relpath(filename)
    if shown.startswith(".."):
        shown = filename
    return f" at {shown}:{lineno}" + (f" (`{_clip(source, 60)}`)" if source else "")


def cpu_output(name: str, path: str, device: Any) -> RuntimeError:
    return RuntimeError(
        f"{name} captured an output on another device than the graph's ({path} is on "
        f"{device}): a CUDA graph cannot recompute it at replay, so every replay would return "
        "the value of the capture. Return tensors computed on the graph's device, or build "
        "that output outside the wrapped function."
    )


def not_a_tensordict(name: str, in_keys: list[Any], received: Any) -> TypeError:
    return TypeError(
        f"{name} wraps a TensorDict module: call it with a TensorDict, or with keyword "
        f"tensors named by its in_keys {in_keys}; got {type(received).__name__}."
    )


def unused_input(name: str, path: str) -> ValueError:
    return ValueError(
        f"{name}: the input {path} requires grad, but the outputs do not depend on it. Pass "
        "`allow_unused_input=True`, or an input that does not require grad."
    )


def double_backward(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name}: a double backward (`create_graph=True`, `torch.autograd.grad` of a gradient) "
        "through a graphed callable is not supported: its backward is a captured graph, which "
        "autograd cannot differentiate. Compute such gradients eagerly."
    )


def stale_backward(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name}: backward of an earlier call, after a later call of the same graphed "
        "callable: the graph keeps the activations of the last call only, so this gradient "
        "would be wrong. Run each call's backward before the next call (graphs that share a "
        "pool: forwards in capture order, backwards in reverse)."
    )


def emulated_branch_changed() -> RuntimeError:
    return RuntimeError(
        "The emulated replay returned another output structure than the capture: the "
        "function's Python control flow depends on its inputs' values or on state that "
        "changed. A CUDA graph would silently replay the captured branch: use tensor "
        "operations (`torch.where`) instead of Python branches on data."
    )


def no_cuda(name: str, switch: str | None = None) -> RuntimeError:
    """``backend="cuda"`` on a machine without CUDA: given to ``name``, or picked for
    ``backend="auto"`` by the ``switch`` (see `_capture.default_backend`)."""
    if switch is None:
        return RuntimeError(
            f"{name}(backend='cuda') needs CUDA, which is not available here. Use "
            "backend='auto' to fall back to eager calls, or 'emulate' to test on the CPU."
        )
    return RuntimeError(
        f"{name}: {switch} makes backend='auto' pick 'cuda', which needs CUDA, not available "
        "here. Set it to 'emulate' to test on the CPU, or 'eager' for plain calls."
    )


def invalid_environment_backend(variable: str, value: str, valid: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"The environment variable {variable} must be one of {', '.join(map(repr, valid))} "
        f"(or unset, or 'auto'), got {value!r}."
    )


def no_state_dict(name: str, module: Any) -> TypeError:
    return TypeError(
        f"{name} wraps {module!r}, which has no `load_state_dict`: the state cannot be loaded."
    )


def cannot_verify_training_step(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name}(verify=...) cannot check this graph: it is a training step (it updates "
        "parameters or their gradients), which an eager run on the same inputs would apply a "
        "second time. Verify the function without its optimizer step, or leave `verify` at 0."
    )


def verification_failed(name: str, replay: int, path: str, detail: str) -> str:
    """The message of a ``VerificationError`` (the class lives with ``verify=``)."""
    where = f"returned {path}" if path.startswith("output") else f"updated {path} in place"
    return (
        f"{name} replay {replay} (verify=) {where} unlike an eager run of the function on "
        f"the same inputs: {detail} A graph replays the kernels recorded at capture, with the "
        "values the Python code read then. Likely causes: control flow that depends on a value "
        "(an `if` on a tensor or on a Python number that changes between calls), which the "
        "graph fixed to the branch it took at capture; a Python value read at capture (a "
        "global, an attribute, a number computed in Python) that changed since, which the "
        "graph keeps as a constant: pass it as a tensor input; or random numbers, which the "
        "replay and the eager run draw differently (a function that draws them cannot be "
        "verified). Call `reset()` to capture the graph again."
    )
