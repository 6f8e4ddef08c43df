"""The replay path: a reader, one metadata check, the launch, a writer.

A call that replays a captured graph takes four steps, each prepared at capture:

1. A *reader* takes the call's input tensors out of its arguments, in the order of the
   graph's static inputs: positional tensors (``Positional``), the entries of one
   TensorDict (``TensorDictEntries``), keyword tensors
   (``Keywords``), or, for any other call, the leaves of the flattened arguments once
   their structure and constants match the capture's (``Flattening``).
2. One metadata check (``metadata``): every tensor's type, shape, dtype, device and
   ``requires_grad`` against the capture's.
   The state the graph reads besides its inputs (parameters, buffers: see `_state.state`) is
   checked with them.
3. The captured call's ``launch``: the tensors copied into the static buffers, the graph
   replayed, the output tensors returned in fresh memory (through the autograd node, for a
   call captured for autograd).
4. A *writer* gives the result its form: the captured output tree (``Tree``), the
   caller's TensorDict with the written entries (``IntoTensorDict``), or the out_keys'
   values (``OutKeyValues``).

The replay function is one, plus a variant for one tensor in and one out that skips the
lists of one element and the calls that cost as much as the steps themselves (a Python call
costs 0.1-0.3 us on the hosts measured, against a floor of 15-30 us per call).

Every reader answers ``None`` for a call it cannot read, and a failed check is the same
*miss*: the replay returns ``MISS``, and the caller takes its slow path (the captured call's
checked replay, `_capture.captured.call`, or the TensorDict layer's full call), which checks the call in full and raises the error that
names the leaf. Only the slow path explains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from .._capture.captured import Args, Captured, Kwargs
from .._compat import foreach_copy_, td_entries, td_has_names, td_set
from .._values import tree as _tree
from .._values.input_views import into_callers, is_written_input
from .._values.outputs import Outputs
from .._values.signature import Signature, metadata

MISS: Any = object()
"""What a replay function returns for a call it leaves to the slow path."""

TENSORDICT_OUT = "tensordict_out"
"""The keyword of a TensorDict module's call that names where its outputs go."""

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
        if type(td) is not TensorDict or td.batch_size != self.batch_size:
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
            or out.batch_size != batch_size
            or td.batch_size[: len(batch_size)] != batch_size
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

    @staticmethod
    def of(outputs: Outputs) -> Writer:
        """The writer of a function's result: the tensor itself, if it is one tensor."""
        return OneTensor() if outputs.single_tensor else Tree(outputs)

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
        device = td.device
        put = td_set if self.flat and (device is None or device == self.device) else _checked
        if self.key is not None:
            put(td, self.key, fresh[0])
            return td
        for key, value in zip(self.keys, fresh, strict=True):
            put(td, key, value)
        return td


_checked: Callable[[TensorDict, Any, torch.Tensor], None] = TensorDict.__setitem__
"""``td[key] = value``: the entry checked, moved to the TensorDict's device."""


class IntoCallers:
    """A result that holds the caller's TensorDicts (a function that returns its input
    TensorDict in a tuple, or one that is not its first argument): the result rebuilt, then
    the written entries set into the caller's (`_values.input_views.into_callers`)."""

    returns_first = False

    def __init__(self, outputs: Outputs):
        self.rebuild = Tree(outputs).rebuild

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


# The replay function ---------------------------------------------------------------------

Route = tuple[Reader, Writer]
Read = Callable[[Args, Kwargs], Sequence[Any] | None]
Write = Callable[[Args, Kwargs, Sequence[torch.Tensor]], Any]


