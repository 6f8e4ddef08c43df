"""Graph backends: CUDA graphs, and a CPU emulation of their contract for tests.

A backend does two things: run a warm-up call, and capture a function into a graph whose
``replay()`` runs it again on the same memory. ``CudaBackend`` uses
``torch.cuda.CUDAGraph``. ``EmulatedBackend`` keeps the contract that matters to
correctness — static input buffers, and a replay that rewrites the same output tensors —
so that a bug in the wrapper (an output that changes when the wrapper is called again, an
input that is not copied in) fails on a machine without a GPU too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from .. import _compat
from .._compat import any_autocast_enabled, distributions_validate_args
from .._emulation import host_calls as _host_calls
from .._emulation import lent as _lent
from .._emulation import recording as _recording
from .._errors import borrowed as _errors_borrowed
from .._errors import inputs as _errors
from .._values import tree as _tree
from .._values.borrowed import Lease, LentOutputs
from .._values.outputs import Copies
from . import sharing as _sharing
from .devices import call_device

if TYPE_CHECKING:
    from .distributed import Agreement

T = TypeVar("T")

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

BACKENDS = ("auto", "cuda", "emulate", "eager")

OUTPUTS = ("fresh", "borrowed")

# What lends the static outputs of one graph at each call, under one lease (see `Backend.lend`).
Lend = Callable[[list[torch.Tensor]], Copies]


def check_options(backend: str, capture_error_mode: str, outputs: str = "fresh") -> None:
    """Raise a ``ValueError`` that lists the valid values of an option the user got wrong."""
    if backend not in BACKENDS:
        raise _errors.invalid_option("backend", backend, BACKENDS)
    if outputs not in OUTPUTS:
        raise _errors.invalid_option("outputs", outputs, OUTPUTS)
    if capture_error_mode not in CAPTURE_ERROR_MODES:
        raise _errors.invalid_option("capture_error_mode", capture_error_mode, CAPTURE_ERROR_MODES)


def make_backend(
    name: str,
    device: torch.device | None,
    pool: Any,
    capture_error_mode: str,
    leaves: list[Any],
    agreement: Agreement | None = None,
    borrow: bool = False,
) -> Backend:
    """The backend called ``name``; a CUDA one on ``device``, else on the device of the
    first call's ``leaves`` (see `_capture.devices.call_device`). ``agreement``: the ranks'
    `Agreement` of a DDP step, else None. ``borrow``: outputs lent, not copied
    (``outputs="borrowed"``)."""
    backend: Backend
    if name == "emulate":
        backend = EmulatedBackend(device, rerun=agreement is not None)  # see `EmulatedBackend`
    else:
        device = call_device(leaves, device)
        backend = CudaBackend(device, pool, capture_error_mode, agreement)
    backend.borrow = borrow
    return backend


def can_borrow(name: str, backend: str) -> bool:
    """Whether outputs can be lent on ``backend`` (the emulation always can; CUDA where torch
    can detect their use after overwrite, see `_compat.CAN_BORROW`): else a warning, and
    outputs in fresh memory."""
    if backend == "emulate" or _compat.CAN_BORROW:
        return True
    warnings.warn(_errors_borrowed.cannot_borrow(name), UserWarning, stacklevel=3)
    return False


def backend_factory(
    name: str,
    device: torch.device | None,
    pool: Any,
    capture_error_mode: str,
    agreement: Agreement | None,
    borrow: bool = False,
) -> Callable[[list[Any]], Backend]:
    """What makes a wrapper's backend from the leaves of its first call (see `make_backend`)."""

    def make(leaves: list[Any]) -> Backend:
        return make_backend(name, device, pool, capture_error_mode, leaves, agreement, borrow)

    return make


class Graph(Protocol):
    def replay(self) -> None: ...


class Backend(Protocol):
    """Runs warm-up calls, and records a function into a graph without running its effects."""

    device: torch.device
    # Whether a replay runs the function's Python code again (the emulation) or not (CUDA).
    reruns_python: bool
    # Whether its graphs lend their outputs (``outputs="borrowed"``) instead of copying them.
    borrow: bool

    def lend(self, label: str) -> Lend | None:
        """What lends the outputs of a graph it captures, under one lease for that graph
        (see `_values.borrowed`); None: outputs copied into fresh memory."""

    def lend_gradients(self, label: str, leaves: list[torch.Tensor]) -> Lend | None:
        """``lend`` for the gradients of a backward graph, which autograd may take into the
        ``.grad`` of ``leaves`` (the parameters it differentiates)."""

    def warmup(self, fn: Callable[[], T]) -> T: ...

    def for_autograd(self) -> Backend:
        """The backend that captures a forward and backward pair (see `CudaBackend`)."""

    def capture(self, fn: Callable[[], T], like: T) -> tuple[Graph, T]:
        """Record ``fn``; return the graph and its static outputs, shaped as ``like``.

        ``like`` is a result of ``fn`` from an eager run (the backend may build its static
        outputs from it). Recording runs none of the function's effects: the first replay
        does.
        """


