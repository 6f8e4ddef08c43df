"""``CudaGraphModule``: warm up, capture and replay a function, a module or a TensorDictModule."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import tensordict.nn
import torch

from .._capture import default_backend as _default_backend
from .._capture import devices as _devices
from .._capture import distributed as _distributed
from .._capture import sharing as _sharing
from .._capture.backend import SharedPool, backend_factory, can_borrow, check_options
from .._capture.entry import MISS, GraphEntry, GraphKey
from .._capture.graph import capture_turn
from .._compat import raw_stream
from .._errors import borrowed as _errors_borrowed
from .._errors import inputs as _errors
from .._errors import log as _log
from .._errors import shapes as _errors_shapes
from .._shapes import graphs as _shapes
from .._shapes import options as _shape_options
from .._shapes.buckets import BucketGraphs
from .._shapes.graphs import GraphList, Overflow
from .._shapes.options import Buckets, Exact, Static
from .._values import tree as _tree
from .._values.input_views import recording_writes
from .._values.outputs import Outputs
from .._values.routes import Route, Routing, routes
from .._values.signature import Signature
from .._values.tree import Call
from . import copying as _copying
from . import modes as _modes
from . import static as _static
from . import tdmodule as _tdmodule
from . import verify as _verify
from .modes import Mode
from .table import GraphTable

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._shapes.options import DeprecatedOptions

Graphs = _shapes.Graphs


class CudaGraphModule(tensordict.nn.CudaGraphModule):
    """Capture a function as a CUDA graph, then replay it at each call.

    A drop-in replacement for ``tensordict.nn.CudaGraphModule``, and a subclass of it
    (code that checks for it, such as torchrl's collectors, takes this one). Calls ``1`` to
    ``warmup - 1`` run the function eagerly on a side stream; call ``warmup`` captures the
    graph and returns a real result; every later call copies its tensor inputs into the
    graph's static buffers, replays the graph on the caller's current stream, and returns
    the outputs in fresh memory, so that a result never changes when called again. An
    output that is one of the caller's input tensors, or a view of one, is returned as
    eager mode returns it on every call: the caller's tensor, or the same view of it (see
    the sharp edges page, "Static addresses").

    Inputs and outputs may be any pytree of tensors, TensorDicts, tensorclasses and
    non-tensor constants, passed positionally or by keyword. Every replay checks its inputs
    against the captured ones (structure, shapes, dtypes, devices, constants) and raises an
    error that names the offending leaf, before anything is copied. In-place updates of
    input tensors by the function reach the caller, as in eager mode, and a replay refuses
    inputs that share memory with one it updates (the graph would not see the update there).

    A module with ``in_keys`` (a TensorDictModule), or a function given ``in_keys``, is
    called as a TensorDictModule is: with a TensorDict, whose ``in_keys`` entries feed the
    graph and which receives the written entries and is returned, or with keyword tensors
    named by the ``in_keys``, returning the ``out_keys``' values; ``tensordict_out=`` is
    accepted.

    The wrapper keeps graphs per mode that changes what the function computes (grad mode,
    a module's training mode, tensordict's interaction type, the autocast state), per device
    (see ``device``), per value of the arguments declared ``static`` and, with
    ``shapes=Exact()`` or ``shapes=Buckets()``, per input shape (see "Several shapes" in the
    docs' Sharp edges page). In grad mode, when the captured outputs require grad, the
    forward and its backward are captured inside one autograd node (see
    ``make_graphed_callables``), so ``loss.backward()`` replays the backward graph; under
    ``torch.no_grad()`` a plain graph. Without CUDA (and with ``backend="auto"``, unless
    ``set_default_backend`` or ``CUDAGRAPH_TD_BACKEND`` picks a backend), the constructor
    warns once and every call runs the function directly. See the docs' Sharp edges page
    for what a graph cannot capture.

    Args:
        module: The function, ``torch.nn.Module`` or TensorDictModule to capture.
        warmup: The call that captures the graph; the calls before it are eager warm-ups.
            A ``torch.compile``d function needs enough warm-up calls to finish compiling:
            ``warmup=3`` (see the docs' Training steps page).
        in_keys: The input keys, for a module that takes a TensorDict. Taken from
            ``module.in_keys`` when the module has them.
        out_keys: The output keys, for a module that returns a TensorDict. Taken from
            ``module.out_keys`` when the module has them.
        device: The CUDA device of the graphs. By default, the device of each call's first
            CUDA tensor input (else the current one) has graphs of its own, unless the
            function reaches parameters or optimizer state on another (see the docs'
            Several GPUs page).
        pool: A memory pool (``torch.cuda.graph_pool_handle()``, another wrapper's
            ``pool()``, or another graph's) to share with other graphs. Defaults to a pool
            of the wrapper's own, shared by its graphs (a graph captured for autograd takes
            one of its own).
        capture_error_mode: Passed to ``torch.cuda.CUDAGraph.capture_begin``: one of
            ``"global"``, ``"thread_local"`` (taken for ``"global"`` by a step that calls a
            DDP module: see the docs' Several GPUs page), ``"relaxed"``.
        backend: ``"cuda"`` for CUDA graphs; ``"emulate"`` for the CPU emulation of their
            contract (static buffers, outputs overwritten at each replay), which lets the
            code that uses the wrapper be tested on a machine without a GPU (experimental);
            ``"eager"`` for plain calls of the function (no graph, no input checks);
            ``"auto"`` for what ``set_default_backend`` or the ``CUDAGRAPH_TD_BACKEND``
            environment variable set, else ``"cuda"`` when CUDA is available, else eager
            calls (with a warning).
        verify: How many replays, after the capture, also run the function eagerly on
            copies of their inputs and compare the results and the inputs updated in place,
            raising a ``VerificationError`` that names the first leaf that differs and its
            likely cause (see the docs' Sharp edges page).
            A debugging aid: a verified replay synchronises the host and costs an eager
            call more. It cannot check a training step, nor a function that draws random
            numbers. Counted per graph. Defaults to 0.
        shapes: How a wrapper answers calls of other input shapes, as one value:
            ``Static()`` (the default): one graph per mode, and a call of other shapes
            raises; ``Exact()``: a graph per input structure and shapes (an optional
            argument passed or None), captured on first sight, each with its own warm-up;
            ``Buckets([8, 16, 64])``: the batch dims of the inputs
            are padded to the next bucket size, whose graph replays, and outputs are sliced
            back (for functions whose output rows depend on their own input row only).
            Their fields hold the limits (``max_graphs``, ``overflow``) and the buckets'
            options (``batch_dims``, ``row_independent``). The strings ``"static"``,
            ``"exact"`` and ``"buckets"`` stand for the values with default fields.
        static: Arguments whose value picks a graph: positions (``int``) and names
            (``str``) of non-tensor arguments, such as a bool that selects a branch
            (``static=("update_actor",)``). Each value's graph warms up and is captured on
            first sight; past ``max_graphs`` values (per mode, a field of ``shapes``), its
            ``overflow``. Other non-tensor arguments must keep their captured value.
        outputs: ``"fresh"`` (the default): every output tensor in fresh memory, a copy of
            the graph's. ``"borrowed"``: the output tensors are the graph's own output memory,
            lent to the caller until the next replay of the same graph, with no copy; any use
            of them after it, or of a view of them, raises a ``RuntimeError`` that names the
            wrapper and says to ``.clone()`` what is kept across calls (the entries a
            TensorDict module writes into the caller's TensorDict are lent the same way;
            outputs that are the caller's inputs stay the caller's). With
            ``input_buffers()``, a call moves no memory but the graph's launch. See the docs'
            Borrowed outputs page.
        **deprecated: ``buckets=``, ``max_graphs=``, ``batch_dims=``, ``overflow=`` and
            ``row_independent=``, the shape options before ``shapes=`` took one value:
            still accepted, folded into ``shapes`` with a ``FutureWarning`` that gives the
            new spelling (``shapes="buckets", buckets=[8, 16]`` is
            ``shapes=Buckets([8, 16])``). To be removed in the next release.

    Raises:
        ValueError: An option has no valid value (``CUDAGRAPH_TD_BACKEND`` too, for
            ``backend="auto"``).
        TypeError: A keyword that the constructor does not take, or a deprecated shape
            keyword beside a ``shapes=`` value.
        RuntimeError: ``backend="cuda"`` on a machine without CUDA, given or picked by
            the switch (see ``set_default_backend``).

    Examples:
        >>> import torch
        >>> from cudagraph_td import CudaGraphModule
        >>> def step(x, *, scale):
        ...     return {"y": x * scale, "norm": x.norm()}
        >>> graphed = CudaGraphModule(step, warmup=2, backend="emulate")
        >>> for _ in range(4):
        ...     x = torch.randn(8)
        ...     out = graphed(x, scale=2.0)
        >>> torch.testing.assert_close(out["y"], x * 2.0)
        >>> graphed(x, scale=3.0)
        Traceback (most recent call last):
        ...
        cudagraph_td.InputMismatchError: CudaGraphModule was captured with the non-tensor argument kwargs["scale"] = 2.0, but received 3.0. ...
        >>> try:
        ...     graphed(x, scale=3.0)
        ... except ValueError as err:  # an InputMismatchError is a ValueError
        ...     print(err.path, err.captured, err.received)
        kwargs["scale"] 2.0 3.0

        On a GPU, the same code with ``backend="auto"`` and CUDA tensors replays a CUDA graph:

        >>> graphed = CudaGraphModule(step)  # doctest: +SKIP
        >>> out = graphed(torch.randn(8, device="cuda"), scale=2.0)  # doctest: +SKIP
    """

    def __init__(
        self,
        module: Callable[..., Any],
        warmup: int = 2,
        in_keys: Any = None,
        out_keys: Any = None,
        device: torch.device | str | int | None = None,
        *,
        pool: Any = None,
        capture_error_mode: str = "global",
        backend: Literal["auto", "cuda", "emulate", "eager"] = "auto",
        verify: int = 0,
        shapes: Static | Exact | Buckets | Literal["static", "exact", "buckets"] = "static",
        static: tuple[int | str, ...] | int | str = (),
        outputs: Literal["fresh", "borrowed"] = "fresh",
        **deprecated: Unpack[DeprecatedOptions],
    ):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise _errors.invalid_option("warmup", warmup, "an integer greater than 0")
        if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
            raise _errors.invalid_option("verify", verify, "an integer of 0 or more")
        check_options(backend, capture_error_mode, outputs)
        name = self._name = type(self).__name__
        self._shapes = _shape_options.resolve(name, shapes, deprecated)
        # "auto" resolved by the process's switch, else by whether CUDA is available.
        chosen = _default_backend.resolve(name, backend)
        # A DDP step's ranks agree on each call's graph (see `_capture.distributed`).
        mode, self._agreement = _distributed.checked(name, module, warmup, capture_error_mode)
        # The options as given, which a copy is made with (see `_call.copying`); the module's
        # own keys are left for the copy's module to give.
        self._options: dict[str, Any] = {
            "warmup": warmup,
            "in_keys": None if hasattr(module, "in_keys") else in_keys,
            "out_keys": None if hasattr(module, "out_keys") else out_keys,
            "device": device,
            "pool": pool,
            "capture_error_mode": capture_error_mode,
            "backend": backend,
            "verify": verify,
            "shapes": self._shapes,
            "static": static,
            "outputs": outputs,
        }
        self.module = module
        self._warmup = warmup
        self.in_keys, self.out_keys = _tdmodule.resolve_keys(name, module, in_keys, out_keys)
        self.device = None if device is None else torch.device(device)
        self._backend_name: str = chosen.backend
        # What made it eager, for `__repr__`: no CUDA, the switch, or None for backend="eager".
        self._eager_by = chosen.switch or ("no CUDA" if backend == "auto" else None)
        # One pool for the wrapper's graphs, unless the user gives one.
        self._pool = SharedPool() if pool is None and self._backend_name == "cuda" else pool
        if self._backend_name == "eager" and self._eager_by == "no CUDA":
            warnings.warn(
                "CudaGraphModule is created on a machine without CUDA: calls run the function "
                "eagerly, with no graph and no input checks (optimizers built with "
                "capturable=True step on the CPU in them). To test the graphed code on the "
                'CPU (static buffers, replays, capture errors), pass backend="emulate", or '
                "set CUDAGRAPH_TD_BACKEND=emulate for the whole program.",
                UserWarning,
                stacklevel=2,
            )
        # One call at a time: threads take turns, so that none reads another's static buffers,
        # nor replays between another's replay order check and its launch (see `_capture.sharing`).
        self._lock = _sharing.REPLAY_LOCK
        self._fn = module
        self._verifier = _verify.Verifier(name, module, verify) if verify else None
        self._layer: _tdmodule.TensorDictLayer | None = None
        # How the entries of its graphs read calls and write results (see `_values.routes`).
        self._routes: Callable[[Signature, Outputs], list[Route]] = routes
        if self.in_keys is not None:
            self._fn = recording_writes(module)
            self._layer = _tdmodule.TensorDictLayer(
                name,
                self.in_keys,
                self.out_keys,
                module_reads_in_keys=getattr(module, "in_keys", None) is not None,
            )
            self._routes = Routing(self._layer.in_keys, self._layer.out_keys).routes
        self._static = _static.StaticArgs(name, module, static) if static != () else None
        make_backend = None
        if self._backend_name != "eager":
            borrow = outputs == "borrowed" and can_borrow(name, self._backend_name)
            make_backend = backend_factory(
                self._backend_name, self.device, self._pool, mode, self._agreement, borrow
            )
        # What makes the entry of each new graph (nothing in it refers to the wrapper).
        self._new_entry = functools.partial(
            GraphEntry,
            name=name,
            fn=self._fn,
            warmup=warmup,
            make_backend=make_backend,
            routes=self._routes,
            lock=self._lock,
        )
        # The graphs by mode, device (None off CUDA; see `_capture.devices`) and static
        # values: under their key with `shapes` None (see `_capture.entry.GraphKey`).
        self._graphs: dict[GraphKey, Graphs] = {}
        # The entries of its graphs by the key of the calls they answered: what `__call__` runs.
        self._table = GraphTable(module, not isinstance(self._shapes, Static), self._static)
        self._last_key: GraphKey | None = None  # the graphs of the last slow call
        # Per mode and device, the calls past max_graphs static values (see `_select`).
        self._overflows: dict[tuple[Mode, torch.device | None], Overflow] = {}
        self._order: _sharing.ReplayOrder | None = None  # its replay order (see `_capture.sharing`)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The replay path: the table's entries for the call's key (see `_call.table`), each of
        # which answers MISS for a call it leaves to the slow path, `_call`.
        self._lock.acquire()
        try:
            order = self._order
            if order is not None and order.raw != raw_stream(order.device):  # type: ignore[misc]
                order.follow()  # a call on another stream than the device's last replay
            for entry in self._table.find(args, kwargs):
                out = entry.replay(args, kwargs)
                if out is not MISS:
                    return out
            return self._call(args, kwargs)
        finally:
            self._lock.release()

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The slow path: a warm-up, a capture, a replay checked in full, or a verified one.
        The entry of the graph that answered goes into the table, for calls like this one."""
        mode = _modes.current_mode(self.module)
        call_key = self._table.key(args, kwargs, mode)
        # The call flattened once, for every step that reads it (the TensorDict layer's graphs
        # read the TensorDict it makes of it: they flatten that).
        call = _tree.flatten_call(args, kwargs)
        key, graphs = self._select(call, mode)
        if graphs is None:  # a value of the static arguments past max_graphs
            return self._static_overflow(key, call)
        self._last_key = key
        device = key.device
        if device is not None:  # this device's replays follow the last one there
            self._order = _sharing.ordered(device.index)
        verifier = self._verifier
        # While verify= is on, the slow path serves the replays still to check.
        copies = None if verifier is None else verifier.copy_inputs(call)
        if self._layer is not None:
            answer = self._layer.call(graphs, args, kwargs)
        else:
            answer = graphs.run(call)
        entry = answer.entry
        if entry is None:
            return answer.result
        if verifier is not None and answer.replayed and verifier.wants(entry.key):
            with capture_turn(self._lock):  # the function runs only under it
                verifier.check(copies, call, answer.result, entry)
        # Not while verify= checks its replays, nor for a DDP step, whose calls agree on their
        # graph first (see `_capture.distributed`).
        settled = verifier is None or not verifier.wants(entry.key)
        if answer.for_table and settled and self._agreement is None:
            self._table.add(call_key, entry)
        return answer.result

    def _select(self, call: Call, mode: Mode | None = None) -> tuple[GraphKey, Graphs | None]:
        """The graphs of the call's mode, device and static values (`_shapes.graphs.Graphs.run` then
        picks the graph by the call's shapes); None past ``max_graphs`` static values."""
        mode = _modes.current_mode(self.module) if mode is None else mode
        device = None
        if self._backend_name == "cuda":
            device = _devices.call_device(call.leaves, self.device)
        values = () if self._static is None else self._static.key(call.args, call.kwargs)
        key = GraphKey(mode, device, values, None)
        graphs = self._graphs.get(key)
        if graphs is None:
            others = [k.device for k in self._graphs if k.device not in (None, device)]
            if others and device is not None:  # graphs on another device: may it follow?
                _devices.check_follows(self._name, self.module, device, others[0], call)
            if values and self._static_values(mode, device) >= self._shapes.max_graphs:
                return key, None
            kind = BucketGraphs if isinstance(self._shapes, Buckets) else Graphs
            graphs = self._graphs[key] = kind(
                self._name,
                self._shapes,
                self._agreement,
                key,
                self._new_entry,
                self._fn,
                self._lock,
                _log.graph_label(self._name, self.module, self._shown(key)),
            )
        return key, graphs

    def _static_values(self, mode: Mode, device: torch.device | None) -> int:
        """How many values of the static arguments have graphs in this mode and device."""
        return sum(k.mode == mode and k.device == device for k in self._graphs)

    def _static_overflow(self, key: GraphKey, call: Call) -> Any:
        """A call with one value of the static arguments more than ``max_graphs``: eager, after
        a warning (once), or an error."""
        assert self._static is not None
        where = (key.mode, key.device)
        overflow = self._overflows.get(where)
        if overflow is None:
            label = _log.graph_label(self._name, self.module, self._shown(key))
            overflow = self._overflows[where] = Overflow(self._shapes, label)
        seen = [self._static.shown(k.values) for k in self._graphs if (k.mode, k.device) == where]
        message = _errors_shapes.too_many_graphs(
            self._name, self._shapes.max_graphs, seen, self._shapes.overflow, "Static values"
        )
        reason = _errors_shapes.PAST_MAX_STATIC_VALUES
        return overflow.call(self._fn, call, self._lock, reason, message, 5)

    def _current_graphs(self) -> Graphs | None:  # the current mode's, on the last call's device
        where = self._last_key
        if where is None:
            return None
        return self._graphs.get(where._replace(mode=_modes.current_mode(self.module)))

    def _shown(self, key: GraphKey) -> str:
        """A mode as ``graphs()`` and ``repr`` show it, with its device if there are several."""
        several = len({k.device for k in self._graphs}) > 1
        shown = _modes.mode_name(key.mode, key.device if several else None)
        return shown if self._static is None else f"{shown}, {self._static.shown(key.values)}"

    @property  # tensordict's class keeps an attribute: here, the graphs' count, read-only
    def counter(self) -> int:  # type: ignore[override]
        """How many calls ran before the first replay (warm-up calls, then the capture), for
        the current mode's graph that went furthest."""
        graphs = self._current_graphs()
        return 0 if graphs is None else graphs.counter()

    def reset(self) -> None:
        """Drop the captured graphs and their buffers, and the counts of calls that ran
        eagerly; the next call starts the warm-up again."""
        self._release()
        self._graphs.clear()
        self._overflows.clear()
        self._table.clear()

    def _release(self) -> None:
        """Its graphs go: with ``outputs="borrowed"``, the outputs their last replays lent
        are made unreadable now, not when the graphs are collected (a reference to one
        elsewhere would put that off)."""
        for graphs in self._graphs.values():
            graphs.release()

    def __del__(self) -> None:
        # At the interpreter's exit, or for a wrapper whose __init__ failed, there may be
        # nothing left to release.
        with contextlib.suppress(Exception):
            self._release()

    @property
    def is_captured(self) -> bool:
        """Whether a graph of the current mode is captured, so calls replay it."""
        graphs = self._current_graphs()
        return graphs is not None and graphs.captured_any()

    def graphs(self) -> GraphList:
        """The wrapper's graphs: each one's mode, key (None for ``Static``, the structure and
        input shapes for ``Exact``, the batch dims for ``Buckets``), whether it is captured,
        its replays, and the fraction of the rows replayed that were padding.

        A list of ``GraphInfo``, whose ``eager_calls`` attribute counts the calls that no
        graph answered and that ran eagerly, by reason (``"past max_graphs"``, ``"past
        max_graphs static values"``, ``"above the largest bucket"``), since the last
        ``reset()``.
        """
        with self._lock:
            infos = [
                info
                for key, graphs in self._graphs.items()
                for info in graphs.infos(self._shown(key))
            ]
            return GraphList(infos, self._eager_calls())

    def _eager_calls(self) -> dict[str, int]:
        """The calls that ran eagerly, by reason, over every mode and device."""
        counts: dict[str, int] = {}
        overflows = [graphs.overflow for graphs in self._graphs.values()]
        for overflow in [*overflows, *self._overflows.values()]:
            for reason, calls in overflow.calls.items():
                counts[reason] = counts.get(reason, 0) + calls
        return counts

    def input_buffers(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The static input buffers of the graph that answers calls like
        ``(*args, **kwargs)`` (without arguments: the wrapper's only graph), to fill in place.

        Returned as ``(args, kwargs)`` in the call's own structure, with the buffers as its
        tensors: a TensorDict call gets ``((td,), {})``, a TensorDict whose entries are the
        buffers; keyword tensors of a TensorDict module, ``((), {name: buffer})``. Write the
        next call's data into them (``buffer.copy_(x, non_blocking=True)``, from pinned host
        memory say), then call the wrapper with them: an input that is its graph's buffer is
        not copied again. Every call is still checked. The buffers stay the graph's until it
        is captured again (a replaced parameter) or the wrapper is reset: a call with old
        buffers then copies them in, as any input. With ``outputs="borrowed"``, a call
        moves no memory at all but the launch. See the docs' Borrowed outputs page.

        Raises:
            RuntimeError: No graph answers such calls yet (call the wrapper ``warmup`` times,
                or ``precapture``, first).
            ValueError: Called without arguments on a wrapper with several graphs.

        Examples:
            >>> import torch
            >>> from cudagraph_td import CudaGraphModule
            >>> graphed = CudaGraphModule(torch.nn.Linear(3, 2), backend="emulate")
            >>> with torch.no_grad():
            ...     for _ in range(2):
            ...         _ = graphed(torch.randn(4, 3))
            ...     (x,), _ = graphed.input_buffers()
            ...     _ = x.copy_(torch.ones(4, 3))
            ...     y = graphed(x)
            >>> y.shape
            torch.Size([4, 2])
        """
        with self._lock:
            # Calls like these replay a graph of the current mode: not another mode's of the
            # same shapes (grad mode's, say), whose buffers such calls would copy into theirs.
            mode = _modes.current_mode(self.module) if args or kwargs else None
            entries = [
                entry
                for key, graphs in self._graphs.items()
                if mode is None or key.mode == mode
                for graph in graphs.entries.values()
                for entry in (graph, *graph.rows.values())  # a bucket's rows too
                if entry.captured is not None and (mode is None or entry.reads(args, kwargs))
            ]
            if not entries:
                raise _errors_borrowed.no_input_buffers(self._name, bool(args or kwargs))
            if len(entries) > 1 and not (args or kwargs):
                raise _errors_borrowed.several_input_buffers(self._name, len(entries))
            return entries[0].input_buffers(keywords=bool(kwargs) and not args)

    def pool(self) -> Any:
        """The memory pool of the wrapper's graphs, to share with other wrappers (``pool=``)."""
        if isinstance(self._pool, SharedPool):
            device = self.device or torch.device("cuda", torch.cuda.current_device())
            return self._pool.handle(device)
        return self._pool

    def precapture(self, *args: Any, **kwargs: Any) -> None:
        """Warm up and capture the graphs of calls like ``(*args, **kwargs)`` now, in the
        current mode, rather than at the first calls.

        With ``shapes=Buckets(...)``, every listed size (or every power of two up to the
        example's batch) is captured, largest first, so that the smaller graphs reuse its
        memory. The example runs as calls do (``warmup`` times): do not precapture a training
        step with data it must not train on.

        Raises:
            RuntimeError: The example's call runs eagerly (above the largest bucket, or past
                ``max_graphs``).
        """
        if self._backend_name == "eager":
            return
        with self._lock:
            _, graphs = self._select(_tree.flatten_call(args, kwargs))
            if graphs is None:
                raise _errors_shapes.not_captured_after_precapture(type(self).__name__)
            graphs.precapturing = True
            try:
                for _ in range(self._warmup):
                    self._call(args, kwargs)
            finally:
                graphs.precapturing = False
            if not graphs.captured_any():
                raise _errors_shapes.not_captured_after_precapture(type(self).__name__)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's ``state_dict``, or ``{}`` for a function without one."""
        state_dict = getattr(self.module, "state_dict", None)
        return {} if state_dict is None else state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Load ``state_dict`` into the wrapped module, in place, so a captured graph sees it.

        Raises:
            TypeError: The wrapped function has no ``load_state_dict`` and the state is not empty.
        """
        load = getattr(self.module, "load_state_dict", None)
        if load is None:
            if state_dict:
                raise _errors.no_state_dict(type(self).__name__, self.module)
            return None
        return load(state_dict, *args, **kwargs)

    def __copy__(self) -> CudaGraphModule:
        """A new, uncaptured wrapper of the same function or module, with the same options."""
        return _copying.shallow(self, self.module, self._options)  # type: ignore[no-any-return]

    def __deepcopy__(self, memo: dict[int, Any]) -> CudaGraphModule:
        """A new, uncaptured wrapper of a deep copy of the function or module, with the same
        options (an RL target network: ``target = copy.deepcopy(policy)``).

        Raises:
            TypeError: The wrapped function's copy would share modules or optimizers with it
                (a deep copy of a function is the function itself).
        """
        return _copying.deep(  # type: ignore[no-any-return]
            self, self._name, self.module, self._options, memo
        )

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (``torch.save``) keeps: the function or module and the options, so
        that loading gives a new, uncaptured wrapper (a memory pool given is not kept).

        Raises:
            TypeError: The function or module cannot be pickled (a local function): save its
                ``state_dict()`` instead.
        """
        return _copying.state(self._name, self.module, self._options, type(self))

    def __setstate__(self, state: dict[str, Any]) -> None:
        _copying.restore(self, state)

    def __getattr__(self, name: str) -> Any:
        # Only for an attribute not found: a copy not made yet, which its first use makes
        # (see `_call.copying.restore`), or a name the wrapper does not have.
        return _copying.initialise(self, name)

    def __repr__(self) -> str:
        if self._backend_name == "eager":
            state = "eager" if self._eager_by is None else f"eager ({self._eager_by})"
        elif not self._graphs:
            state = f"warming up: 0 of {self._warmup - 1} warm-up calls done"
        else:  # one entry per mode the wrapper was called in, with its graphs' stage
            state = "; ".join(f"{self._shown(k)}: {g.stage()}" for k, g in self._graphs.items())
        fields = {
            "module": repr(self.module).replace("\n", "\n    "),
            "warmup": self._warmup,
            "in_keys": self.in_keys,
            "out_keys": self.out_keys,
            "backend": repr(self._backend_name),
        }
        if self._shapes != Static():  # the default
            fields["shapes"] = repr(self._shapes)
        if self._options["outputs"] != "fresh":  # the default
            fields["outputs"] = repr(self._options["outputs"])
        fields["state"] = state
        eager_calls = self._eager_calls()
        if eager_calls:
            fields["eager_calls"] = repr(eager_calls)
        body = ",\n".join(f"    {key}={value}" for key, value in fields.items())
        return f"{type(self).__name__}(\n{body}\n)"
