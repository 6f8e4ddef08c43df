"""The TensorDict-module layer: ``in_keys`` and ``out_keys``, keyword calls, writes into the input.

A TensorDictModule reads its ``in_keys`` from a TensorDict, writes its ``out_keys`` into it,
and returns it. :class:`TensorDictCall` gives a captured module the same behaviour: it
accepts a TensorDict or keyword tensors named by the ``in_keys`` (through tensordict's own
:class:`~tensordict.nn.dispatch`), feeds the graph only the ``in_keys`` entries (other
entries are ignored, as the module ignores them), and writes the entries that the module
wrote into the caller's TensorDict (or ``tensordict_out``), which it returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDictBase, unravel_key
from tensordict.base import is_tensor_collection
from tensordict.nn import dispatch

from . import _errors
from ._graph import GraphRunner


class _WroteInput:
    """Marks a result as "the module returned its input TensorDict, with these writes"."""

    def __repr__(self) -> str:
        return "<the module's input TensorDict>"


WROTE_INPUT = _WroteInput()


def resolve_keys(name: str, module: Any, in_keys: Any, out_keys: Any) -> tuple[Any, Any]:
    """The keys a wrapper uses: the module's own when it has them, as tensordict does.

    Keys given as arguments that differ from the module's are ignored with a warning.
    """
    for attr, given in (("in_keys", in_keys), ("out_keys", out_keys)):
        own = getattr(module, attr, None)
        if own is not None and given and _as_keys(given) != _as_keys(own):
            warnings.warn(
                f"{name} ignores {attr}={given!r} because the module has its own "
                f"{attr}={own!r}, which it uses instead. Leave {attr} unset to silence this "
                "warning.",
                UserWarning,
                stacklevel=4,
            )
    in_keys = getattr(module, "in_keys", in_keys)
    out_keys = getattr(module, "out_keys", out_keys)
    if out_keys is None and in_keys is not None:
        out_keys = []
    return in_keys, out_keys


def _as_keys(keys: Any) -> list[Any]:
    keys = [keys] if isinstance(keys, str) else list(keys)
    return [unravel_key(key) for key in keys]


def recording_writes(module: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a TensorDict module so that "returned its input" becomes an explicit result.

    When ``module(td, ...)`` returns ``td`` itself, the wrapper returns
    ``(WROTE_INPUT, entries)``, where ``entries`` holds the entries that the call wrote
    (new keys, and keys rebound to other tensors, such as a recurrent state). The graph then
    treats them as outputs, returned in fresh memory at each replay.
    """

    def call(td: Any, *args: Any, **kwargs: Any) -> Any:
        before = dict(td.items(include_nested=True, leaves_only=True))
        out = module(td, *args, **kwargs)
        if out is not td:
            return out
        written = [
            key
            for key, value in td.items(include_nested=True, leaves_only=True)
            if before.get(key) is not value
        ]
        return (WROTE_INPUT, td.select(*written))

    return call


class TensorDictCall:
    """Calls ``run`` with a TensorDict's ``in_keys`` entries, as a TensorDictModule is called."""

    def __init__(
        self,
        name: str,
        in_keys: Sequence[Any],
        out_keys: Sequence[Any],
        current_runner: Callable[[], GraphRunner],
    ):
        self.name = name
        self.in_keys = [unravel_key(key) for key in in_keys]
        self.current_runner = current_runner
        # tensordict's own dispatch turns keyword tensors into a TensorDict and the result
        # into the out_keys' values, exactly as a TensorDictModule's forward does. Without
        # in_keys there is nothing to dispatch: the function takes a TensorDict.
        self.call: Callable[..., Any] = self._call
        if self.in_keys:
            self.call = dispatch(source=list(in_keys), dest=list(out_keys), auto_batch_size=False)(
                self._call
            )

    def _call(
        self,
        tensordict: Any,
        *args: Any,
        tensordict_out: TensorDictBase | None = None,
        **kwargs: Any,
    ) -> Any:
        if not is_tensor_collection(tensordict):
            raise TypeError(
                f"{self.name} wraps a TensorDict module: call it with a TensorDict, or with "
                f"keyword tensors named by its in_keys {self.in_keys}; got "
                f"{type(tensordict).__name__}."
            )
        runner = self.current_runner()
        if self.in_keys:
            if runner.captured is None:  # after the capture, the replay's checks say the same
                keys = tensordict.keys(include_nested=True, leaves_only=False)
                missing = [key for key in self.in_keys if key not in keys]
                if missing:
                    raise _errors.missing_in_keys(self.name, missing)
            inputs = tensordict.select(*self.in_keys, strict=False)
        else:
            inputs = tensordict
        out = runner.run((inputs, *args), kwargs)
        target = tensordict if tensordict_out is None else tensordict_out
        if isinstance(out, tuple) and len(out) == 2 and out[0] is WROTE_INPUT:
            return target.update(out[1])
        if tensordict_out is not None and is_tensor_collection(out):
            return tensordict_out.update(out)
        return out