class SharedPool:
    """The memory pool of a wrapper's graphs (one per device), usable for the wrapper's life.

    torch (2.11) cannot capture into a pool again once every graph in it has been freed
    (an internal assert), nor after a capture into it failed (it still counts as recording).
    So each pool holds an *anchor*, an empty graph of its own, for as long as the wrapper
    lives; and a failed capture leaves the pool to the graphs already in it, the next one
    taking a new pool.
    """

    def __init__(self) -> None:
        self._pools: dict[torch.device, tuple[Any, Any]] = {}  # device -> (handle, anchor)

    def handle(self, device: torch.device) -> Any:
        """The pool's handle on ``device``, made (with its anchor) at first use."""
        if device not in self._pools:
            handle = torch.cuda.graph_pool_handle()
            with torch.cuda.stream(_sharing.capture_stream(device)):
                self._pools[device] = (handle, _compat.one_node_graph(device, handle))
        return self._pools[device][0]

    def give_up(self, device: torch.device) -> None:
        """After a failed capture into the pool: the next capture takes a new one."""
        self._pools.pop(device, None)


class CudaBackend:
    """Warm-up and capture on the device's side stream, into the given memory pool, with the
    device's shared cuBLAS workspace (see `_capture.sharing`).

    ``pool`` is the pool of the owner's graphs: a ``SharedPool``, a handle the user gave,
    or ``None`` for a new one per capture.
    """

    reruns_python = False
    borrow = False

    def __init__(
        self,
        device: torch.device,
        pool: Any = None,
        capture_error_mode: str = "global",
        agreement: Agreement | None = None,
    ):
        self.device = device
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        # For a DDP step: the ranks tell each other how their captures went
        # (`_capture.distributed`).
        self.agreement = agreement
        # A side stream: the warm-up runs off the caller's stream so that lazy
        # initialisations (cuBLAS workspaces, autograd and optimizer state) happen before the
        # capture and not inside it. The capture runs on the same stream: autograd ties each
        # parameter's gradient accumulation to the stream of the forward that first used it,
        # and a warm-up result still alive during the capture (the capturing call's result)
        # would otherwise tie it to another stream than the captured backward's. Warm-ups
        # and captures hold the process's capture lock: one stream serves every wrapper.
        self._stream = _sharing.capture_stream(device)

    def for_autograd(self) -> CudaBackend:
        """The backend of a forward and backward pair: a pool of their own, unless the user
        gave one. What the forward saves for the backward stays in the pool between the two
        replays, while the owner's other graphs may replay and reuse the pool's free memory."""
        pool = None if isinstance(self.pool, SharedPool) else self.pool
        backend = CudaBackend(self.device, pool, self.capture_error_mode)
        backend.borrow = self.borrow
        return backend

    def lend(self, label: str) -> Lend | None:
        if not self.borrow:
            return None
        lease = Lease(label)
        return lambda static: LentOutputs(static, lease)

    def lend_gradients(self, label: str, leaves: list[torch.Tensor]) -> Lend | None:
        return self.lend(label)

    def warmup(self, fn: Callable[[], T]) -> T:
        # The warm-up uses the shared workspace eagerly: after every replay on the device,
        # and before any later one (the caller's stream waits for it, and is the device's
        # last replay stream from now on).
        _sharing.ordered(self.device.index)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream), _no_autocast_cache():
            if not torch.cuda.is_current_stream_capturing():  # else inside another's capture
                _sharing.workspace(self.device).ensure()
            out = fn()
        current.wait_stream(self._stream)
        return out

    def capture(self, fn: Callable[[], T], like: T) -> tuple[Graph, T]:
        # No work queued before the capture may still be running when it begins: in the
        # "global" error mode another stream's work would make the capture fail.
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # torch.distributions checks its arguments with a host sync, which no graph can
        # capture; the eager warm-up and capturing calls have checked them already.
        validate_args = distributions_validate_args()
        torch.distributions.Distribution.set_default_validate_args(False)
        # A pool of its own unless given one: named here, so that a failed capture can end
        # its routing of allocations (see `_end_failed_capture`).
        if isinstance(self.pool, SharedPool):
            pool = self.pool.handle(self.device)
        else:
            pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        if self.borrow:  # lent outputs in memory that no other graph's replay writes
            fn = _into_own_memory(fn, like, self.device)
        try:
            with (
                _sharing.collection_held_off(),
                torch.cuda.stream(self._stream),
                _no_autocast_cache(),
            ):
                # The graph records the workspace's address: one of the library's own, never
                # one that another graph or eager work made (see `_capture.sharing`).
                _sharing.workspace(self.device).ensure()
                graph.capture_begin(pool=pool, capture_error_mode=self.capture_error_mode)
                try:
                    out = fn()
                except BaseException as err:
                    self._end_failed_capture(graph, pool)
                    _take_pending_solver_error(err, self.device)
                    if isinstance(self.pool, SharedPool):
                        self.pool.give_up(self.device)
                    raise
                _compat.end_capture(graph)
        except BaseException as err:
            if self.agreement is not None:  # the other ranks drop their graphs too
                self.agreement.outcome(err)
            raise
        finally:
            torch.distributions.Distribution.set_default_validate_args(validate_args)
        if self.agreement is not None:  # raises if another rank's capture failed
            self.agreement.outcome(None)
        return graph, out

    def _end_failed_capture(self, graph: torch.cuda.CUDAGraph, pool: Any) -> None:
        """Take the capture stream out of capture mode after the function raised inside it
        (the caller raises the function's error, which says what went wrong)."""
        _compat.end_failed_capture(graph, self.device, pool)
        if torch.cuda.is_current_stream_capturing():  # pragma: no cover - driver failure
            raise RuntimeError("cudagraph_td could not end a failed capture")


