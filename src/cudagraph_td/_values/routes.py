"""How a graph reads a call's input tensors and gives a replay's result its form.

A graph's entry (`_capture.entry.GraphEntry`) replays a call in four steps, each prepared at
capture: a *reader* takes the call's input tensors out of its arguments, in the order of the
graph's static inputs; one metadata check; the launch; a *writer* gives the result its form.
This module holds the readers and writers, and the routes (a reader and its writer) of a
graph: `routes` for a plain function, `Routing.routes` for a TensorDict module.

Readers: positional tensors (``Positional``), the entries of one TensorDict
(``TensorDictEntries``, ``TensorDictEntriesOut`` for ``tensordict_out=``), keyword tensors
(``Keywords``), or, for any other call, the leaves of the flattened arguments once their
structure and constants match the capture's (``Flattening``). Each answers ``None`` for a
call it cannot read: the entry then leaves the call to the slow path, which checks it in full
and raises the error that names the leaf.

Writers: the captured output tree (``Tree``), the one output tensor (``OneTensor``), the
caller's TensorDict with the written entries (``IntoTensorDict``), a result holding the
caller's TensorDicts (``IntoCallers``), or the out_keys' values (``OutKeyValues``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from tensordict import TensorDict

from .._compat import td_batch_size, td_device, td_entries, td_has_names, td_set
from . import tree as _tree
from .input_views import into_callers, is_module_input, is_written_input
from .outputs import Outputs
from .signature import Signature, metadata

MISS: Any = object()
"""What a replay answers for a call it leaves to the slow path (see `_capture.entry`)."""

TENSORDICT_OUT = "tensordict_out"
"""The keyword of a TensorDict module's call that names where its outputs go."""

Args = tuple[Any, ...]
Kwargs = dict[str, Any]

# Readers ---------------------------------------------------------------------------------


class Reader(Protocol):
    # Whether it reads calls with keywords (True), without (False), or both (None); or
    # TENSORDICT_OUT: calls ``module(td, tensordict_out=out)`` only (`TensorDictEntriesOut`).
    keywords: bool | str | None

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        """The call's input tensors in the static inputs' order, or None for a miss."""
        ...


class Positional:
    """``fn(t0, t1, ...)``: the positional arguments are the tensors."""

    keywords: bool | str | None = False

    def __init__(self, count: int):
        self.count = count

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        return args if not kwargs and len(args) == self.count else None


class Keywords:
    """``fn(a=t0, b=t1)``: keyword tensors, read by name; no other argument."""

    keywords: bool | str | None = True

    def __init__(self, names: Sequence[str]):
        self.names = list(names)

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if args or len(kwargs) != len(self.names):
            return None
        try:  # as many keywords as names, and every name: exactly the names
            return [kwargs[name] for name in self.names]
        except KeyError:
            return None


class TensorDictEntries:
    """``fn(td)``: entries of one TensorDict, the call's only argument, read by key.

    For a module's ``in_keys``, the TensorDict's other entries are ignored, as the module
    ignores them. ``exact`` (a TensorDict that is the function's whole input, a batch): it
    must have no other entry, and the capture's device and no names. The batch size is
    compared either way: the graph was captured for one.
    """

    keywords: bool | str | None = False

    def __init__(
        self,
        keys: Sequence[Any],
        batch_size: torch.Size,
        *,
        exact: bool = False,
        device: torch.device | None = None,
    ):
        # Keys that are all strings are read from the stored dict, faster than `td[key]`.
        self.keys = _tree.fast_keys(keys)
        self.flat = all(isinstance(key, str) for key in self.keys)
        self.batch_size = batch_size
        self.exact = exact
        self.device = device

    @classmethod
    def batch(cls, args: Args, kwargs: Kwargs) -> TensorDictEntries | None:
        """The reader of calls like ``(args, kwargs)``, if it is one TensorDict of tensors."""
        if kwargs or len(args) != 1 or type(args[0]) is not TensorDict:
            return None
        td = args[0]
        entries = td_entries(td)
        if td_has_names(td) or not all(isinstance(v, torch.Tensor) for v in entries.values()):
            return None
        keys = sorted(entries)  # the flattening order (see `_values.tree`)
        return cls(keys, td.batch_size, exact=True, device=td.device)

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if kwargs or len(args) != 1:
            return None
        td = args[0]
        if type(td) is not TensorDict or td_batch_size(td) != self.batch_size:
            return None
        if self.exact and (
            len(td_entries(td)) != len(self.keys) or td.device != self.device or td_has_names(td)
        ):
            return None
        return self.entries(td)

    def entries(self, td: TensorDict) -> Sequence[Any] | None:
        """The entries of ``td`` at ``keys``; None if one is missing."""
        try:
            if self.flat:
                entries = td_entries(td)
                return [entries[key] for key in self.keys]
            return [td[key] for key in self.keys]
        except KeyError:
            return None


