"""Several shapes: the graphs of one mode of a wrapper, and the graph that each call replays.

``shapes="static"`` keeps one graph. ``"exact"`` captures one graph per input signature
(the call's structure and the shapes of its tensors), each on first sight with its own
warm-up. ``"buckets"`` pads the batch dims of a call to the next bucket size (see
`_shapes.buckets`).

``Graphs`` holds the graphs of one mode, device and static values: each one's entry
(`_capture.entry.GraphEntry`: its warm-ups, capture, recaptures and replays) by its key
(`GraphKey`). ``Graphs.run`` is the one place that picks a graph by the call's key, and
answers the call on the wrapper's slow path: its result, and the entry that the wrapper's
table gives calls like it (`Answer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._capture.captured import Captured
from .._capture.entry import GraphEntry, GraphKey
from .._capture.graph import capture_turn
from .._errors import log as _log
from .._errors import shapes as _errors_shapes
from .._values.tree import Call
from .options import Buckets, Exact, Static

if TYPE_CHECKING:
    from .._capture.distributed import Agreement


class GraphInfo(NamedTuple):
    """One graph of a wrapper, as ``CudaGraphModule.graphs()`` lists it: the mode it
    serves (grad mode, training mode, interaction type, autocast, the values of static
    arguments), its key (None for ``shapes="static"``, the structure and input shapes for
    ``"exact"``, the batch dims for ``"buckets"``), whether it is captured, the calls it
    answered by a replay since it was last captured (a recapture, after a replaced
    parameter, starts the count again), and the fraction of the rows it replayed that were
    padding."""

    mode: str  # the mode it serves: grad mode, training mode, interaction type, autocast
    key: Any  # None ("static"), the input tensors' shapes ("exact"), the batch dims ("buckets")
    captured: bool  # False while it warms up
    replays: int  # the calls its current capture answered by a replay
    padded: float  # the fraction of the rows it replayed that were padding


GraphInfo.__module__ = "cudagraph_td"  # where users import it from


class GraphList(list[GraphInfo]):
    """What ``CudaGraphModule.graphs()`` returns: a list of ``GraphInfo``, and
    ``eager_calls``, the calls that no graph answered and that ran eagerly, by reason."""

    def __init__(self, infos: list[GraphInfo], eager_calls: dict[str, int]):
        super().__init__(infos)
        self.eager_calls = eager_calls


class Answer(NamedTuple):
    """What the slow path of one call gives the wrapper: the call's result, the entry of the
    graph that answered it by a replay or by its capture (None for a warm-up or an eager
    call), whether by a replay (for verify=), and whether calls like it may replay that
    entry from the wrapper's table (not a call padded to a bucket's graph)."""

    result: Any
    entry: GraphEntry | None = None
    replayed: bool = False
    for_table: bool = True


NewEntry = Callable[..., GraphEntry]
"""Makes the entry of a new graph, from its key and its label in log records."""


class Graphs:
    """The graphs of one mode, device and static values of a wrapper, by the shapes of
    each call: ``entries``, each graph's entry by its key, made on first sight.

    ``key`` is theirs (``shapes`` None); ``new_entry(key, label)`` makes the entry of a new
    graph; ``fn`` is the function, for the calls that no graph answers; ``label`` names
    the mode's graphs in log records (see `_errors.log`).
    """

    def __init__(
        self,
        name: str,
        options: Static | Exact | Buckets,
        agreement: Agreement | None,
        key: GraphKey,
        new_entry: NewEntry,
        fn: Callable[..., Any],
        lock: Any,
        label: str = "",
    ):
        self.name = name
        self.label = label or name
        self._fn = fn
        self.options = options
        # The ranks' agreement on each call's graph, for a DDP step (see `_capture.distributed`).
        self.agreement = agreement
        self.key = key
        self.entries: dict[GraphKey, GraphEntry] = {}
        self.precapturing = False
        self._new_entry = new_entry
        self._lock = lock
        self.overflow = Overflow(options, self.label)

    @property
    def captured(self) -> Captured | None:
        """The one graph's captured call ("static"); None otherwise (for the TensorDict layer)."""
        entry = self.entries.get(self.key) if isinstance(self.options, Static) else None
        return None if entry is None else entry.captured

    def release(self) -> None:
        """Its graphs go (a reset, the wrapper deleted): their loans end now."""
        for entry in self.entries.values():
            entry.release()

    def captured_any(self) -> bool:
        return any(entry.captured is not None for entry in self.entries.values())

    def counter(self) -> int:
        """The calls before the first replay, of the graph that went furthest."""
        return max((entry.counter for entry in self.entries.values()), default=0)

    def stage(self) -> str:
        """Where the graphs stand, for the wrapper's ``repr``."""
        captured = sum(entry.captured is not None for entry in self.entries.values())
        if not isinstance(self.options, Static):
            return f"{captured} of {len(self.entries)} graphs captured"
        if captured:
            return "captured: calls replay the graph"
        warmups = next(iter(self.entries.values())).warmup - 1 if self.entries else 0
        return f"warming up: {self.counter()} of {warmups} warm-up calls done"

    # Picking the graph ---------------------------------------------------------------------

    def run(self, call: Call) -> Answer:
        """Warm up, capture or replay the call's graph (the one place that picks it)."""
        shapes = None if isinstance(self.options, Static) else exact_key(call)
        if shapes is not None and self.agreement is not None:
            self.agreement.same(shapes, _shown(shapes))
        key = self.key._replace(shapes=shapes)
        entry = self.entries.get(key)
        if entry is None:
            if self.entries and isinstance(self.options, Exact):
                self._admit(shapes, call)
                if len(self.entries) >= self.options.max_graphs:
                    return Answer(self._overflow(call, None))
            entry = self.entries[key] = self.new_entry(shapes)
        out, replayed = entry.run(call)
        return Answer(out, entry if entry.captured is not None else None, replayed)

    def new_entry(self, shapes: Hashable) -> GraphEntry:
        """The entry of the graph of ``shapes``, which names it so in log records."""
        label = self.label if shapes is None else f"{self.label}, key {_shown(shapes)}"
        return self._new_entry(self.key._replace(shapes=shapes), label=label)

    def _admit(self, shapes: Any, call: Call) -> None:
        """Raise if a call differs by more than its shapes from the graphs of its structure
        (``shapes``' first item); a call of another structure (an optional argument passed,
        or None) takes a graph of its own."""
        for key, entry in self.entries.items():
            if key.shapes[0] == shapes[0] and entry.captured is not None:  # type: ignore[index]
                error = entry.captured.signature.diagnose(call, shapes=False)
                if error is not None:
                    raise error
                return

    def _overflow(self, call: Call, batch: Any, *, elsewhere: bool = False) -> Any:
        """A call past ``max_graphs`` or, with its ``batch``, above the largest bucket (on
        this rank, or on another rank of a DDP step: ``elsewhere``): eager, or an error."""
        options = self.options
        if batch is not None:
            assert isinstance(options, Buckets)
            if options.overflow == "raise":
                raise _errors_shapes.above_buckets(self.name, batch, options.sizes, elsewhere)
            reason = _errors_shapes.ABOVE_BUCKETS
            message = _errors_shapes.above_buckets_eager(self.name, batch, options.sizes, elsewhere)
        else:
            reason = _errors_shapes.PAST_MAX_GRAPHS
            seen = [_shown(key.shapes) for key in self.entries]
            message = _errors_shapes.too_many_graphs(
                self.name, options.max_graphs, seen, options.overflow
            )
        return self.overflow.call(self._fn, call, self._lock, reason, message)

    # Introspection -------------------------------------------------------------------------

    def infos(self, mode: str) -> list[GraphInfo]:
        """The graphs of this mode: each one's replays since its capture (see
        `GraphEntry.counts`)."""
        infos = []
        for key, entry in self.entries.items():
            replays, rows, replayed_rows = entry.counts()
            padded = 1 - rows / replayed_rows if replayed_rows else 0.0
            captured = entry.captured is not None
            infos.append(GraphInfo(mode, _shown(key.shapes), captured, replays, padded))
        return infos


