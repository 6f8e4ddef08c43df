"""The replay path: a reader, one metadata check, the launch, a writer.

A call that replays a captured graph takes four steps, each prepared at capture:

1. A *reader* takes the call's input tensors out of its arguments, in the order of the
   graph's static inputs: positional tensors (:class:`Positional`), the entries of one
   TensorDict (:class:`TensorDictBatch`, :class:`TensorDictKeys`), keyword tensors
   (:class:`Keywords`), or, for any other call, the leaves of the flattened arguments once
   their structure and constants match the capture's (:class:`Flattening`).
2. One metadata check (:data:`metadata`): every tensor's type, shape, dtype, device and
   ``requires_grad`` against the capture's.
3. The captured call's ``launch``: the tensors copied into the static buffers, the graph
   replayed, the output tensors returned in fresh memory (through the autograd node, for a
   call captured for autograd).
4. A *writer* gives the result its form: the captured output tree (:class:`Tree`), the
   caller's TensorDict with the written entries (:class:`IntoTensorDict`), or the out_keys'
   values (:class:`OutKeyValues`).

Every reader answers ``None`` for a call it cannot read, and a failed check is the same
*miss*: the replay returns :data:`MISS`, and the caller takes its slow path (:func:`call`,
or the TensorDict layer's full call), which checks the call in full and raises the error that
names the leaf. Only the slow path explains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from . import _compat, _tree
from ._compat import foreach_copy_
from ._outputs import Outputs
from ._signature import Signature, metadata

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
ReplayFunction = Callable[[Args, Kwargs], Any]

MISS: Any = object()
"""What a replay function returns for a call it leaves to the slow path."""


class Captured(Protocol):
    """A captured call, built complete at capture: what every replay path needs of it."""

    signature: Signature  # the inputs: static buffers, the full check and its errors
    outputs: Outputs  # the outputs: their structure, and the static tensors
    training_step: bool  # whether it updates parameters (a step cannot be verified)
    # The bare graph replay, when a launch is only "copy in, replay, copy out" (no autograd
    # node, no training-step checks, no inputs written back); else None.
    bare_replay: Callable[[], None] | None

    def launch(self, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Replay on checked input tensors; return the output tensors in fresh memory."""
        ...


def call(captured: Captured, args: Args, kwargs: Kwargs) -> Any:
    """The slow path: the full check (which raises the error naming the leaf), then a replay."""
    tensors = captured.signature.match(args, kwargs)
    return captured.outputs.rebuild(captured.launch(tensors))


# Readers ---------------------------------------------------------------------------------


class Reader(Protocol):
    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        """The call's input tensors in the static inputs' order, or None for a miss."""
        ...


class Positional:
    """``fn(t0, t1, ...)``: the positional arguments are the tensors."""

    def __init__(self, count: int):
        self.count = count

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        return args if not kwargs and len(args) == self.count else None


class Keywords:
    """``fn(a=t0, b=t1)``: keyword tensors, read by name; no other argument."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if args or len(kwargs) != len(self.names):
            return None
        try:  # as many keywords as names, and every name: exactly the names
            return [kwargs[name] for name in self.names]
        except KeyError:
            return None


class TensorDictKeys:
    """``module(td)``: the entries of a TensorDict at ``keys``, its other entries ignored.

    How a TensorDictModule reads its ``in_keys``. The batch size is compared too: the graph
    was captured for one.
    """

    def __init__(self, keys: Sequence[Any], batch_size: torch.Size):
        # Single-key tuples as plain strings, the faster lookups.
        self.keys = [key[0] if isinstance(key, tuple) and len(key) == 1 else key for key in keys]
        self.batch_size = batch_size

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if kwargs or len(args) != 1:
            return None
        td = args[0]
        if type(td) is not TensorDict or td.batch_size != self.batch_size:
            return None
        try:
            return [td[key] for key in self.keys]  # [] reads faster than get()
        except KeyError:
            return None


class TensorDictBatch:
    """``fn(td)``: one TensorDict of tensors, the function's only argument (a batch).

    All its entries are the inputs, so it must have no other: the number of entries, the
    batch size, the device and the absence of names are compared with the capture's.
    """

    def __init__(self, td: TensorDict):
        self.keys: list[Any] = sorted(td.keys())  # the flattening order (see `_tree`)
        self.batch_size = td.batch_size
        self.device = td.device

    @classmethod
    def of(cls, args: Args, kwargs: Kwargs) -> TensorDictBatch | None:
        """The reader of a call like ``(args, kwargs)``, if it is one TensorDict of tensors."""
        if kwargs or len(args) != 1 or type(args[0]) is not TensorDict:
            return None
        td = args[0]
        entries = _compat.td_entries(td).values()
        if _compat.td_has_names(td) or not all(isinstance(v, torch.Tensor) for v in entries):
            return None
        return cls(td)

    def read(self, args: Args, kwargs: Kwargs) -> Sequence[Any] | None:
        if kwargs or len(args) != 1:
            return None
        td = args[0]
        if type(td) is not TensorDict or td.batch_size != self.batch_size:
            return None
        entries = _compat.td_entries(td)  # the stored dict: no copy, no nested lookups
        if len(entries) != len(self.keys) or td.device != self.device or _compat.td_has_names(td):
            return None
        try:
            return [entries[key] for key in self.keys]
        except KeyError:
            return None


class Flattening:
    """Any call: its arguments flattened, their structure and constants compared."""

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
    return TensorDictBatch.of(args, kwargs) or Flattening(signature)


# Writers ---------------------------------------------------------------------------------


class Writer(Protocol):
    def write(self, args: Args, fresh: Sequence[torch.Tensor]) -> Any:
        """The call's result, from its arguments and the output tensors in fresh memory."""
        ...


