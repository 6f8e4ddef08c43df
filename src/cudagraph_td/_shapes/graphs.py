"""Several shapes: the graphs of one mode of a wrapper, and the graph that each call replays.

``shapes="static"`` keeps one graph. ``"exact"`` captures one graph per input signature (the
call's structure and the shapes of its tensors), each on first sight with its own warm-up. ``"buckets"`` pads
the batch dims of a call to the next bucket size (see `_shapes.buckets`).

``Graphs`` holds the graphs of one mode. ``Graphs.run`` is the one place that picks
a graph by the call's key. ``Graphs.replay`` is the mode's replay path: the one graph's,
or a table from the shape of the call's first input to the replay path of the graph that
served the last call of that shape (learned on the slow path, see ``Graphs.learn``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol

import torch

from .._capture.captured import Captured
from .._capture.graph import GraphRunner, capture_turn
from .._errors import log as _log
from .._errors import shapes as _errors_shapes
from .._values import tree as _tree


class ShapeOptions(NamedTuple):
    """The shape options of a wrapper as the library reads them (users write a ``Static``,
    ``Exact`` or ``Buckets``: see `_shapes.options`)."""

    shapes: str = "static"
    buckets: tuple[int, ...] | None = None
    max_graphs: int = 8
    batch_dims: int = 1
    overflow: str = "eager"
    row_independent: bool = False
    # The ranks' agreement on each call's graph, for a DDP step (`_capture.distributed.Agreement`).
    agreement: Any = None


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


class Path(Protocol):
    """A replay path (`_call.replay.ReplayPath`), as the graphs count its replays."""

    hits: int  # the calls it answered

    def alive(self) -> bool:
        """Whether the graph it replays is still its runner's."""
        ...


class Served(NamedTuple):
    """The graph that answered the last call by a replay (see `Graphs.learn`): its key, the
    captured call that answered (a bucket's rows are calls of their own), the runner's graph
    it replays (``source``, which ``captured`` is or views), the runner, the rows of the call
    and of its graph, and its replay path if the wrapper made one already (see `Graphs.keep`)."""

    key: Hashable
    captured: Captured
    source: Captured
    runner: GraphRunner
    rows: int
    padded_rows: int
    path: Any  # the wrapper's replay path (a `Path`), or None


