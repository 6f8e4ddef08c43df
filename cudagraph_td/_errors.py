"""The errors a user can meet, and the words that explain them.

Every user error names the offending leaf by its path, shows what was captured and what was
received, and says how to fix it. Messages are built here so that their wording stays
consistent across the library.
"""

from __future__ import annotations

from typing import Any

import torch

_RESET_HINT = "or call `reset()` to capture the graph again for the new inputs"


class InputKeyError(KeyError):
    """A TensorDict input lacks an entry that the captured graph reads.

    A :class:`KeyError`, as tensordict raises for a missing ``in_key``, whose message prints
    as written (``KeyError`` alone would print its message quoted).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shape_mismatch(
    name: str, path: str, captured: tuple[int, ...], received: tuple[int, ...]
) -> ValueError:
    return ValueError(
        f"{name} was captured with {path} of shape {tuple(captured)}, but received shape "
        f"{tuple(received)}. A CUDA graph replays fixed shapes: pass an input of the captured "
        f"shape, use one {name} per shape, {_RESET_HINT}."
    )


def batch_size_mismatch(name: str, path: str, captured: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} was captured with {path} of batch size {list(captured)}, but received batch "
        f"size {list(received)}. A CUDA graph replays fixed shapes: pass a TensorDict of the "
        f"captured batch size, use one {name} per batch size, {_RESET_HINT}."
    )


def dtype_mismatch(name: str, path: str, captured: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} was captured with {path} of dtype {captured}, but received dtype {received}. "
        f"The replay does not cast inputs: convert it with `.to({captured})`, {_RESET_HINT}."
    )


def device_mismatch(name: str, path: str, captured: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} was captured with {path} on device {captured}, but received it on device "
        f"{received}. A graph reads its inputs from one device: move it with "
        f"`.to('{captured}')` before the call."
    )


def wrong_device_at_capture(name: str, path: str, device: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} captures its graph on {device}, but {path} is on {received}. Every tensor "
        f"input of a graph must be on the graph's device: move it with `.to('{device}')`, or "
        "read it from the enclosing scope if it is a constant of the function."
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


def outputs_require_grad(name: str, path: str) -> RuntimeError:
    return RuntimeError(
        f"{name} captured an output that requires grad ({path}), which this version cannot "
        "differentiate through a graph: its gradients would be lost. Call the wrapper under "
        "`torch.no_grad()` or `torch.inference_mode()`, or return `.detach()`ed outputs (as a "
        "function that runs `loss.backward()` and `optimizer.step()` inside does)."
    )


def constant_mismatch(name: str, path: str, captured: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} was captured with the non-tensor argument {path} = {_short(captured)}, but "
        f"received {_short(received)}. The graph replays the captured value: pass values "
        f"that change between calls as tensors, use one {name} per value, {_RESET_HINT}."
    )


def leaf_kind_mismatch(name: str, path: str, captured: Any, received: Any) -> ValueError:
    return ValueError(
        f"{name} was captured with {path} of type {type(captured).__name__}, but received "
        f"type {type(received).__name__}. Pass the same kind of argument as at capture, "
        f"{_RESET_HINT}."
    )


def uncomparable_constant(name: str, path: str, value: Any) -> TypeError:
    return TypeError(
        f"{name} cannot check the non-tensor argument {path} of type {type(value).__name__}: "
        "comparing it with `==` does not give a bool, so a changed value could not be "
        "detected. Pass it as a tensor, or bind it with `functools.partial` before wrapping."
    )


def structure_mismatch(
    name: str, missing: list[str], extra: list[str], other: list[str]
) -> ValueError:
    lines = [f"{name} was called with inputs of another structure than at capture:"]
    if missing:
        lines.append(f"  missing: {', '.join(missing)}")
    if extra:
        lines.append(f"  extra: {', '.join(extra)}")
    lines.extend(f"  {line}" for line in other)
    lines.append(
        f"A graph replays the captured call: pass the same arguments and keys, {_RESET_HINT}."
    )
    return ValueError("\n".join(lines))


def missing_keys(name: str, missing: list[str]) -> InputKeyError:
    return InputKeyError(
        f"{name} input lacks the key(s) {', '.join(missing)} that the captured graph reads. "
        "Pass a TensorDict with every entry it had at capture."
    )


def missing_in_keys(name: str, missing: list[Any]) -> InputKeyError:
    return InputKeyError(
        f"{name} input lacks the in_keys {missing} that the module reads. Pass a TensorDict "
        "with every in_key, or keyword tensors named by them."
    )


# What a CUDA error raised during capture usually means, by a phrase of its message.
_CAPTURE_CAUSES = (
    (
        (
            "operation not permitted when stream is capturing",
            "cudaErrorStreamCaptureUnsupported",
            "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        ),
        "the function synchronises the host with the GPU, which a graph cannot capture: "
        "`.item()`, `.tolist()`, `.cpu()`, `print()` of a CUDA tensor, `bool()` or an `if` on a "
        "CUDA tensor, `torch.cuda.synchronize()`, boolean-mask indexing or `nonzero()`, or "
        "a copy between CUDA and pageable CPU memory (`torch.tensor([...], device='cuda')`, "
        "`.to('cpu')`), a `torch.distributions` object built with `validate_args=True`. "
        "Move such code out of the function, or use tensor ops (`torch.where`) instead.",
    ),
    (
        ("cudaErrorStreamCaptureImplicit", "legacy stream", "capturing blocking stream"),
        "the function uses the default (legacy) stream or another stream that is not "
        "ordered after the capture stream; often an operation between devices. Keep the "
        "function's work on the current stream.",
    ),
    (
        ("capturable is False", "capturable=False"),
        "an optimizer steps inside the capture without `capturable=True`: build it with "
        "`capturable=True` (Adam, AdamW and others), so that its step counts stay on the "
        "GPU and its update is recorded.",
    ),
    (
        ("backward through the graph a second time",),
        "the function ran a backward and returned a tensor of that graph that still "
        "requires grad (a loss without `.detach()`?): return `loss.detach()` from a function "
        "that runs its own `backward()`.",
    ),
    (
        ("cudaErrorStreamCaptureInvalidated", "capture was invalidated"),
        "an earlier operation of the function broke the capture, often a host "
        "synchronisation (`.item()`, `print()` of a CUDA tensor) or work on another stream.",
    ),
)


def capture_failure(name: str, stage: str, err: BaseException) -> RuntimeError:
    """The error raised when the function fails while a graph is warmed up or captured."""
    text = str(err)
    cause = next(
        (hint for phrases, hint in _CAPTURE_CAUSES if any(p in text for p in phrases)),
        None,
    )
    if cause is None:
        cause = (
            f"the function itself raised {type(err).__name__} (shown above). Fix it, and check "
            "that it runs eagerly with the same inputs."
        )
    return RuntimeError(
        f"{name} could not {stage}: {cause} The wrapper is still usable: call it again to "
        "retry, or call `reset()` to start the warm-up again. The CUDA context was left out "
        f"of capture mode. Original error: {type(err).__name__}: {_short(text, 300)}"
    )


def cpu_output(name: str, path: str, device: Any) -> RuntimeError:
    return RuntimeError(
        f"{name} captured an output on another device than the graph's ({path} is on "
        f"{device}): a CUDA graph cannot recompute it at replay, so every replay would return "
        "the value of the capture. Return tensors computed on the graph's device, or build "
        "that output outside the wrapped function."
    )


def step_output_requires_grad(name: str, path: str) -> RuntimeError:
    return RuntimeError(
        f"{name} captured a training step (the function moved parameters or their "
        f"gradients) that returns {path}, a tensor that still requires grad. The step has run "
        "its own backward, so the wrapper does not make it differentiable: return "
        "`loss.detach()`, or run `backward()` outside the function and let the wrapper "
        "capture the forward alone."
    )


def grad_replaced(name: str, param: str, captured: Any, now: Any) -> RuntimeError:
    def describe(grad: Any) -> str:
        return "None" if grad is None else f"a tensor of shape {tuple(grad.shape)}"

    return RuntimeError(
        f"{name} captured a training step that uses the gradient tensor of `{param}` in "
        f"place, but `{param}.grad` was replaced since the capture (captured: "
        f"{describe(captured)}; now: {describe(now)}), for instance by "
        "`zero_grad(set_to_none=True)` outside the function. A graph keeps reading and "
        "writing the gradient tensors it recorded, so the replay would not be the step that "
        "eager mode runs now. Keep gradients in place between calls: call "
        "`zero_grad(set_to_none=False)` outside the function, or zero them inside it; "
        f"{_RESET_HINT}."
    )


def hyperparameter_changed(
    name: str, where: str, key: str, captured: Any, now: Any
) -> RuntimeError:
    tensor_hint = (
        f"Give it as a tensor on the graph's device (`{key}=torch.tensor(...)`, with "
        "`capturable=True`) and change it in place (`.fill_()`; learning-rate schedulers do "
        "that for tensor learning rates), "
        if not isinstance(captured, torch.Tensor)
        else "Change a tensor hyperparameter in place (`.fill_()`) instead of replacing it, "
    )
    return RuntimeError(
        f"{name} captured an optimizer step with {where}[{key!r}] = {_short(captured)}, which "
        f"is now {_short(now)}. A graph replays the value it captured: the change would be "
        f"silently ignored. {tensor_hint}{_RESET_HINT}."
    )
