"""A graph entry: one graph's whole life, from its first call to its last replay.

An entry is made the first time a wrapper sees its key. It holds the graph's warm-up count,
its backend, the captured call (a plain graph, `_capture.graph.GraphCall`, or a forward and
backward pair in one autograd node, `_capture.autograd.DifferentiableCall`, with the static
input buffers, the outputs and their loans), the routes by which it reads a call's input
tensors and writes its result (`_values.routes`), and its counters. ``run`` is the slow
path: a warm-up, the capture (which fills the entry), a replay checked in full, or, when
state the graph reads was replaced, a new capture that replaces what the entry holds and
restarts its counters. ``replay`` is the replay path, top to bottom:

1. the route of the call's kind (positional, keywords, ``tensordict_out=``) reads the input
   tensors, or misses;
2. one metadata check: (type, shape, dtype, device, ``requires_grad``) of each tensor, and
   the state the graph reads (parameters, buffers: see `_state.state`);
3. the launch: copy into the static inputs, replay, outputs in fresh memory (through the
   autograd node in grad mode);
4. the route's writer gives the result its form.

A call that a reader cannot read, or that the check refuses, is a *miss*: ``replay`` returns
``MISS``, and the wrapper takes its slow path, whose checked replay checks the call in full
and raises the error that names the leaf. Only the slow path explains. An entry that holds
no captured graph (warming up, or emptied for a new capture) misses every call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from .._compat import capturable_on_cpu
from .._errors import inputs as _errors
from .._errors import log as _log
from .._values.borrowed import lease_of
from .._values.outputs import Outputs
from .._values.routes import MISS, TENSORDICT_OUT, Args, Keywords, Kwargs, OneKeyTensorDict, Route
from .._values.signature import Signature, metadata, validate
from .._values.tree import Call
from . import captured as _captured
from .autograd import DifferentiableCall
from .backend import Backend
from .captured import Captured, launch_one
from .graph import capture, capture_turn

__all__ = ["MISS", "GraphEntry", "GraphKey"]

Read = Callable[[Args, Kwargs], Sequence[Any] | None]
Write = Callable[[Args, Kwargs, Sequence[torch.Tensor]], Any]
Routes = Callable[[Signature, Outputs], list[Route]]


class GraphKey(NamedTuple):
    """Where a call goes: the one key of a wrapper's graphs, and of its table.

    A graph's key: the mode of its calls (grad mode, training mode, interaction type,
    autocast: see `_call.modes`), its device (None off CUDA), the values of the static
    arguments (see `_call.static`), and its ``shapes``: None for ``shapes="static"``, the
    call's structure and tensor shapes for ``"exact"`` (`exact_key`), the bucket's batch
    dims for ``"buckets"`` (see `_shapes`). The graphs of one mode, device and static
    values are one `Graphs`, under their key with ``shapes`` None (see `_shapes.graphs`).

    The wrapper's table (`_call.table`) keys calls the same way before reading their
    tensors: the device left to each entry's check (None), and ``shapes`` as the call's
    arguments show them (their shapes, a TensorDict's batch size).
    """

    mode: Any  # `_call.modes.Mode`
    device: torch.device | None
    values: tuple[Any, ...]
    shapes: Hashable


def _miss(args: Args, kwargs: Kwargs) -> None:
    """The reader of a call kind that no route reads (or of every call, with no graph)."""
    return None


_NO_ROUTE: tuple[Read, Write | None] = (_miss, None)


class GraphEntry:
    """One graph: its key, its warm-ups, its backend, its captured call, its routes, its counters.

    ``key`` is the graph's key (`GraphKey`; None for a callable of `make_graphed_callables`);
    ``name`` names the wrapper in errors, ``label`` the graph in log records. ``fn`` is the
    function it captures, run ``warmup - 1`` times eagerly first; ``make_backend(leaves)``
    makes its backend at the first call (None: no graph, every call runs ``fn``);
    ``routes(signature, outputs)`` gives its routes once captured; ``lock`` is the
    wrappers' replay lock, which the calling thread holds. The entry holds
    no reference to the wrapper that owns it, so that dropping the wrapper frees the graph
    at once, without waiting for the garbage collector.

    A bucket's graph (see `_shapes.buckets`) replays calls of fewer rows through views of its
    buffers: each such view is an entry too, one of the bucket entry's ``rows``, filled by
    ``fill_rows``, and emptied with it.
    """

    def __init__(
        self,
        key: GraphKey | None,
        name: str,
        label: str,
        fn: Callable[..., Any],
        warmup: int,
        make_backend: Callable[[list[Any]], Backend] | None,
        routes: Routes,
        lock: Any = None,
    ):
        self.key = key
        self.name = name  # the wrapper's class, as errors name it
        self.label = label
        self.fn = fn
        self.warmup = warmup
        self.make_backend = make_backend
        self.routes = routes
        self.lock = lock
        self.backend: Backend | None = None
        self.counter = 0  # the calls before the first replay: warm-ups, then the capture
        self.captured: Captured | None = None
        self.replays = 0  # the calls the captured graph answered, on either path
        # Calls padded to this bucket's size that it answered, counted apart (see
        # `_shapes.buckets`), and their rows before the padding.
        self.padded_calls = self.padded_call_rows = 0
        self.rows: dict[Hashable, GraphEntry] = {}  # a bucket's rows, by the calls' key
        self.batch = (1, 1)  # the rows of its calls, and of its graph (a bucket's rows)
        self._expected: list[Any] = []
        self._empty_routes()

    # The slow path -------------------------------------------------------------------------

    def run(self, call: Call, rows: int = 0) -> tuple[Any, bool]:
        """Answer a call as the graph's stage requires: a warm-up, the capture, a replay
        checked in full, or a new capture when state the graph reads was replaced (a
        recapture); and whether it was a replay. ``rows``: a call padded to this bucket's
        graph, of that many rows before its padding (counted apart)."""
        captured = self.captured
        if captured is not None:
            if self.holds():
                return self.replay_in_full(call, rows), True
            # State the graph reads was replaced: a new capture, from the warm-up (a
            # RecaptureWarning turned into an error refuses it, and the graph stays as it was).
            assert captured.state is not None
            _log.recapturing(self.label, captured.state.recapture(self.name))
            self.empty()
        if self.make_backend is None:  # no CUDA: eager calls, capturable optimizers allowed
            with capturable_on_cpu():  # so that a training step's code runs as on a GPU
                return self.fn(*call.args, **call.kwargs), False
        with capture_turn(self.lock):  # the function runs only under it
            if self.captured is not None:  # captured by another thread while this one waited
                return self.run(call, rows)
            backend = self.backend = self.backend or self.make_backend(call.leaves)
            if self.counter >= self.warmup - 1:
                return self._capture(backend, call), False
            validate(self.name, call, backend.device, allow_grad=torch.is_grad_enabled())
            stage = f"run warm-up call {self.counter + 1} of {self.warmup - 1}"
            try:
                result = backend.warmup(lambda: self.fn(*call.args, **call.kwargs))
            except Exception as err:
                raise _errors.capture_failure(self.name, stage, err, device=backend.device) from err
            self.counter += 1
            _log.warmed_up(self.label, self.counter, self.warmup - 1)
            return result, False

    def replay_in_full(self, call: Call, rows: int = 0) -> Any:
        """Replay the captured graph for a call checked in full (the slow path's replay), the
        state it reads known to hold; counted, apart where padded (``rows``, see `run`)."""
        assert self.captured is not None
        out = _captured.replay_checked(self.captured, call)
        if rows:
            self.padded_calls += 1
            self.padded_call_rows += rows
        else:
            self.replays += 1
        return out

    def _capture(self, backend: Backend, call: Call) -> Any:
        logged = _log.logger.isEnabledFor(logging.INFO)
        device = backend.device
        on_cuda = logged and device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if on_cuda else 0
        start = time.perf_counter()
        captured, result = capture(self.name, self.fn, call, backend)
        elapsed = time.perf_counter() - start
        self.counter += 1
        if isinstance(captured, DifferentiableCall):
            captured.label = self.label  # for its hint (see `_errors.log.no_backward`)
        lease = lease_of(captured.outputs.copies)
        if lease is not None:  # outputs="borrowed": errors name the graph as log records do
            lease.label = self.label
        self.fill(captured)
        if logged:
            grown = torch.cuda.memory_reserved(device) - reserved if on_cuda else None
            static = [*captured.signature.static_inputs, *captured.outputs.static]
            autograd = isinstance(captured, DifferentiableCall)
            _log.captured(self.label, autograd, elapsed, _log.static_bytes(static), grown)
        return result

    def skip_warmup(self) -> None:
        """Capture at the next call: another graph's warm-ups did the lazy initialisations."""
        self.counter = max(self.counter, self.warmup - 1)

    def holds(self) -> bool:
        """Whether the state its graph reads holds (see `_state.state`): else a recapture."""
        state = None if self.captured is None else self.captured.state
        return state is None or state.fresh()

    # What the entry holds ------------------------------------------------------------------

    def fill(self, captured: Captured) -> None:
        """Hold ``captured``, and the routes, checks and launch that replay it."""
        self.captured = captured
        by_keywords = by_position = _NO_ROUTE
        by_out = None
        self._names: list[str] | None = None
        self._fused: Callable[[Args], Any] | None = None
        one = captured.one_tensor_launch
        expected = self._expected = captured.signature.expected
        # The state it reads (see `_state.state`): a replaced parameter is a miss, and a recapture.
        holds = self._state_holds = captured.state.fresh if captured.state is not None else None
        for reader, writer in self.routes(captured.signature, captured.outputs):
            if one is not None and OneKeyTensorDict.fits(reader, writer):
                self._fused = OneKeyTensorDict(
                    reader,  # type: ignore[arg-type]
                    writer,  # type: ignore[arg-type]
                    expected[0],
                    holds,
                    one,
                    launch_one,
                ).replay
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
        # The routes of calls with keywords, by whether they pass `tensordict_out`.
        self._by_position = by_position
        self._by_keywords = (by_keywords, by_keywords if by_out is None else by_out)
        # One tensor in: its metadata compared without a list of one element.
        self._one = expected[0] if len(expected) == 1 else None
        # A plain graph with one tensor in and one out: launched in one call.
        self._one_launch = one

    def fill_rows(self, key: Hashable, rows: Captured, batch: tuple[int, int]) -> GraphEntry:
        """The entry of this bucket's graph replayed on fewer rows (``rows``, views of its
        buffers; ``batch``: the calls' rows and the graph's), for calls of ``key``: made on
        first sight, filled again after a new capture of this graph."""
        entry = self.rows.get(key)
        if entry is None:  # the same graph, under this entry's key and label
            entry = GraphEntry(
                self.key, self.name, self.label, self.fn, self.warmup, None, self.routes, self.lock
            )
            self.rows[key] = entry
        entry.backend, entry.batch = self.backend, batch
        entry.fill(rows)
        return entry

    def empty(self) -> None:
        """Let go of the captured graph (a new capture follows): what its last replay lent
        (``outputs="borrowed"``) made unreadable now, its counters restarted, every call a
        miss until it is captured again; a bucket's rows emptied with it."""
        self.release()
        self.captured = self.backend = None
        self.counter = self.replays = self.padded_calls = self.padded_call_rows = 0
        for rows in self.rows.values():
            rows.empty()
        self._empty_routes()

    def release(self) -> None:
        """Its graph goes (a reset, a new capture, the wrapper deleted): what its last replay
        lent made unreadable now, whatever still holds the graph (see
        `_capture.captured.Captured.end_loans`)."""
        if self.captured is not None:
            self.captured.end_loans()

    def _empty_routes(self) -> None:
        self._by_position = _NO_ROUTE
        self._by_keywords = (_NO_ROUTE, _NO_ROUTE)
        self._fused = None
        self._names = None
        self._one = self._one_launch = self._state_holds = None
        self._expected = []

    # The replay path -----------------------------------------------------------------------

    def replay(self, args: Args, kwargs: Kwargs) -> Any:
        """Replay the graph for this call; ``MISS`` if the call is not one it reads."""
        if kwargs:
            read, write = self._by_keywords[TENSORDICT_OUT in kwargs]  # read in place: no call
        elif self._fused is not None:  # `module(td)`, one in_key and one out_key
            out = self._fused(args)
            if out is not MISS:
                self.replays += 1
            return out
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
        one_launch = self._one_launch
        if one_launch is not None:
            fresh: Sequence[torch.Tensor] = (launch_one(one_launch, tensors[0]),)
        else:
            fresh = self.captured.launch(tensors)  # type: ignore[union-attr]
        self.replays += 1
        return fresh[0] if write is None else write(args, kwargs, fresh)

    def reads(self, args: Args, kwargs: Kwargs) -> bool:
        """Whether a replay would read this call (its kind, structure and tensors' metadata)."""
        route = self._by_keywords[TENSORDICT_OUT in kwargs] if kwargs else self._by_position
        tensors = route[0](args, kwargs)
        try:
            return tensors is not None and list(map(metadata, tensors)) == self._expected
        except Exception:  # a leaf that is not a tensor
            return False

    def input_buffers(self, keywords: bool) -> tuple[Args, Kwargs]:
        """The graph's static inputs, as ``(args, kwargs)`` of a call that replays it with no
        input copied: keyword tensors by name for ``keywords`` where a route reads them so,
        else the captured call's structure. From now on, a launch copies no input that is
        its static input."""
        assert self.captured is not None
        self.captured.inputs_lent = True
        signature = self.captured.signature
        if keywords and self._names is not None:
            return (), dict(zip(self._names, signature.static_inputs, strict=True))
        return signature.static_tree()

    def counts(self) -> tuple[int, int, int]:
        """Its replays since its capture, with its rows' and its padded calls: how many, how
        many rows they had, and how many their graph replayed (for ``graphs()``)."""
        size = self.batch[1]
        replays = self.replays + self.padded_calls
        rows = self.replays * self.batch[0] + self.padded_call_rows
        for entry in self.rows.values():
            replays += entry.replays
            rows += entry.replays * entry.batch[0]
        return replays, rows, replays * size
