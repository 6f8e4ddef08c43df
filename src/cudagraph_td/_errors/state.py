"""The messages about the state around a graph: parameters, optimizers, training steps.

Beside `_errors.inputs` (inputs, captures, arguments), with the same rules: each names what
changed, shows what was captured and what is there now, and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .inputs import _short, reset_hint


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

    cause = (
        "The step reads that gradient without computing it (it is computed outside the "
        "function), and eager mode would skip a parameter whose gradient is None, which a "
        "graph cannot do."
        if now is None
        else "It is now another tensor (made by a backward outside the function after "
        "`zero_grad()`, or assigned to `.grad`), which the graph would neither read nor write."
    )
    return RuntimeError(
        f"{name} captured a training step that uses the gradient tensor of `{param}` in "
        f"place, but `{param}.grad` was replaced since the capture (captured: "
        f"{describe(captured)}; now: {describe(now)}). {cause} A graph keeps reading and "
        "writing the gradient tensors it recorded, so the replay would not be the step that "
        "eager mode runs now. Keep gradients in place between calls: call "
        "`zero_grad(set_to_none=False)` outside the function, or zero them inside it; "
        f"{reset_hint(name)}."
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
        f"silently ignored. {tensor_hint}{reset_hint(name)}."
    )


# What a `RecaptureWarning` says of each cause of a change (`_state.state.Change.cause`): what
# happened, and how to keep the graph (None: a new graph is what the change needs).
CAUSES: dict[str, tuple[str, str | None]] = {
    "replaced": (
        "state replaced: a new tensor, new memory or a new submodule (an attribute rebound, "
        "`load_state_dict(assign=True)`, `.data = ...`, `.to(...)`, `net[0] = ...`, or an "
        "optimizer's `load_state_dict`), while the graph reads the old one",
        "update state in place (`load_state_dict(sd)`, `copy_`)",
    ),
    "rebound": (
        "a new model or optimizer where the function finds it (an attribute, a global or a "
        "closure variable rebound: `agent.net = net`), while the graph reads the old one",
        "load the new state into the model and optimizer that the function reads "
        "(`load_state_dict(sd)`, as a resumed run loads its checkpoint)",
    ),
    "children": ("submodules added or removed, which the graph does not run", None),
    "flag": (
        "a `requires_grad` flag changed (a layer frozen or unfrozen), which decides the "
        "gradients that the graph computes",
        "set the flags before the first call",
    ),
    "lengths": (
        "an optimizer's parameter groups changed (`add_param_group`), which its captured step "
        "does not update",
        "add the groups before the first call",
    ),
}


def changed_paths(changes: Sequence[tuple[str, str]]) -> str:
    """The paths of the ``(path, cause)`` changes, as messages show them: the first five."""
    shown = ", ".join(f"`{path}`" for path, _ in changes[:5])
    return shown + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")


def recaptured(name: str, changes: Sequence[tuple[str, str]]) -> str:
    """The message of a ``RecaptureWarning``: what changed, and only the causes and fixes
    of the kinds of change found (``(path, cause)`` pairs, causes from `CAUSES`)."""
    causes = list(dict.fromkeys(cause for _, cause in changes))
    what = "; ".join(CAUSES[cause][0] for cause in causes)
    fixes = [fix for cause in causes if (fix := CAUSES[cause][1]) is not None]
    keep = f"To keep the graph, {' and '.join(fixes)}. " if fixes else ""
    return (
        f"{name}: state that the graph reads changed after the capture: "
        f"{changed_paths(changes)} ({what}). The graph is captured again for the new state: "
        f"the next calls warm up and capture as the first ones did. {keep}"
        "To refuse instead, turn this warning into an error: "
        "`warnings.simplefilter('error', cudagraph_td.RecaptureWarning)`."
    )


def rebinds_state(name: str, paths: list[str], new: str = "a new tensor") -> str:
    """The warning for a function that rebinds module state (or a module, an optimizer, an
    object on the way to them) at each call."""
    shown = ", ".join(f"`{path}`" for path in paths[:5])
    return (
        f"{name}: the function rebinds {shown} to {new} when it runs (`self.x = ...`). "
        "A graph replays its kernels on the tensors of the capture: each replay reads the "
        "value of before the capture, not the last call's. Update such state in place "
        "(`self.x.copy_(...)`, `self.x.add_(1)`)."
    )


def replaced_after_capture(name: str, changes: Sequence[tuple[str, str]]) -> RuntimeError:
    """A graphed callable (no recapture possible) whose state was replaced."""
    shown = changed_paths(changes)
    return RuntimeError(
        f"{name}: state that the graph reads was replaced after the capture: {shown} (a new "
        "tensor, new memory or a new submodule; or a new module where the function finds it: "
        "an attribute, a global or a closure variable rebound), and the graph still reads the "
        "old state. "
        "Update it in place (`load_state_dict(sd)`, `copy_`), or call make_graphed_callables "
        "again."
    )