class TensorDictEntriesOut(TensorDictEntries):
    """``module(td, tensordict_out=out)``: the module's inputs, read from ``td`` by key, take
    the batch size of ``out`` (the capture's) when it leads ``td``'s, as the module writes
    its outputs into ``out`` (a minibatch's scalar metrics into ``TensorDict()``: LeanRL's
    PPO update)."""

    keywords: bool | str | None = TENSORDICT_OUT

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if len(args) != 1 or len(kwargs) != 1:
            return None
        td, out = args[0], kwargs.get(TENSORDICT_OUT)
        batch_size = self.batch_size
        if (
            type(td) is not TensorDict
            or type(out) is not TensorDict
            or td_batch_size(out) != batch_size
            or td_batch_size(td)[: len(batch_size)] != batch_size
        ):
            return None
        return self.entries(td)


class Flattening:
    """Any call: its arguments flattened, their structure and constants compared."""

    keywords: bool | str | None = None

    def __init__(self, signature: Signature):
        self.read = signature.read


def reader_for(signature: Signature) -> Reader:
    """The fastest reader of calls like the one ``signature`` captured."""
    args, kwargs = signature.static_args, signature.static_kwargs
    if args and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return Positional(len(args))
    if kwargs and not args and all(isinstance(v, torch.Tensor) for v in kwargs.values()):
        # Their order among the static inputs: the flattening order of the keywords.
        return Keywords([path[1] for path in _tree.leaf_keys((args, kwargs))])
    return TensorDictEntries.batch(args, kwargs) or Flattening(signature)


# Writers ---------------------------------------------------------------------------------


class Writer(Protocol):
    # Whether the result is the first output tensor itself: the replay returns it, no call.
    returns_first: bool

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        """The call's result, from its arguments and the output tensors in fresh memory."""
        ...


class Tree:
    """The result in the structure the function returned."""

    returns_first = False

    def __init__(self, outputs: Outputs):
        # A result of TensorDicts: its builder itself, one call fewer (see `Outputs.rebuild`).
        tensordicts = outputs.tensordicts
        self.rebuild = tensordicts.build if tensordicts is not None else outputs.rebuild

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        return self.rebuild(fresh)


class OneTensor:
    """The commonest result: one tensor, without a tree to rebuild."""

    returns_first = True

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        return fresh[0]


class IntoTensorDict:
    """The caller's TensorDict (the call's one argument, or its ``tensordict_out`` with
    ``into_out``), with ``keys`` set to the outputs.

    A string key of a TensorDict on no device or on the outputs' ``device`` is set
    unchecked (`_compat.td_set`): the reader compared its batch size with the capture's,
    and the capturing call set the same shapes, checked. Any other is set as ``td[key] =``
    sets it (a TensorDict on another device moves the output there).
    """

    returns_first = False

    def __init__(
        self, keys: Sequence[Any], device: torch.device | None = None, *, into_out: bool = False
    ):
        self.keys = _tree.fast_keys(keys)
        self.key = self.keys[0] if len(self.keys) == 1 else None  # one key: no loop
        self.device = device
        self.flat = all(isinstance(key, str) for key in self.keys)
        self.into_out = into_out

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        # A TensorDict itself (see `TensorDictEntries.read` and `TensorDictEntriesOut.read`).
        td = kwargs[TENSORDICT_OUT] if self.into_out else args[0]
        device = td_device(td)
        put = td_set if self.flat and (device is None or device == self.device) else _checked
        if self.key is not None:
            put(td, self.key, fresh[0])
            return td
        for key, value in zip(self.keys, fresh, strict=True):
            put(td, key, value)
        return td


