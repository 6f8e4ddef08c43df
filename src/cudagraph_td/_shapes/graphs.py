"""Several shapes: the graphs of one mode of a wrapper, and the graph that each call replays.

``shapes="static"`` keeps one graph. ``"exact"`` captures one graph per input signature (the
call's structure and the shapes of its tensors), each on first sight with its own warm-up. ``"buckets"`` pads
the batch dims of a call to the next bucket size (see `_shapes.buckets`).

``Graphs`` holds the graphs of one mode: a runner per graph (`_capture.graph.GraphRunner`:
its warm-ups, capture and recaptures), and the entry of each captured graph
(`_capture.entry.GraphEntry`). ``Graphs.run`` is the one place that picks a graph by the
call's key, and answers the call on the wrapper's slow path: its result, and the entry that
the wrapper's table gives calls like it (`Answer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._capture import captured as _captured
from .._capture.captured import Captured
from .._capture.entry import GraphEntry
from .._capture.graph import GraphRunner, capture_turn
from .._errors import log as _log
from .._errors import shapes as _errors_shapes
from .._values import tree as _tree
from .._values.outputs import Outputs
from .._values.routes import Route
from .._values.signature import Signature
from .options import Buckets, Exact, Static

if TYPE_CHECKING:
    from .._capture.distributed import Agreement


class GraphInfo(NamedTuple):
    """One graph of a wrapper, as ``CudaGraphModule.graphs()`` lists it: the mode it
    serves (grad mode, training mode, interaction type, autocast, the values of static
    arguments), its key (None for ``shapes="static"``, the structure and input shapes for
    ``"exact"``, the batch dims for ``"buckets"``), whether it is captured, the calls it
    answered by a replay, and the fraction of the rows it replayed that were padding."""

    mode: str  # the mode it serves: grad mode, training mode, interaction type, autocast
    key: Any  # None ("static"), the input tensors' shapes ("exact"), the batch dims ("buckets")
    captured: bool  # False while it warms up
    replays: int  # the calls it answered by a replay
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


class Graphs:
    """The graphs of one mode of a wrapper, chosen by the shapes of each call.

    ``new_runner()`` makes the runner of a new graph; ``routes(signature, outputs)`` the
    routes of a captured graph's entry (see `_values.routes`); ``fn`` is the function, for
    the calls that no graph answers; ``label`` names the mode's graphs in log records (see
    `_errors.log`).
    """

    def __init__(
        self,
        name: str,
        options: Static | Exact | Buckets,
        agreement: Agreement | None,
        new_runner: Callable[[], GraphRunner],
        routes: Callable[[Signature, Outputs], list[Route]],
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
        self.runners: dict[Hashable, GraphRunner] = {}
        # The entry of each runner's captured graph, by the graph's key, and (buckets) of
        # its rows, by the rows' key (see `_shapes.buckets`).
        self.entries: dict[Hashable, GraphEntry] = {}
        self.precapturing = False
        self._new_runner = new_runner
        self._routes = routes
        self._lock = lock
        # Replays that no live entry counts: those of graphs captured again since, and of
        # calls padded to a bucket's graph; by (key, rows, padded rows).
        self._counts: dict[tuple[Hashable, int, int], int] = {}
        self.overflow = Overflow(options, self.label)

    @property
    def captured(self) -> Captured | None:
        """The one graph's captured call ("static"); None otherwise (for the TensorDict layer)."""
        runner = self.runners.get(None) if isinstance(self.options, Static) else None
        return None if runner is None else runner.captured

    def release(self) -> None:
        """Its graphs go (a reset, the wrapper deleted): their loans end now."""
        for runner in self.runners.values():
            runner.release()

    def captured_any(self) -> bool:
        return any(runner.captured is not None for runner in self.runners.values())

    def counter(self) -> int:
        """The calls before the first replay, of the graph that went furthest."""
        return max((runner.counter for runner in self.runners.values()), default=0)

    def stage(self) -> str:
        """Where the graphs stand, for the wrapper's ``repr``."""
        captured = sum(runner.captured is not None for runner in self.runners.values())
        if not isinstance(self.options, Static):
            return f"{captured} of {len(self.runners)} graphs captured"
        if captured:
            return "captured: calls replay the graph"
        warmups = next(iter(self.runners.values())).warmup - 1 if self.runners else 0
        return f"warming up: {self.counter()} of {warmups} warm-up calls done"

    # Picking the graph ---------------------------------------------------------------------

    def run(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: _tree.Flat | None = None
    ) -> Answer:
        """Warm up, capture or replay the call's graph (the one place that picks it).
        ``flat``: the call flattened already, if it is; else flattened here, once."""
        if flat is None:
            flat = _tree.flatten((args, kwargs))
        key = None if isinstance(self.options, Static) else exact_key(flat)
        if key is not None and self.agreement is not None:
            self.agreement.same(key, _shown(key))
        runner = self.runners.get(key)
        if runner is None:
            if self.runners and isinstance(self.options, Exact):
                self._admit(key, args, kwargs)
                if len(self.runners) >= self.options.max_graphs:
                    return Answer(self._overflow(args, kwargs, None))
            runner = self.runners[key] = self.new_runner(key)
        return self._run(key, runner, args, kwargs, flat)

    def new_runner(self, key: Hashable) -> GraphRunner:
        """The runner of the graph of ``key``, which names it so in log records."""
        runner = self._new_runner()
        runner.label = self.label if key is None else f"{self.label}, key {_shown(key)}"
        return runner

    def _run(
        self,
        key: Hashable,
        runner: GraphRunner,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        flat: _tree.Flat | None = None,
        rows: int = 1,
        padded_rows: int = 1,
    ) -> Answer:
        """The call's graph: replayed, checked in full, if it is captured and the state it
        reads holds; else warmed up, captured, or captured again (`GraphRunner.run`). A call
        padded to a bucket's graph (``rows`` of ``padded_rows``) is counted apart."""
        entry = self.entry(key, runner)
        if entry is not None and entry.holds():
            if rows == padded_rows:
                return Answer(entry.call(args, kwargs, flat), entry, replayed=True)
            out = _captured.call(entry.graph, args, kwargs, flat)
            where = (key, rows, padded_rows)
            self._counts[where] = self._counts.get(where, 0) + 1
            return Answer(out, entry, replayed=True, for_table=False)
        out = runner.run(args, kwargs)
        return Answer(out, self.entry(key, runner))

    def entry(self, key: Hashable, runner: GraphRunner) -> GraphEntry | None:
        """The entry of ``runner``'s captured graph (None while it warms up), made once."""
        captured = runner.captured
        if captured is None:
            return None
        entry = self.entries.get(key)
        if entry is None or entry.source is not captured:
            self._forget_replaced()
            routes = self._routes(captured.signature, captured.outputs)
            entry = self.entries[key] = GraphEntry(key, captured, routes, runner)
        return entry

    def _forget_replaced(self) -> None:
        """Drop the entries of graphs captured again since (a replaced parameter): they
        would keep the old graphs and their buffers alive. Their counts stay."""
        for where, entry in list(self.entries.items()):
            if not entry.alive():
                del self.entries[where]
                counted = (entry.key, entry.rows, entry.padded_rows)
                self._counts[counted] = self._counts.get(counted, 0) + entry.replays

    def _admit(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise if a call differs by more than its shapes from the graphs of its structure
        (``key``'s first item); a call of another structure (an optional argument passed, or
        None) takes a graph of its own."""
        for other, runner in self.runners.items():
            if other[0] == key[0] and runner.captured is not None:  # type: ignore[index]
                error = runner.captured.signature.diagnose(args, kwargs, shapes=False)
                if error is not None:
                    raise error
                return

    def _overflow(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any, *, elsewhere: bool = False
    ) -> Any:
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
            seen = [_shown(k) for k in self.runners]
            message = _errors_shapes.too_many_graphs(
                self.name, options.max_graphs, seen, options.overflow
            )
        return self.overflow.call(self._fn, args, kwargs, self._lock, reason, message)

    # Introspection -------------------------------------------------------------------------

    def infos(self, mode: str) -> list[GraphInfo]:
        """The graphs of this mode."""
        counts = dict(self._counts)
        for entry in self.entries.values():
            counted = (entry.key, entry.rows, entry.padded_rows)
            counts[counted] = counts.get(counted, 0) + entry.replays
        replays: dict[Hashable, int] = {}
        rows: dict[Hashable, list[int]] = {}
        for (key, real, padded), hits in counts.items():
            replays[key] = replays.get(key, 0) + hits
            total = rows.setdefault(key, [0, 0])
            total[0] += hits * real
            total[1] += hits * padded
        infos = []
        for key, runner in self.runners.items():
            real, padded = rows.get(key, (0, 0))
            fraction = 1 - real / padded if padded else 0.0
            captured = runner.captured is not None
            infos.append(GraphInfo(mode, _shown(key), captured, replays.get(key, 0), fraction))
        return infos


def _shown(key: Hashable) -> Any:
    """A graph's key as users read it: for ``"exact"``, the input shapes alone."""
    if isinstance(key, tuple) and len(key) == 2 and not isinstance(key[0], int):
        return key[1]
    return key


def exact_key(flat: _tree.Flat) -> Hashable:
    """The graph of a call with ``shapes="exact"``, from its flattened arguments: its
    structure (the treespec, TensorDict batch sizes included, and which leaves are tensors:
    ``f(x, 2.0)`` and ``f(2.0, x)`` differ), the shapes of its tensors and which require
    grad. Other differences (dtypes, constants) are the errors of the graph's full check."""
    leaves, spec = flat
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
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
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
            return fn(*args, **kwargs)