def _into_own_memory(fn: Callable[[], T], like: T, device: torch.device) -> Callable[[], T]:
    """``fn``, whose output tensors on ``device`` are copied, as its graph's last kernels,
    into memory of their own, allocated now (before the capture) outside every graph pool.

    A graph's outputs lie in its pool, in memory that the graphs captured into the pool
    before it used as scratch and write again at each of their replays (a wrapper's shapes,
    buckets and modes, `make_graphed_callables` over several callables, a ``pool=`` shared by
    wrappers). Fresh outputs are copied out right after their own replay, so that does not
    matter; lent ones (``outputs="borrowed"``) must stay valid until their own graph's next
    replay, whichever graph replays meanwhile: each is a copy, made inside the graph (no
    host cost at a replay), into memory that only this graph writes. ``like`` is an eager
    result of ``fn``: the outputs' shapes and dtypes.
    """
    assert like is not None, "a lent graph's outputs are allocated from an eager result"
    leaves, _ = _tree.flatten(like)
    with torch.no_grad():
        own = [
            torch.empty_like(leaf)
            if isinstance(leaf, torch.Tensor) and leaf.device == device
            else None
            for leaf in leaves
        ]

    def run() -> T:
        out = fn()
        leaves, spec = _tree.flatten(out)
        if len(leaves) != len(own):  # pragma: no cover - the same Python, the same outputs
            raise RuntimeError("cudagraph_td: the captured call returned another tree")
        targets, sources = [], []
        for i, (mine, leaf) in enumerate(zip(own, leaves, strict=True)):
            if mine is None or not isinstance(leaf, torch.Tensor):
                continue
            if (mine.shape, mine.dtype) != (leaf.shape, leaf.dtype):  # pragma: no cover
                raise RuntimeError("cudagraph_td: the captured call returned other tensors")
            targets.append(mine)
            sources.append(leaf.detach())
            leaves[i] = mine
        if targets:
            with torch.no_grad():
                _compat.foreach_copy_(targets, sources)
        rebuilt = _tree.unflatten(spec, leaves)
        orders = _tree.key_orders(out)  # flattening sorts TensorDict keys: the function's order
        return rebuilt if orders is None else _tree.in_key_orders(rebuilt, orders)  # type: ignore[no-any-return]

    return run