_checked: Callable[[TensorDict, Any, torch.Tensor], None] = TensorDict.__setitem__
"""``td[key] = value``: the entry checked, moved to the TensorDict's device."""


class IntoCallers(Tree):
    """A result that holds the caller's TensorDicts (a function that returns its input
    TensorDict in a tuple, or one that is not its first argument): the result rebuilt, then
    the written entries set into the caller's (`_values.input_views.into_callers`)."""

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        return into_callers(args, kwargs, self.rebuild(fresh))


class OutKeyValues:
    """The values of some outputs, as tensordict's ``dispatch`` returns the out_keys': the
    one tensor, or a tuple."""

    def __init__(self, indices: Sequence[int]):
        self.indices = list(indices)
        self.single = self.indices[0] if len(self.indices) == 1 else None
        self.returns_first = self.single == 0

    def write(self, args: Args, kwargs: Kwargs, fresh: Sequence[torch.Tensor]) -> Any:
        if self.single is not None:
            return fresh[self.single]
        return tuple(fresh[i] for i in self.indices)


# Routes ----------------------------------------------------------------------------------


class OneKeyTensorDict:
    """``module(td)`` of a TensorDict module with one in_key and one out_key, both strings,
    whose graph takes one tensor and gives one (`_capture.captured.OneTensorLaunch`): the
    commonest call of an RL policy, read, checked, launched and written in one call. It is
    ``TensorDictEntries.read``, the metadata check and ``IntoTensorDict.write`` for that
    case, fused (two calls fewer: 1.6 µs of 41 a call, measured on an H100).

    ``expected``: the metadata of the captured entry (see `_values.signature.metadata`);
    ``holds``: whether the state the graph reads holds (see `_state.state`), or None;
    ``parts``: the graph's static input, replay and output, and ``launch``: the function that
    launches them on a tensor (`_capture.captured.launch_one`, one for every graph: see there
    why the parts are not a closure's).
    """

    # Its fields in slots, read at every replay: no instance dict to touch.
    __slots__ = "batch_size", "device", "expected", "holds", "in_key", "launch", "out_key", "parts"

    def __init__(
        self,
        reader: TensorDictEntries,
        writer: IntoTensorDict,
        expected: tuple[Any, ...],
        holds: Callable[[], bool] | None,
        parts: tuple[list[torch.Tensor], Callable[[], None], Callable[[], torch.Tensor]],
        launch: Callable[[Any, Any], torch.Tensor],
    ):
        self.in_key, self.out_key = reader.keys[0], writer.key
        self.batch_size, self.device = reader.batch_size, writer.device
        self.expected, self.holds, self.parts, self.launch = expected, holds, parts, launch

    @staticmethod
    def fits(reader: Reader, writer: Writer) -> bool:
        """Whether ``(reader, writer)`` is the route this one fuses."""
        return (
            type(reader) is TensorDictEntries
            and reader.flat
            and not reader.exact
            and len(reader.keys) == 1
            and isinstance(writer, IntoTensorDict)
            and writer.flat
            and writer.key is not None
            and not writer.into_out
        )

    def replay(self, args: Args) -> Any:
        """The call's result, or ``MISS``."""
        td = args[0] if len(args) == 1 else None
        if type(td) is not TensorDict or td_batch_size(td) != self.batch_size:
            return MISS
        tensor = td_entries(td).get(self.in_key)
        try:
            same = metadata(tensor) == self.expected
        except Exception:  # not a tensor, or no entry
            same = False
        holds = self.holds
        if not same or (holds is not None and not holds()):
            return MISS
        out = self.launch(self.parts, tensor)  # a tensor: checked above
        device = td_device(td)
        if device is None or device == self.device:  # see `IntoTensorDict`
            td_set(td, self.out_key, out)
        else:
            td[self.out_key] = out
        return td


class Route(NamedTuple):
    """How a graph answers one kind of call: the reader of its inputs, the writer of its result."""

    reader: Reader
    writer: Writer