class Tree:
    """The result in the structure the function returned."""

    def __init__(self, outputs: Outputs):
        self.rebuild = outputs.rebuild

    def write(self, args: Args, fresh: Sequence[torch.Tensor]) -> Any:
        return self.rebuild(fresh)


class IntoTensorDict:
    """The caller's TensorDict (the call's one argument), with ``keys`` set to the outputs."""

    def __init__(self, keys: Sequence[Any]):
        self.keys = [key[0] if isinstance(key, tuple) and len(key) == 1 else key for key in keys]

    def write(self, args: Args, fresh: Sequence[torch.Tensor]) -> Any:
        td = args[0]
        for key, value in zip(self.keys, fresh, strict=True):
            td[key] = value  # [] = writes faster than set()
        return td


class OutKeyValues:
    """The values of some outputs, as tensordict's ``dispatch`` returns the out_keys': the
    one tensor, or a tuple."""

    def __init__(self, indices: Sequence[int]):
        self.indices = list(indices)
        self.write = self._one if len(self.indices) == 1 else self._several

    def _one(self, args: Args, fresh: Sequence[torch.Tensor]) -> Any:
        return fresh[self.indices[0]]

    def _several(self, args: Args, fresh: Sequence[torch.Tensor]) -> Any:
        return tuple(fresh[i] for i in self.indices)


# The replay function ---------------------------------------------------------------------

Route = tuple[Reader, Writer]


def default_routes(captured: Captured) -> list[Route]:
    """The route of a function's graph: the fastest reader of its calls, the output tree."""
    return [(reader_for(captured.signature), Tree(captured.outputs))]


def replay_function(captured: Captured, routes: Sequence[Route]) -> ReplayFunction:
    """The replay path of ``captured``: the first reader of ``routes`` that reads the call,
    the metadata check, the launch, and that reader's writer; :data:`MISS` otherwise."""
    bound = [(reader.read, writer.write) for reader, writer in routes]
    expected = captured.signature.expected
    launch = captured.launch

    def replay(args: Args, kwargs: Kwargs) -> Any:
        for read, write in bound:  # noqa: B007 (the writer of the reader that read)
            tensors = read(args, kwargs)
            if tensors is not None:
                break
        else:
            return MISS
        try:
            same = list(map(metadata, tensors)) == expected
        except Exception:  # a leaf that is not a tensor
            same = False
        if not same:
            return MISS
        return write(args, launch(tensors))

    bare_replay = captured.bare_replay
    if len(expected) != 1 or bare_replay is None or len(captured.outputs.static) != 1:
        return replay

    # One tensor in, one out, on a bare graph: the commonest call (a network on a batch), in
    # the fewest steps. The same steps as `replay`, with the lists of one element unrolled,
    # which cost as much as the steps themselves at this size.
    (expected_one,) = expected
    static_inputs = captured.signature.static_inputs
    (static_output,) = captured.outputs.static

    def replay_one(args: Args, kwargs: Kwargs) -> Any:
        for read, write in bound:  # noqa: B007 (the writer of the reader that read)
            tensors = read(args, kwargs)
            if tensors is not None:
                break
        else:
            return MISS
        try:
            same = metadata(tensors[0]) == expected_one
        except Exception:
            same = False
        if not same:
            return MISS
        foreach_copy_(static_inputs, tensors)  # type: ignore[arg-type]  # faster than `copy_`
        bare_replay()
        return write(args, (static_output.clone(),))

    return replay_one
