"""The messages about copies of a wrapper: ``copy.deepcopy`` and pickling (``torch.save``).

Beside `_errors.inputs`, with the same rules: what was asked, why it cannot be done, the fix.
"""

from __future__ import annotations

from typing import Any

from .inputs import _short


def deepcopy_shares_state(name: str, fn: Any, shared: list[str]) -> TypeError:
    return TypeError(
        f"{name} cannot deep-copy {_short(fn)}: the copy would share {', '.join(shared)} "
        "with the original (a deep copy of a function is the function itself, and it reaches "
        "them), so it would not be independent. Wrap a deep copy of the module instead "
        f"(`{name}(copy.deepcopy(net))`), or a method of a deep copy of the object that "
        "holds the modules and optimizers."
    )


def cannot_pickle(name: str, fn: Any, error: Exception) -> TypeError:
    return TypeError(
        f"{name} cannot be pickled (`torch.save`, `pickle`): it wraps {_short(fn)}, which "
        f"pickle cannot save ({type(error).__name__}: {error}). Save the state instead: "
        "`torch.save(wrapper.state_dict(), f)` (the wrapped module's; and each optimizer's "
        "`state_dict()`), then, where you load it, build the module and its wrapper again and "
        "call `wrapper.load_state_dict(torch.load(f))`."
    )