def default_routes(captured: Captured) -> list[Route]:
    """The route of a function's graph: the fastest reader of its calls, the output tree;
    for a result that is the caller's TensorDict (see `_values.input_views`), the writer
    that sets the written entries into it."""
    reader, outputs = reader_for(captured.signature), captured.outputs
    result = outputs.rebuild(outputs.static)
    if is_written_input(result) and isinstance(reader, TensorDictEntries):
        keys = _tree.leaf_keys(result[1])
        if result[0].argument == 0 and len(keys) == len(outputs.static):  # all tensors
            return [(reader, IntoTensorDict(keys, outputs.device))]
    if is_written_input(result) or (type(result) is tuple and any(map(is_written_input, result))):
        return [(reader, IntoCallers(outputs))]
    return [(reader, Tree.of(outputs))]


class ReplayPath:
    """The replay path of a captured call: a route's reader, the metadata check, the launch,
    and that route's writer; ``replay`` returns ``MISS`` for a call the reader or the check
    does not pass.

    ``routes`` holds a route for calls without keywords and one for calls with keywords,
    or one route for both (its reader tells), and for a TensorDict module a route for calls
    with ``tensordict_out`` (else they take the keywords' route). ``source`` is the graph
    it replays (for a bucket's rows, the bucket's graph) and ``runner`` the graph's runner:
    the path is ``alive`` while the runner still holds that graph (a recapture replaces it).
    """

    hits = 0  # the calls it answered

    def __init__(self, captured: Captured, routes: Sequence[Route], source: Any, runner: Any):
        self._source = source
        self._runner = runner
        by_position: tuple[Read, Write | None] = (_miss, None)
        by_keywords = by_position
        by_out = None
        for reader, writer in routes:
            # A result that is the first output itself needs no call: the replay returns it.
            route = (reader.read, None if writer.returns_first else writer.write)
            if reader.keywords == TENSORDICT_OUT:
                by_out = route
                continue
            if reader.keywords is not True:
                by_position = route
            if reader.keywords is not False:
                by_keywords = route
        self._by_position, self._by_keywords = by_position, by_keywords
        self._by_out = by_keywords if by_out is None else by_out
        expected = self._expected = captured.signature.expected
        # One tensor in: its metadata compared without a list of one element.
        self._one = expected[0] if len(expected) == 1 else None
        # The state it reads (see `_state.state`): a replaced parameter is a miss, and a recapture.
        self._state_holds = captured.state.fresh if captured.state is not None else None
        # A plain graph with one tensor in and one out: its launch done here, without a call.
        bare = captured.bare
        self._static_inputs: list[torch.Tensor] | None = bare[0] if bare else None
        self._static_output: torch.Tensor | None = bare[1] if bare else None
        self._bare_replay: Callable[[], None] | None = bare[2] if bare else None
        self._captured = captured  # its launch replays the graph

    def alive(self) -> bool:
        """Whether the graph it replays is still its runner's (not captured again since)."""
        return self._runner.captured is self._source

    def replay(self, args: Args, kwargs: Kwargs) -> Any:
        """Replay the graph for this call; ``MISS`` if the call is not one it reads."""
        if kwargs:
            read, write = self._by_out if TENSORDICT_OUT in kwargs else self._by_keywords
        else:
            read, write = self._by_position
        tensors = read(args, kwargs)
        if tensors is None:
            return MISS
        one = self._one
        try:  # the one metadata check (see `metadata`)
            if one is not None:
                same = metadata(tensors[0]) == one
            else:
                same = list(map(metadata, tensors)) == self._expected
        except Exception:  # a leaf that is not a tensor
            same = False
        state_holds = self._state_holds
        if not same or (state_holds is not None and not state_holds()):
            return MISS
        bare_replay = self._bare_replay
        if bare_replay is not None:
            foreach_copy_(self._static_inputs, tensors)  # type: ignore[arg-type]  # faster than copy_
            bare_replay()
            fresh: Sequence[torch.Tensor] = (self._static_output.clone(),)  # type: ignore[union-attr]
        else:
            fresh = self._captured.launch(tensors)
        return fresh[0] if write is None else write(args, kwargs, fresh)