def _take_pending_solver_error(err: BaseException, device: torch.device) -> None:
    """Let a throw-away cuSOLVER call report the error that a failed capture left pending.

    A decomposition whose solver cannot run in a capture (``torch.linalg.eigh`` on torch
    2.11) fails with a cuSOLVER error, and cuSOLVER reports that error again at its next
    call on the thread, whatever that call is (seen on the H100: the next
    ``torch.linalg.qr`` outside any graph failed once, then worked). Taken here, on the
    failure path only, the user's next call works.
    """
    if "cusolver" not in str(err).lower():
        return
    with contextlib.suppress(RuntimeError):
        torch.linalg.qr(torch.eye(2, device=device))


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast's cache off, under autocast, for the warm-ups and the capture.

    The cache keeps the casts of parameters made by earlier calls in the same autocast
    region (a warm-up's): a graph that read them would never see the parameters change.
    Off, the capture records the casts themselves. Off for the warm-ups too, so that a
    ``torch.compile``d function, which guards on it, is not compiled again in the capture.
    """
    if not any_autocast_enabled() or not torch.is_autocast_cache_enabled():
        yield
        return
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(True)


class EmulatedBackend:
    """A CPU stand-in for CUDA graphs with their contract (see `_emulation.recording`).

    ``capture`` records the function's ATen operations (undoing their effects, as a CUDA
    capture has none), and returns its outputs as the static outputs; each ``replay`` runs
    the recorded operations again on the same tensors, without the function's Python code:
    Python values are frozen at the capture, random operations draw new numbers, in-place
    updates happen again, outputs are overwritten.
    """

    def __init__(self, device: torch.device | None = None, *, rerun: bool = False):
        self.device = torch.device("cpu") if device is None else device
        self.borrow = False
        # A step whose collectives torch runs outside the dispatcher (DDP's gradient
        # all-reduce) cannot be recorded: its replays run the function again instead.
        self.reruns_python = rerun

    def warmup(self, fn: Callable[[], T]) -> T:
        # Capturable optimizers (see `_compat`); the CPU tensors made marked (`HostMemory`).
        with _compat.capturable_on_cpu(), _host_calls.EagerRunWatch():
            return fn()

    def for_autograd(self) -> EmulatedBackend:
        return self

    def lend(self, label: str) -> Lend | None:
        if not self.borrow:
            return None
        lease = Lease(label, _lent.forbid)
        return lambda static: _lent.EmulatedLentOutputs(static, lease)

    def lend_gradients(self, label: str, leaves: list[torch.Tensor]) -> Lend | None:
        if not self.borrow:
            return None
        lease = Lease(label, _lent.forbid)
        return lambda static: _lent.EmulatedLentGradients(static, lease, leaves)

    def capture(self, fn: Callable[[], T], like: T) -> tuple[Graph, T]:
        if self.reruns_python:
            graph = _RerunGraph(fn, like)
            return graph, graph.static_outputs
        # As on CUDA: torch.distributions' argument checks read values on the host (the
        # eager warm-up and capturing calls checked them); autocast's cache would keep a
        # capture-time cast of each parameter, which the recording would then not recompute
        # (see `_no_autocast_cache`).
        validate_args = distributions_validate_args()
        torch.distributions.Distribution.set_default_validate_args(False)
        try:
            with _no_autocast_cache(), _compat.capturable_on_cpu():
                return _recording.record(fn)
        finally:
            torch.distributions.Distribution.set_default_validate_args(validate_args)


class _RerunGraph:
    """The emulation's graph of a step it cannot record (see `EmulatedBackend`): a replay
    runs the function again, and copies its tensors into static outputs shaped as ``like``,
    a result of an eager run."""

    def __init__(self, fn: Callable[[], Any], like: Any):
        self._fn = fn
        self._grad_enabled = torch.is_grad_enabled()
        leaves, self._spec = _tree.flatten(like)
        with torch.no_grad():
            leaves = [
                torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
                for leaf in leaves
            ]
        self._static = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self._meta = [(t.shape, t.dtype) for t in self._static]
        # Flattening sorts TensorDict keys: given back in the order the function set them.
        self.static_outputs = _tree.unflatten(self._spec, leaves)
        orders = _tree.key_orders(like)
        if orders is not None:
            self.static_outputs = _tree.in_key_orders(self.static_outputs, orders)

    def replay(self) -> None:
        with torch.set_grad_enabled(self._grad_enabled), _compat.capturable_on_cpu():
            out = self._fn()
        leaves, spec = _tree.flatten(out)
        new = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if spec != self._spec or [(t.shape, t.dtype) for t in new] != self._meta:
            raise _errors.emulated_branch_changed()
        if new:
            with torch.no_grad():
                _compat.foreach_copy_(self._static, [t.detach() for t in new])
