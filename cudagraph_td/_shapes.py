"""Several shapes: the graphs of one mode of a wrapper, and the graph that each call replays.

``shapes="static"`` keeps one graph. ``"exact"`` captures one graph per input signature (the
shapes of the call's tensors), each on first sight with its own warm-up. ``"buckets"`` pads
the batch dims of a call to the next bucket size, replays that size's graph, and slices the
outputs back (see `_padding`); a bucket's graph then serves every smaller batch through views
of its buffers (:meth:`GraphCall.rows`), on the replay path like any graph.

:class:`Graphs` holds the graphs of one mode. :meth:`Graphs.run` is the one place that picks
a graph by the call's key. :attr:`Graphs.replay` is the mode's replay path: the one graph's,
or a table from the shape of the call's first input to the replay path of the graph that
served the last call of that shape (learned on the slow path, see :meth:`Graphs.learn`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch

from . import _errors, _errors_shapes, _padding, _tree
from ._graph import GraphCall, GraphRunner, capture_turn
from ._outputs import Outputs
from ._replay import MISS, Captured, ReplayFunction, call
from ._signature import Signature

SHAPES = ("static", "exact", "buckets")
OVERFLOW = ("eager", "raise")


class ShapeOptions(NamedTuple):
    shapes: str = "static"
    buckets: tuple[int, ...] | None = None
    max_graphs: int = 8
    batch_dims: int = 1
    overflow: str = "eager"
    row_independent: bool = False


def shape_options(
    shapes: str,
    buckets: Any,
    max_graphs: int,
    batch_dims: int,
    overflow: str,
    row_independent: bool,
) -> ShapeOptions:
    """The options of ``shapes=``, checked.

    Raises:
        ValueError: An option has no valid value, or ``buckets`` without ``shapes="buckets"``.
    """
    for option, value, valid in (("shapes", shapes, SHAPES), ("overflow", overflow, OVERFLOW)):
        if value not in valid:
            raise _errors.invalid_option(option, value, valid)
    for option, number in (("max_graphs", max_graphs), ("batch_dims", batch_dims)):
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise _errors.invalid_option(option, number, "an integer greater than 0")
    if not isinstance(row_independent, bool):
        raise _errors.invalid_option("row_independent", row_independent, "True or False")
    if buckets is not None:
        if shapes != "buckets":
            raise _errors_shapes.buckets_without_mode(shapes)
        sizes = list(buckets) if isinstance(buckets, list | tuple) else [None]
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise _errors.invalid_option("buckets", buckets, "a list of positive integers")
        buckets = tuple(sorted(set(sizes)))
    return ShapeOptions(shapes, buckets, max_graphs, batch_dims, overflow, row_independent)


class GraphInfo(NamedTuple):
    """One graph of a wrapper, as :meth:`CudaGraphModule.graphs` lists it."""

    mode: str  # the mode it serves: grad mode, training mode, interaction type, autocast
    key: Any  # None ("static"), the input shapes ("exact"), the bucket's batch dims ("buckets")
    captured: bool  # False while it warms up
    replays: int  # the calls it answered by a replay
    padded: float  # the fraction of the rows it replayed that were padding


class Graphs:
    """The graphs of one mode of a wrapper, chosen by the shapes of each call.

    ``new_runner()`` makes the runner of a new graph; ``route(captured)`` gives the replay
    path of a captured call (its readers and writers come from the wrapper);
    ``settled(key)`` says whether the graph of ``key`` may take the replay path (not while
    ``verify=`` still checks its replays); ``fn`` is the function, for the calls that no
    graph answers.
    """

    def __init__(
        self,
        name: str,
        options: ShapeOptions,
        new_runner: Callable[[], GraphRunner],
        route: Callable[[Captured], ReplayFunction],
        settled: Callable[[Hashable], bool],
        fn: Callable[..., Any],
        lock: Any,
    ):
        self.name = name
        self._fn = fn
        self.options = options
        self.runners: dict[Hashable, GraphRunner] = {}
        self.replay: ReplayFunction = _not_captured
        # The key and captured call of the graph whose replay answered the last call through
        # `run`, else None (see verify=).
        self.replayed: tuple[Hashable, Captured] | None = None
        self.precapturing = False
        self._new_runner = new_runner
        self._route = route
        self._settled = settled
        self._lock = lock
        self._served: tuple[Hashable, Captured, int, int] | None = None  # see `learn`
        # The replay paths learned, by the shape of a call's first input: (path, [replays]).
        self._table: dict[Any, tuple[ReplayFunction, list[int]]] = {}
        # Replays counted on the slow path, and per path of the table: (key, rows, padded).
        self._counts: list[tuple[Hashable, int, int, list[int]]] = []
        self._slow: dict[tuple[Hashable, int, int], list[int]] = {}
        self._paths: dict[int, tuple[ReplayFunction, list[int]]] = {}
        self._views: dict[Hashable, tuple[Captured, Captured]] = {}
        self._warned = False
        self._lead: GraphRunner | None = None  # the largest bucket's, while it warms up
        if options.shapes != "static":
            self.replay = self._dispatch()

    @property
    def captured(self) -> Captured | None:
        """The one graph's captured call ("static"); None otherwise (for the TensorDict layer)."""
        runner = self.runners.get(None) if self.options.shapes == "static" else None
        return None if runner is None else runner.captured

    def captured_any(self) -> bool:
        return any(runner.captured is not None for runner in self.runners.values())

    # Picking the graph ---------------------------------------------------------------------

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Warm up, capture or replay the call's graph (the one place that picks it)."""
        self.replayed = self._served = None
        shapes = self.options.shapes
        if shapes == "buckets":
            return self._run_bucket(args, kwargs)
        key = None if shapes == "static" else _exact_key(args, kwargs)
        runner = self.runners.get(key)
        if runner is None:
            if self.runners and shapes == "exact":
                self._admit(args, kwargs)
                if len(self.runners) >= self.options.max_graphs:
                    return self._overflow(args, kwargs, None)
            runner = self.runners[key] = self._new_runner()
        return self._run(key, runner, args, kwargs, 1, 1)

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
            self._replayed(key, captured, rows, padded_rows)
        elif runner.captured is not None and rows == padded_rows:  # captured by this call
            self._served = (key, runner.captured, rows, padded_rows)
        return out

    def _replayed(self, key: Hashable, captured: Captured, rows: int, padded_rows: int) -> None:
        self.replayed = (key, captured)
        self._served = (key, captured, rows, padded_rows)
        count = self._slow.get((key, rows, padded_rows))
        if count is None:
            count = self._slow[(key, rows, padded_rows)] = [0]
            self._counts.append((key, rows, padded_rows, count))
        count[0] += 1

    def _admit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise if a call differs from the wrapper's graphs by more than its shapes."""
        for runner in self.runners.values():
            if runner.captured is not None:
                error = runner.captured.signature.diagnose(args, kwargs, shapes=False)
                if error is not None:
                    raise error
                return

    def _overflow(self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> Any:
        """A call past ``max_graphs`` or above the largest bucket: eager, or an error."""
        options = self.options
        if batch is not None:
            if options.overflow == "raise":
                raise _errors_shapes.above_buckets(self.name, batch, options.buckets)
        else:
            message = _errors_shapes.too_many_graphs(
                self.name, options.max_graphs, list(self.runners), options.overflow
            )
            if options.overflow == "raise":
                raise RuntimeError(message)
            if not self._warned:
                self._warned = True
                warnings.warn(message, _errors_shapes.GraphLimitWarning, stacklevel=5)
        with capture_turn(self._lock):  # the wrapper's function runs only under it
            return self._fn(*args, **kwargs)

    # Buckets -------------------------------------------------------------------------------

    def _run_bucket(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        options = self.options
        batch = _padding.batch_of(self.name, args, kwargs, options.batch_dims)
        size = _padding.bucket_for(batch, options.buckets)
        if size is None:
            return self._overflow(args, kwargs, batch)
        if torch.is_grad_enabled() and not options.row_independent:
            raise _errors_shapes.padding_refused(self.name, "calls in grad mode")
        runner = self.runners.get(size)
        if runner is not None and isinstance(runner.captured, GraphCall):
            view = self._rows(size, runner.captured, batch, args, kwargs)
            state = runner.captured.state
            if view is not None and (state is None or state.fresh()):
                out = call(view, args, kwargs)
                self._replayed(size, view, _numel(batch), _numel(size))
                return out
        if runner is None:
            group = self._group(size)
            if len(group) > 1:
                return self._capture_group(group, size, batch, args, kwargs)
            if len(self.runners) >= options.max_graphs:
                return self._overflow(args, kwargs, None)
            runner = self.runners[size] = self._new_runner()
        padded = _padding.resize(args, kwargs, size)
        out = self._run(size, runner, *padded, _numel(batch), _numel(size))
        self._refuse_training_step(size, runner)
        self._answer(size, runner, batch, args, kwargs)
        return _padding.rows(self.name, out, size, batch)

    def _answer(
        self,
        size: tuple[int, ...],
        runner: GraphRunner,
        batch: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Once a bucket's graph is captured, calls like this one take its replay path."""
        if self._served is None and isinstance(runner.captured, GraphCall):
            view = self._rows(size, runner.captured, batch, args, kwargs)
            if view is not None:
                self._served = (size, view, _numel(batch), _numel(size))

    def _group(self, size: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The buckets captured together with ``size``, largest first (so that the smaller
        graphs reuse its memory): every listed one not captured yet (or, for ``precapture``,
        every power of two up to ``size``); just ``size`` for more than one batch dim."""
        if len(size) != 1 or not (self.options.buckets or self.precapturing):
            return [size]
        sizes = self.options.buckets or [1 << k for k in range(size[0].bit_length())]
        return [(s,) for s in sorted(sizes, reverse=True) if (s,) not in self.runners]

    def _capture_group(
        self,
        group: list[tuple[int, ...]],
        size: tuple[int, ...],
        batch: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Warm up the largest graph of ``group`` on this call (padded); at its capture,
        capture every graph of the group, largest first, and answer with this call's."""
        lead = self._lead = self._lead or self._new_runner()
        if lead.counter < lead.warmup - 1:
            out = lead.run(*_padding.resize(args, kwargs, group[0]))
            return _padding.rows(self.name, out, group[0], batch)
        self._lead = None
        self.runners[group[0]] = lead
        answer = None
        for each in group:
            runner = self.runners.setdefault(each, self._new_runner())
            runner.skip_warmup()  # the largest's warm-ups did the lazy initialisations
            out = runner.run(*_padding.resize(args, kwargs, each))
            self._refuse_training_step(each, runner)
            if each == size:
                answer = _padding.rows(self.name, out, size, batch)
                self._answer(size, runner, batch, args, kwargs)
        return answer

    def _refuse_training_step(self, size: tuple[int, ...], runner: GraphRunner) -> None:
        captured = runner.captured
        if captured is not None and captured.training_step and not self.options.row_independent:
            del self.runners[size]
            raise _errors_shapes.padding_refused(self.name, "a training step")

    def _rows(
        self,
        size: tuple[int, ...],
        captured: GraphCall,
        batch: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Captured | None:
        """``captured`` (a bucket's graph) replayed on ``batch`` rows of its buffers, for calls
        like this one; None if the call differs from the capture in more than its batch dims
        (the padded call's full check then names the leaf)."""
        # By the call's structure too: a TensorDict and keyword tensors read other rows.
        where = (size, batch, _exact_key(args, kwargs))
        cached = self._views.get(where)
        if cached is not None and cached[0] is captured:
            return cached[1]
        signature = captured.signature
        if signature.diagnose(args, kwargs, shapes=False) is not None:
            return None
        dims = len(size)
        index = tuple(slice(0, n) for n in batch)
        heads = [t[index] for t in signature.static_inputs]
        tensors = signature.tensors(args, kwargs)
        for t, static in zip(tensors, signature.static_inputs, strict=True):
            if t.shape[dims:] != static.shape[dims:]:
                return None
        device = signature.static_inputs[0].device if heads else torch.device("cpu")
        rows_signature = Signature(self.name, args, kwargs, device, static_inputs=heads)
        outputs = captured.outputs
        result = _padding.rows(self.name, outputs.rebuild(outputs.static), size, batch)
        view = captured.rows(rows_signature, Outputs(self.name, result, outputs.device))
        self._views[where] = (captured, view)
        return view

    # The replay path -----------------------------------------------------------------------

    def learn(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Give the replay path the graph that answered this call by a replay, if any: the
        mode's path ("static"), or the path of calls whose first input has this one's shape."""
        served = self._served
        if served is None:
            return
        key, captured, rows, padded_rows = served
        if not self._settled(key):
            return
        path, count = self._path(captured, key, rows, padded_rows)
        if self.options.shapes == "static":
            self.replay = path
            return
        shape = _first_shape(args, kwargs)
        if shape is not None:
            self._table[shape] = (path, count)

    def _path(
        self, captured: Captured, key: Hashable, rows: int, padded_rows: int
    ) -> tuple[ReplayFunction, list[int]]:
        known = self._paths.get(id(captured))
        if known is None or known[2] is not captured:
            count = [0]
            self._counts.append((key, rows, padded_rows, count))
            known = self._paths[id(captured)] = (self._route(captured), count, captured)
        return known[0], known[1]

    def _dispatch(self) -> ReplayFunction:
        table = self._table

        def replay(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            try:  # the shape of the first input (a TensorDict's is its batch size)
                first = args[0] if args else next(iter(kwargs.values()))
                path, count = table[first.shape]
            except Exception:  # no input, no shape, or no path learned for it
                return MISS
            out = path(args, kwargs)
            if out is not MISS:
                count[0] += 1
            return out

        return replay

    # Introspection -------------------------------------------------------------------------

    def infos(self, mode: str, fast_replays: int) -> list[GraphInfo]:
        """The graphs of this mode; ``fast_replays``: the static graph's replay-path calls."""
        replays: dict[Hashable, int] = {}
        rows: dict[Hashable, list[int]] = {}
        for key, real, padded, count in self._counts:
            replays[key] = replays.get(key, 0) + count[0]
            total = rows.setdefault(key, [0, 0])
            total[0] += count[0] * real
            total[1] += count[0] * padded
        if self.options.shapes == "static" and None in self.runners:
            replays[None] = replays.get(None, 0) + fast_replays
        infos = []
        for key, runner in self.runners.items():
            real, padded = rows.get(key, (0, 0))
            fraction = 1 - real / padded if padded else 0.0
            infos.append(
                GraphInfo(mode, key, runner.captured is not None, replays.get(key, 0), fraction)
            )
        return infos


def _numel(batch: tuple[int, ...]) -> int:
    n = 1
    for d in batch:
        n *= d
    return n


def _first_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    first = args[0] if args else next(iter(kwargs.values()), None)
    return getattr(first, "shape", None)


def _exact_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The graph of a call with ``shapes="exact"``: its structure (TensorDict batch sizes
    included) and the shapes of its tensors. Other differences (dtypes, constants) are the
    errors of the graph's full check."""
    leaves, spec = _tree.flatten((args, kwargs))
    shapes = tuple(tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor))
    try:
        hash(spec)
    except TypeError:  # a node's metadata that is not hashable
        return (str(spec), shapes)
    return (spec, shapes)


def _not_captured(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The replay path before any graph is captured: every call takes the slow path."""
    return MISS