class Graphs:
    """The graphs of one mode of a wrapper, chosen by the shapes of each call.

    ``new_runner()`` makes the runner of a new graph; ``settled(key)`` says whether the graph of ``key`` may take the replay path (not while
    ``verify=`` still checks its replays); ``fn`` is the function, for the calls that no
    graph answers; ``label`` names the mode's graphs in log records (see `_errors.log`).
    """

    def __init__(
        self,
        name: str,
        options: ShapeOptions,
        new_runner: Callable[[], GraphRunner],
        settled: Callable[[Hashable], bool],
        fn: Callable[..., Any],
        lock: Any,
        label: str = "",
    ):
        self.name = name
        self.label = label or name
        self._fn = fn
        self.options = options
        self.runners: dict[Hashable, GraphRunner] = {}
        # The key and captured call of the graph whose replay answered the last call through
        # `run`, else None (see verify=).
        self.replayed: tuple[Hashable, Captured] | None = None
        self.precapturing = False
        self._new_runner = new_runner
        self._settled = settled
        self._lock = lock
        self._served: tuple[Hashable, Captured, int, int] | None = None  # see `learn`
        # Replays counted on the slow path, and per replay path: (key, rows, padded, count).
        self._counts: list[tuple[Hashable, int, int, Tally | Path]] = []
        self._slow: dict[tuple[Hashable, int, int], Tally] = {}
        # The replay path of each captured call (a bucket's rows are calls of their own).
        self._paths: dict[int, tuple[Path, Captured]] = {}
        self._views: dict[Hashable, tuple[Captured, Captured]] = {}
        self.overflow = Overflow(options, self.label)

    @property
    def captured(self) -> Captured | None:
        """The one graph's captured call ("static"); None otherwise (for the TensorDict layer)."""
        runner = self.runners.get(None) if self.options.shapes == "static" else None
        return None if runner is None else runner.captured

    def captured_any(self) -> bool:
        return any(runner.captured is not None for runner in self.runners.values())

    def counter(self) -> int:
        """The calls before the first replay, of the graph that went furthest."""
        return max((runner.counter for runner in self.runners.values()), default=0)

    def stage(self) -> str:
        """Where the graphs stand, for the wrapper's ``repr``."""
        captured = sum(runner.captured is not None for runner in self.runners.values())
        if self.options.shapes != "static":
            return f"{captured} of {len(self.runners)} graphs captured"
        if captured:
            return "captured: calls replay the graph"
        warmups = next(iter(self.runners.values())).warmup - 1 if self.runners else 0
        return f"warming up: {self.counter()} of {warmups} warm-up calls done"

    # Picking the graph ---------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Warm up, capture or replay the call's graph (the one place that picks it)."""
        self.replayed = self._served = None
        shapes = self.options.shapes
        key = None if shapes == "static" else exact_key(args, kwargs)
        if key is not None and self.options.agreement is not None:
            self.options.agreement.same(key, _shown(key))
        runner = self.runners.get(key)
        if runner is None:
            if self.runners and shapes == "exact":
                self._admit(key, args, kwargs)
                if len(self.runners) >= self.options.max_graphs:
                    return self._overflow(args, kwargs, None)
            runner = self.runners[key] = self.new_runner(key)
        return self._run(key, runner, args, kwargs, 1, 1)

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
        rows: int,
        padded_rows: int,
    ) -> Any:
        captured = runner.captured
        out = runner.run(args, kwargs)
        if captured is not None and runner.captured is captured:  # a replay
            # A padded call's graph does not take calls of its rows on the replay path.
            self._replayed(key, captured, rows, padded_rows, learn=rows == padded_rows)
        elif runner.captured is not None and rows == padded_rows:  # captured by this call
            self._served = (key, runner.captured, rows, padded_rows)
        return out

    def _replayed(
        self, key: Hashable, captured: Captured, rows: int, padded_rows: int, learn: bool = True
    ) -> None:
        self.replayed = (key, captured)
        if learn:
            self._served = (key, captured, rows, padded_rows)
        count = self._slow.get((key, rows, padded_rows))
        if count is None:
            count = self._slow[(key, rows, padded_rows)] = Tally()
            self._counts.append((key, rows, padded_rows, count))
        count.hits += 1

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
            if options.overflow == "raise":
                raise _errors_shapes.above_buckets(self.name, batch, options.buckets, elsewhere)
            reason = _errors_shapes.ABOVE_BUCKETS
            message = _errors_shapes.above_buckets_eager(
                self.name, batch, options.buckets, elsewhere
            )
        else:
            reason = _errors_shapes.PAST_MAX_GRAPHS
            seen = [_shown(k) for k in self.runners]
            message = _errors_shapes.too_many_graphs(
                self.name, options.max_graphs, seen, options.overflow
            )
        return self.overflow.call(self._fn, args, kwargs, self._lock, reason, message)

    # The replay path -----------------------------------------------------------------------

    def learn(self) -> Served | None:
        """The graph that answered the last call by a replay, whose replay path the wrapper's
        graph table gives calls like it (see `_call.table`), with that path if the wrapper
        made it already (else it makes it and gives it to `keep`); None if no graph did, or
        while its replays take the slow path (verify=, a DDP step's agreement)."""
        served = self._served
        if served is None or self.options.agreement is not None:  # each call agrees first
            return None
        key, captured, rows, padded_rows = served
        if not self._settled(key):
            return None
        known = self._paths.get(id(captured))
        path = known[0] if known is not None and known[1] is captured else None
        runner = self.runners[key]
        source = runner.captured or captured
        return Served(key, captured, source, runner, rows, padded_rows, path)

    def keep(self, served: Served, path: Path) -> None:
        """Keep ``path``, the new replay path of ``served``, for the next calls it answers on
        the slow path (`learn`), and count its replays in ``graphs()``."""
        self._forget_replaced()
        self._counts.append((served.key, served.rows, served.padded_rows, path))
        self._paths[id(served.captured)] = (path, served.captured)

    def _forget_replaced(self) -> None:
        """Drop the replay paths and views of graphs captured again since (a replaced
        parameter): they would keep the old graphs and their buffers alive."""
        live = {id(runner.captured) for runner in self.runners.values()}
        self._views = {k: v for k, v in self._views.items() if id(v[0]) in live}
        live |= {id(view) for _, view in self._views.values()}
        self._paths = {k: v for k, v in self._paths.items() if k in live}
        # Their counts stay, without them.
        for i, (key, rows, padded, count) in enumerate(self._counts):
            if not isinstance(count, Tally) and not count.alive():
                self._counts[i] = (key, rows, padded, Tally(count.hits))

    # Introspection -------------------------------------------------------------------------

    def infos(self, mode: str) -> list[GraphInfo]:
        """The graphs of this mode."""
        replays: dict[Hashable, int] = {}
        rows: dict[Hashable, list[int]] = {}
        for key, real, padded, count in self._counts:
            replays[key] = replays.get(key, 0) + count.hits
            total = rows.setdefault(key, [0, 0])
            total[0] += count.hits * real
            total[1] += count.hits * padded
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


def exact_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The graph of a call with ``shapes="exact"``: its structure (the treespec, TensorDict
    batch sizes included, and which leaves are tensors: ``f(x, 2.0)`` and ``f(2.0, x)``
    differ), the shapes of its tensors and which require grad. Other differences (dtypes,
    constants) are the errors of the graph's full check."""
    leaves, spec = _tree.flatten((args, kwargs))
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


def make_graphs(
    cls: type[Graphs],
    name: str,
    options: ShapeOptions,
    new_runner: Callable[[], GraphRunner],
    verifier: Any,
    mode: Hashable,
    fn: Callable[..., Any],
    lock: Any,
    label: str = "",
) -> Graphs:
    """The graphs of one mode (and device) of a wrapper, ``mode`` its key there. Nothing in
    them refers to the wrapper, so that dropping it frees them at once, without the garbage
    collector. ``cls``: `Graphs`, or its subclass for ``shapes="buckets"``."""
    settled = functools.partial(_settled, verifier, mode)
    return cls(name, options, new_runner, settled, fn, lock, label)


def _settled(verifier: Any, mode: Hashable, key: Hashable) -> bool:
    """Whether a graph's replays may take the replay path: not while verify= checks them."""
    return verifier is None or not verifier.wants((mode, key))


class Tally:
    """The replays of one graph counted on the slow path (a replay path counts its own)."""

    def __init__(self, hits: int = 0):
        self.hits = hits


class Overflow:
    """A call that no graph answers (past ``max_graphs`` graphs or static values, above the
    largest bucket): the function run eagerly, after a ``GraphLimitWarning`` (once per
    reason), or an error. ``calls`` counts the eager calls by reason, for ``graphs()``."""

    def __init__(self, options: ShapeOptions, label: str):
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