def replay_path(
    captured: Captured, routes: Sequence[Route], source: Any = None, runner: Any = None
) -> ReplayPath:
    """The fastest replay path of ``captured`` for ``routes``: for one tensor in and out on a
    bare graph read by a common reader, `OneTensorPath`; else `ReplayPath`."""
    expected = captured.signature.expected
    if len(expected) == 1 and captured.bare is not None:
        unrolled = OneTensorPath.of(captured, routes, source, runner)
        if unrolled is not None:
            return unrolled
    return ReplayPath(captured, routes, source, runner)


def _miss(args: Args, kwargs: Kwargs) -> None:
    """The reader of a call kind that no route reads."""
    return None


class OneTensorPath(ReplayPath):
    """`ReplayPath` for one tensor in and out on a bare graph, the common readers and
    writers unrolled from their data."""

    def __init__(
        self,
        captured: Captured,
        routes: Sequence[Route],
        source: Any,
        runner: Any,
        position: Any,
        name: str | None,
        out_key: Any,
    ):
        super().__init__(captured, routes, source, runner)
        # "args": the tensor is the argument; a TensorDict reader: its one entry; else None.
        self._position = position
        self._name = name
        self._out_key = out_key
        entries = position if isinstance(position, TensorDictEntries) else None
        self._key: Any = entries.keys[0] if entries else None
        self._batch_size: torch.Size | None = entries.batch_size if entries else None
        self._unchecked_key = isinstance(out_key, str)
        self._device = captured.outputs.device

    @classmethod
    def of(
        cls, captured: Captured, routes: Sequence[Route], source: Any, runner: Any
    ) -> OneTensorPath | None:
        """The path of ``captured``, if each route's reader and writer is one it unrolls."""
        position: Any = None
        name = out_key = None
        for reader, writer in routes:
            if reader.keywords == TENSORDICT_OUT:  # not unrolled (see `replay`)
                continue
            if isinstance(reader, Keywords) and len(reader.names) == 1 and writer.returns_first:
                (name,) = reader.names
            elif isinstance(reader, Positional) and reader.count == 1 and writer.returns_first:
                position = "args"
            elif (
                isinstance(reader, TensorDictEntries)
                and reader.flat
                and not reader.exact
                and len(reader.keys) == 1
                and isinstance(writer, IntoTensorDict)
                and writer.key is not None
            ):
                position, out_key = reader, writer.key
            else:
                return None
        return cls(captured, routes, source, runner, position, name, out_key)

    def replay(self, args: Args, kwargs: Kwargs) -> Any:
        td = None
        if kwargs:  # Keywords
            if TENSORDICT_OUT in kwargs:  # not unrolled: the general path's route for it
                return ReplayPath.replay(self, args, kwargs)
            name = self._name
            if args or name is None or len(kwargs) != 1:
                return MISS
            t = kwargs.get(name)
            tensors: Sequence[Any] = (t,)
        elif len(args) != 1 or self._position is None:
            return MISS
        elif self._key is None:  # Positional: the arguments are the tensors, copied as they are
            t = args[0]
            tensors = args
        else:  # TensorDictEntries: the module's in_key
            td = args[0]
            if type(td) is not TensorDict or td.batch_size != self._batch_size:
                return MISS
            t = td_entries(td).get(self._key)
            tensors = (t,)
        try:  # the metadata check (a missing entry, None, fails it too)
            same = metadata(t) == self._one
        except Exception:
            same = False
        state_holds = self._state_holds
        if not same or (state_holds is not None and not state_holds()):
            return MISS
        # A tuple, not a list: `_foreach_copy_` takes it faster (0.2 us measured).
        foreach_copy_(self._static_inputs, tensors)  # type: ignore[arg-type]  # faster than copy_
        self._bare_replay()  # type: ignore[misc]
        out = self._static_output.clone()  # type: ignore[union-attr]
        if td is None:  # the tensor itself
            return out
        device = td.device  # IntoTensorDict's write, unrolled
        if self._unchecked_key and (device is None or device == self._device):
            td_set(td, self._out_key, out)
        else:
            td[self._out_key] = out
        return td
