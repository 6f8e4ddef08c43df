"""A graph entry: one captured graph, as a wrapper's table holds it and a call replays it.

An entry holds its graph's key among the graphs of its mode, the captured call (a plain
graph, `_capture.graph.GraphCall`, or a forward and backward pair in one autograd node,
`_capture.autograd.DifferentiableCall`, with the static input buffers), the routes by
which it reads a call's input tensors and writes its result (`_values.routes`), and its
counters. ``replay`` is the replay path, top to bottom:

1. the route of the call's kind (positional, keywords, ``tensordict_out=``) reads the input
   tensors, or misses;
2. one metadata check: (type, shape, dtype, device, ``requires_grad``) of each tensor, and
   the state the graph reads (parameters, buffers: see `_state.state`);
3. the launch: copy into the static inputs, replay, outputs in fresh memory (through the
   autograd node in grad mode);
4. the route's writer gives the result its form.

A call that a reader cannot read, or that the check refuses, is a *miss*: ``replay`` returns
``MISS``, and the wrapper takes its slow path, whose checked replay (``call``) checks the
call in full and raises the error that names the leaf. Only the slow path explains.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from .._compat import foreach_copy_, td_entries, td_set
from .._values.routes import (
    TENSORDICT_OUT,
    Args,
    IntoTensorDict,
    Keywords,
    Kwargs,
    Route,
    TensorDictEntries,
)
from .._values.signature import metadata
from .._values.tree import Flat
from . import captured as _captured
from .captured import Captured

MISS: Any = object()
"""What ``GraphEntry.replay`` returns for a call it leaves to the slow path."""

Read = Callable[[Args, Kwargs], Sequence[Any] | None]
Write = Callable[[Args, Kwargs, Sequence[torch.Tensor]], Any]


def _miss(args: Args, kwargs: Kwargs) -> None:
    """The reader of a call kind that no route reads."""
    return None


class GraphEntry:
    """One captured graph: its key, the captured call, its routes, its counters.

    ``key`` is the graph's key among the graphs of its mode (None for ``shapes="static"``,
    the call's structure and shapes for ``"exact"``, the bucket for ``"buckets"``).
    ``routes`` holds a route for calls without keywords and one for calls with keywords, or
    one route for both (its reader tells), and for a TensorDict module a route for calls with
    ``tensordict_out`` (else they take the keywords' route). ``runner`` is the graph's
    runner (`_capture.graph.GraphRunner`), and ``source`` the runner's captured call that
    ``graph`` is or views (a bucket's rows are an entry of their own, over the bucket's
    graph): the entry is ``alive`` while the runner holds it (a recapture replaces it).
    ``rows`` and ``padded_rows``: the batch of the calls it answers, and of its graph.
    """

    def __init__(
        self,
        key: Hashable,
        graph: Captured,
        routes: Sequence[Route],
        runner: Any = None,
        source: Captured | None = None,
        rows: int = 1,
        padded_rows: int = 1,
    ):
        self.key = key
        self.graph = graph
        self.runner = runner
        self.source = graph if source is None else source
        self.rows, self.padded_rows = rows, padded_rows
        self.replays = 0  # the calls it answered, on either path
        by_position: tuple[Read, Write | None] = (_miss, None)
        by_keywords = by_position
        by_out = None
        self._names: list[str] | None = None
        one = graph.one_tensor
        # A TensorDict module's commonest graph, one in_key and one out_key, read and written
        # by the replay itself (two calls fewer: 1.6 us of 41 a call, measured on an H100).
        self._td_in: Any = None
        self._td_out: Any = None
        for reader, writer in routes:
            if (
                one is not None
                and type(reader) is TensorDictEntries
                and reader.flat
                and not reader.exact
                and len(reader.keys) == 1
                and isinstance(writer, IntoTensorDict)
                and writer.flat
                and writer.key is not None
                and not writer.into_out
            ):
                self._td_in, self._td_out, self._td_batch = (
                    reader.keys[0],
                    writer.key,
                    reader.batch_size,
                )
                self._td_device = writer.device
            # A result that is the first output itself needs no call: the replay returns it.
            route = (reader.read, None if writer.returns_first else writer.write)
            if reader.keywords == TENSORDICT_OUT:
                by_out = route
                continue
            if reader.keywords is not True:
                by_position = route
            if reader.keywords is not False:
                by_keywords = route
                if isinstance(reader, Keywords):  # its names, for `input_buffers`
                    self._names = reader.names
        self._by_position, self._by_keywords = by_position, by_keywords
        self._by_out = by_keywords if by_out is None else by_out
        expected = self._expected = graph.signature.expected
        # One tensor in: its metadata compared without a list of one element.
        self._one = expected[0] if len(expected) == 1 else None
        # The state it reads (see `_state.state`): a replaced parameter is a miss, and a recapture.
        self._state_holds = graph.state.fresh if graph.state is not None else None
        # A plain graph with one tensor in and one out: its launch done here, without a call.
        self._static_inputs: list[torch.Tensor] | None = one.static_inputs if one else None
        self._one_output: Callable[[], torch.Tensor] | None = one.output if one else None
        self._one_tensor_replay: Callable[[], None] | None = one.replay if one else None

    def alive(self) -> bool:
        """Whether its graph is still its runner's (not captured again since)."""
        return self.runner is None or self.runner.captured is self.source

    def holds(self) -> bool:
        """Whether the state its graph reads holds (see `_state.state`): else a recapture."""
        return self._state_holds is None or self._state_holds()

    def replay(self, args: Args, kwargs: Kwargs) -> Any:
        """Replay the graph for this call; ``MISS`` if the call is not one it reads."""
        td = None
        if kwargs:
            read, write = self._by_out if TENSORDICT_OUT in kwargs else self._by_keywords
            tensors = read(args, kwargs)
        elif self._td_in is not None:  # `module(td)`: its one in_key read here
            td = args[0] if len(args) == 1 else None
            if type(td) is not TensorDict or td.batch_size != self._td_batch:
                return MISS
            tensors = (td_entries(td).get(self._td_in),)
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
        one_tensor_replay = self._one_tensor_replay
        if one_tensor_replay is not None:
            static_inputs = self._static_inputs
            if tensors[0] is not static_inputs[0]:  # type: ignore[index]  # (see `input_buffers`)
                foreach_copy_(static_inputs, tensors)  # type: ignore[arg-type]  # faster than copy_
            one_tensor_replay()
            fresh: Sequence[torch.Tensor] = (self._one_output(),)  # type: ignore[misc]
        else:
            fresh = self.graph.launch(tensors)
        self.replays += 1
        if td is not None:  # its one out_key set here (see `IntoTensorDict.write`)
            device = td.device
            if device is None or device == self._td_device:
                td_set(td, self._td_out, fresh[0])
            else:
                td[self._td_out] = fresh[0]
            return td
        return fresh[0] if write is None else write(args, kwargs, fresh)

    def reads(self, args: Args, kwargs: Kwargs) -> bool:
        """Whether a replay would read this call (its kind, structure and tensors' metadata)."""
        if kwargs:
            read = (self._by_out if TENSORDICT_OUT in kwargs else self._by_keywords)[0]
        else:
            read = self._by_position[0]
        tensors = read(args, kwargs)
        try:
            return tensors is not None and list(map(metadata, tensors)) == self._expected
        except Exception:  # a leaf that is not a tensor
            return False

    def input_buffers(self, keywords: bool) -> tuple[Args, Kwargs]:
        """The graph's static inputs, as ``(args, kwargs)`` of a call that replays it with no
        input copied: keyword tensors by name for ``keywords`` where a route reads them so,
        else the captured call's structure. From now on, a launch copies no input that is
        its static input."""
        self.graph.inputs_lent = True
        signature = self.graph.signature
        if keywords and self._names is not None:
            return (), dict(zip(self._names, signature.static_inputs, strict=True))
        return signature.static_tree()

    def call(self, args: Args, kwargs: Kwargs, flat: Flat | None = None) -> Any:
        """The slow path's replay: the full check, which raises the error naming the leaf,
        then the launch; the result in the structure the function returned (``flat``: the
        call flattened already, if it is)."""
        out = _captured.call(self.graph, args, kwargs, flat)
        self.replays += 1
        return out