def _shown(key: Hashable) -> Any:
    """A graph's key as users read it: for ``"exact"``, the input shapes alone."""
    if isinstance(key, tuple) and len(key) == 2 and not isinstance(key[0], int):
        return key[1]
    return key


def exact_key(call: Call) -> Hashable:
    """The graph of a call with ``shapes="exact"``, from its flattened arguments: its
    structure (the treespec, TensorDict batch sizes included, and which leaves are tensors:
    ``f(x, 2.0)`` and ``f(2.0, x)`` differ), the shapes of its tensors and which require
    grad. Other differences (dtypes, constants) are the errors of the graph's full check."""
    leaves, spec = call.leaves, call.spec
    places = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    tensors = [leaves[i] for i in places]
    shapes = tuple(tuple(t.shape) for t in tensors)
    if any(t.requires_grad for t in tensors):
        shapes += (tuple(t.requires_grad for t in tensors),)
    try:
        hash(spec)
    except TypeError:  # a node's metadata that is not hashable
        return ((str(spec), places), shapes)
    return ((spec, places), shapes)


class Overflow:
    """A call that no graph answers (past ``max_graphs`` graphs or static values, above the
    largest bucket): the function run eagerly, after a ``GraphLimitWarning`` (once per
    reason), or an error. ``calls`` counts the eager calls by reason, for ``graphs()``."""

    def __init__(self, options: Static | Exact | Buckets, label: str):
        self.options = options
        self.label = label  # the graphs', in log records
        self.calls: dict[str, int] = {}

    def call(
        self,
        fn: Callable[..., Any],
        call: Call,
        lock: Any,
        reason: str,
        message: str,
        stacklevel: int = 6,
    ) -> Any:
        """Run ``fn`` for a call that no graph answers, for ``reason``, after ``message`` as
        a warning the first time; raise ``message`` instead if ``overflow="raise"``."""
        if self.options.overflow == "raise":
            raise RuntimeError(message)
        calls = self.calls[reason] = self.calls.get(reason, 0) + 1
        if calls == 1:
            warnings.warn(message, _errors_shapes.GraphLimitWarning, stacklevel=stacklevel)
        _log.ran_eagerly(self.label, reason, calls)
        with capture_turn(lock):  # the wrapper's function runs only under it
            return fn(*call.args, **call.kwargs)
