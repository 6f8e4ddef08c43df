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

import torch
from tensordict import TensorDict, TensorDictBase, unravel_key
from tensordict.base import is_tensor_collection
from tensordict.nn import dispatch

from . import _errors
from ._backend import replay_function
from ._graph import GraphRunner
from ._signature import quick_meta
from ._tree import walk_leaves


class _WroteInput:
    """Marks a result as "the module returned its input TensorDict, with these writes"."""

    def __repr__(self) -> str:
        return "<the module's input TensorDict>"


WROTE_INPUT = _WroteInput()

NOT_HANDLED: Any = object()
"""What a replay path returns for a call it leaves to the full path."""


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
        self.out_keys = [unravel_key(key) for key in out_keys]
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

    def replay_path(self, captured: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
        """The replay path of a captured module, for its two common calls.

        ``module(td)`` with a TensorDict, and ``module(**tensors)`` with keyword tensors named
        by the ``in_keys``: their ``in_keys`` entries are checked and copied straight into
        the graph's buffers, and the entries the module wrote are set into ``td`` (or
        returned, for a keyword call) in fresh memory, without building TensorDicts around
        them. Any other call, or one whose inputs differ from the capture, returns
        :data:`NOT_HANDLED` and takes the full path, which raises the right error.
        """
        layout = _Layout.of(captured)
        if layout is None:
            return not_handled
        in_keys, out_keys, batch_size = layout.in_keys, layout.out_keys, layout.batch_size
        signature = captured.signature
        expected = [quick_meta(t) for t in signature.static_inputs]
        static_inputs = signature.static_inputs
        replay_graph, fresh_tensors = (
            replay_function(captured.graph),
            captured.outputs.fresh_tensors,
        )
        # A keyword call builds a TensorDict of batch size [] (tensordict's dispatch): it
        # matches a graph captured from one. Its names join nested keys with "_".
        names = ["_".join(key) for key in layout.in_paths] if batch_size == () else None
        # Where each returned out_key is among the written entries (keyword calls); the
        # out-key "_" marks an output that is not returned, as in tensordict.
        written = {key: i for i, key in enumerate(layout.out_paths)}
        returned = [_key_tuple(key) for key in self.out_keys if key != "_"]
        dest = [written[key] for key in returned if key in written]
        if len(dest) != len(returned):
            names = None
        single = dest[0] if len(dest) == 1 else None

        def replay(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            td = None
            try:
                if kwargs:  # as many keywords as names, and every name: exactly the names
                    if args or names is None or len(kwargs) != len(names):
                        return NOT_HANDLED
                    tensors = [kwargs[name] for name in names]
                else:
                    if len(args) != 1:
                        return NOT_HANDLED
                    td = args[0]
                    if type(td) is not TensorDict or td.batch_size != batch_size:
                        return NOT_HANDLED
                    tensors = [td[key] for key in in_keys]  # [] reads faster than get()
                # The replay's input check (see `quick_meta`).
                metas = [(type(t), t.shape, t.dtype, t.device, t.requires_grad) for t in tensors]
            except (KeyError, AttributeError):  # a missing key, a non-tensor entry
                return NOT_HANDLED
            if metas != expected:
                return NOT_HANDLED
            torch._foreach_copy_(static_inputs, tensors)
            replay_graph()
            fresh = fresh_tensors()
            if td is None:  # as tensordict's dispatch returns the out_keys' values
                if single is not None:
                    return fresh[single]
                return tuple(fresh[i] for i in dest)
            for key, value in zip(out_keys, fresh, strict=True):
                td[key] = value  # [] = writes faster than set()
            return td

        if len(in_keys) != 1 or len(out_keys) != 1 or (names is not None and single != 0):
            return replay
        # One input and one output, as a policy's observation and action: the same steps
        # without the lists, which cost as much as the checks themselves at this size.
        name = None if names is None else names[0]
        in_key, out_key, meta = in_keys[0], out_keys[0], expected[0]
        static_output = captured.outputs.static[0]

        def replay_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            td = None
            try:
                if kwargs:
                    if args or name is None or len(kwargs) != 1:
                        return NOT_HANDLED
                    t = kwargs[name]
                else:
                    if len(args) != 1:
                        return NOT_HANDLED
                    td = args[0]
                    if type(td) is not TensorDict or td.batch_size != batch_size:
                        return NOT_HANDLED
                    t = td[in_key]
                if (type(t), t.shape, t.dtype, t.device, t.requires_grad) != meta:
                    return NOT_HANDLED
            except (KeyError, AttributeError):
                return NOT_HANDLED
            torch._foreach_copy_(static_inputs, [t])  # issued faster than `copy_`
            replay_graph()
            if td is None:
                return static_output.clone()
            td[out_key] = static_output.clone()
            return td

        return replay_one


def not_handled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A replay path that leaves every call to the full path (nothing captured yet)."""
    return NOT_HANDLED


def _key_tuple(key: Any) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


class _Layout:
    """Where a captured module's tensors are, as keys: its inputs and the entries it wrote."""

    def __init__(
        self, in_paths: list[tuple[str, ...]], out_paths: list[tuple[str, ...]], batch_size: Any
    ):
        self.in_paths = in_paths
        self.out_paths = out_paths
        # As TensorDict keys: single-key tuples as plain strings, the faster lookups.
        self.in_keys = [key[0] if len(key) == 1 else key for key in in_paths]
        self.out_keys = [key[0] if len(key) == 1 else key for key in out_paths]
        self.batch_size = batch_size

    @classmethod
    def of(cls, captured: Any) -> _Layout | None:
        """The layout of a plain graph of ``module(td)`` that wrote into ``td``, else None."""
        from ._graph import CapturedCall

        if not isinstance(captured, CapturedCall) or captured.watch is not None or captured.mutated:
            return None
        signature, outputs = captured.signature, captured.outputs
        if signature.static_kwargs or len(signature.static_args) != 1:
            return None
        selected = signature.static_args[0]
        result = outputs.rebuild(outputs.static)
        if type(selected) is not TensorDict or not (
            isinstance(result, tuple) and len(result) == 2 and result[0] is WROTE_INPUT
        ):
            return None
        in_keys = _tensor_keys(selected)
        out_keys = _tensor_keys(result[1])
        if in_keys is None or out_keys is None:
            return None
        return cls(in_keys, out_keys, selected.batch_size)


def _tensor_keys(td: Any) -> list[tuple[str, ...]] | None:
    """The keys of the leaves of ``td`` in flattening order, or None if one is not a tensor."""
    keys = []
    for path, leaf in walk_leaves(td):
        if not isinstance(leaf, torch.Tensor):
            return None
        keys.append(tuple(entry for _, entry in path))
    return keys