def routes(signature: Signature, outputs: Outputs) -> list[Route]:
    """The route of a function's graph: the fastest reader of its calls, the output tree;
    for a result that is the caller's TensorDict (see `_values.input_views`), the writer
    that sets the written entries into it."""
    reader = reader_for(signature)
    result = outputs.rebuild(outputs.static)
    if is_written_input(result) and result[0].argument == 0:
        found = _into_argument(reader, result[1], outputs)
        if found:
            return found
    if is_written_input(result) or (type(result) is tuple and any(map(is_written_input, result))):
        return [Route(reader, IntoCallers(outputs))]
    # One tensor: the tensor itself, without a tree to rebuild.
    return [Route(reader, OneTensor() if outputs.single_tensor else Tree(outputs))]


def _into_argument(reader: Reader, written: Any, outputs: Outputs) -> list[Route]:
    """The route that sets the entries ``written`` into the call's one TensorDict, where
    ``reader`` reads that TensorDict whole and the entries are all tensors; else none."""
    keys = _tensor_keys(written)
    if not isinstance(reader, TensorDictEntries) or keys is None:
        return []
    return [Route(reader, IntoTensorDict(keys, outputs.device))]


class Routing:
    """The routes of a TensorDict module's graphs (or of a function given ``in_keys``), from
    its ``in_keys`` and ``out_keys`` (see `_call.tdmodule`)."""

    def __init__(self, in_keys: Sequence[Any], out_keys: Sequence[Any]):
        self.in_keys = [key_tuple(key) for key in in_keys]
        # The out-key "_" marks an output that is not returned, as in tensordict.
        self.returned = [key_tuple(key) for key in out_keys if key != "_"]

    def routes(self, signature: Signature, outputs: Outputs) -> list[Route]:
        """``module(td)``: the ``in_keys`` entries read by key, the written entries set into
        ``td``; ``module(td, tensordict_out=out)``: the same entries, the written ones set
        into ``out``; ``module(**tensors)``, for a graph captured with a TensorDict of batch
        size ``[]`` (what a keyword call builds): the keyword tensors read by name (nested
        keys joined with ``"_"``, as tensordict's dispatch does), the out_keys' values
        returned. Without ``in_keys``: the call's arguments read as a plain function's
        (`routes`), the result returned as the function returned it, or the entries it wrote
        into its one TensorDict set into the caller's. None for any other graph: every call
        takes the full call.
        """
        result = outputs.rebuild(outputs.static)
        wrote_input = is_module_input(result)
        if not self.in_keys:
            # No in_keys (LeanRL's and torchrl's `CudaGraphModule(update, in_keys=[],
            # out_keys=[])`): the graph reads the call's arguments as a plain function's
            # (the TensorDict whole, and any other argument), and its result is returned as
            # it is, or, written into the one TensorDict, set into the caller's.
            if not wrote_input:
                return routes(signature, outputs)
            return _into_argument(reader_for(signature), result[1], outputs)
        args = signature.static_args
        selected = args[0] if len(args) == 1 and not signature.static_kwargs else None
        if type(selected) is not TensorDict or not wrote_input:
            return []
        in_paths = _tensor_keys(selected)
        out_paths = _tensor_keys(result[1])
        # Read by key, the in_keys must be the graph's inputs: each one a tensor.
        if in_paths is None or out_paths is None or set(in_paths) != set(self.in_keys):
            return []
        batch_size, device = selected.batch_size, outputs.device
        found = [
            Route(TensorDictEntries(in_paths, batch_size), IntoTensorDict(out_paths, device)),
            # `module(td, tensordict_out=out)`, the outputs written into `out`.
            Route(
                TensorDictEntriesOut(in_paths, batch_size),
                IntoTensorDict(out_paths, device, into_out=True),
            ),
        ]
        if all(key in out_paths for key in self.returned):  # read by name, whatever the batch
            names = ["_".join(key) for key in in_paths]
            indices = [out_paths.index(key) for key in self.returned]
            found.append(Route(Keywords(names), OutKeyValues(indices)))
        return found


def key_tuple(key: Any) -> tuple[str, ...]:
    """A TensorDict key as a tuple: ``"obs"`` as ``("obs",)``."""
    return (key,) if isinstance(key, str) else tuple(key)


def _tensor_keys(td: Any) -> list[tuple[str, ...]] | None:
    """The keys of the leaves of ``td`` in flattening order, or None if one is not a tensor."""
    leaves, _ = _tree.flatten(td)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return None
    return _tree.leaf_keys(td)
