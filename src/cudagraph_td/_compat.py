"""Every private torch and tensordict API the library uses, in one place.

No other module of the package names a private torch or tensordict API (a module, function,
attribute, method or ATen operation whose name starts with ``_``): ``tests/test_architecture.py``
scans the sources for one. Each entry here says what it is, why the public API does not do,
the versions it was checked against, and what happens where it is gone (its fallback, or
none); ``tests/test_compat.py`` fails when one of them changes (is gone, or no longer does
what the library relies on). "Checked" below means: with torch 2.11 (the GPU machine, CUDA
13.0) and torch 2.13 (CPU), and with tensordict 0.14.3 and 0.15.3.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import operator
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import TensorDict
from tensordict.nn import probabilistic

# `TorchDispatchMode`: the base class of a mode that sees every ATen operation, with its
# tensors, below autograd; the emulation's recorder is one. The function mode stack and
# `DeviceContext`: see `default_device_set`. Checked; if gone: none (the import fails).
from torch.overrides import _get_current_function_mode_stack as _function_modes
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

# --- torch: the CPU emulation's recorder (`_emulation.recording`, `_emulation.host_calls`) --

below_autograd: Callable[[], Any] = torch._C._AutoDispatchBelowAutograd
"""A context that runs ATen operations below autograd (``torch._C._AutoDispatchBelowAutograd``):
the emulation's replay runs its recorded operations so, as a CUDA graph's replay runs
kernels. Checked; if gone: none."""


def op_arguments(func: Any) -> Any:
    """The schema arguments of an ATen operation (``OpOverload._schema.arguments``), whose
    alias information marks the arguments the operation writes. Checked; if gone: none."""
    return func._schema.arguments


def default_device_set() -> bool:
    """Whether this thread has a default device for factories (``torch.set_default_device``,
    ``with torch.device(...)``): both push a ``torch.utils._device.DeviceContext`` on torch's
    function mode stack (``torch.overrides._get_current_function_mode_stack``), which no
    public API lists; ``torch.get_default_device()`` cannot tell a chosen CPU from none.
    Checked; if gone: none."""
    return any(isinstance(mode, DeviceContext) for mode in _function_modes())


def _aten(name: str) -> Any:
    """``torch.ops.aten.<name>.default``, or ``None`` where this torch has no such operation
    (the recorder's check that names it then never applies)."""
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else packet.default


# The underscored ATen operations that the recorder refuses or inspects, as a CUDA capture
# would (see `_emulation.recording`). Checked; if one is gone: `None`, and its check is lost.
aten_local_scalar_dense = _aten("_local_scalar_dense")
"""What ``.item()`` (and ``bool()``, ``float()`` of a tensor) dispatches: a host read."""
aten_unique = _aten("_unique")
"""``torch._unique``: an output shape that depends on values."""
aten_unique2 = _aten("_unique2")
"""What ``torch.unique`` dispatches: an output shape that depends on values."""
aten_index_put_impl_ = _aten("_index_put_impl_")
"""The kernel of ``index_put_``: ``(self, indices, values, accumulate, unsafe)``."""
aten_linalg_check_errors = _aten("_linalg_check_errors")
"""What ``torch.linalg``'s ``cholesky``, ``inv`` and ``solve`` dispatch after their ``_ex``
form: a host read of the error codes."""
aten_linalg_eigh = _aten("_linalg_eigh")
"""What ``torch.linalg.eigh`` and ``eigvalsh`` dispatch (CUDA's solver syncs the host)."""


# --- torch: modes ------------------------------------------------------------------------

any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
"""Whether autocast is on for any device type (``torch._C._is_any_autocast_enabled``;
``torch.is_autocast_enabled()`` asks of one): read at every call of a wrapper, for the
autocast part of its mode. Checked; if gone: none."""

set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled
"""Set this thread's grad mode (``torch._C._set_grad_enabled``, which the context
``torch.set_grad_enabled`` wraps in Python frames): the emulation's replay sets it for each
run of operations recorded under one mode. Checked; if gone: none."""

inference_mode_state: Callable[[bool], Any] = torch._C._InferenceMode
"""A context that sets inference mode (``torch._C._InferenceMode``, which
``torch.inference_mode`` wraps): as ``set_grad_enabled``. Checked; if gone: none."""


# --- torch: tensors and the replay path --------------------------------------------------

foreach_copy_ = torch._foreach_copy_
"""``torch._foreach_copy_(dst, src)``: one multi-tensor copy, issued faster than a ``copy_``
per tensor, even for one tensor. The replay's input copy and the packed outputs use it.
Checked; if gone: none."""

foreach_zero_ = torch._foreach_zero_
"""``torch._foreach_zero_(tensors)``: zeroes a list of tensors in one multi-tensor launch.
A training step's replay zeroes the gradient tensors that it adds into and that were set to
``None`` (see `_state.training.Watch`). Checked; if gone: none."""

version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""A tensor's version counter (``Tensor._version``), which every in-place operation moves:
how a capture tells the inputs and parameters that the function wrote. Checked; if gone:
none."""

as_strided = torch.as_strided
"""``torch.as_strided`` (public): a view at a given offset, the cheapest view to make (the
function parses its arguments faster than the unbound method ``Tensor.as_strided``: about
0.1 us a view, measured on the CPU with torch 2.13)."""


def graph_replay(graph: Any) -> Callable[[], None]:
    """``graph.replay``, without the Python frame that ``torch.cuda.CUDAGraph.replay`` adds.

    That frame only checks an input-liveness tracker (``CUDAGraph._tracker``, torch 2.13),
    which ``capture_begin(check_input_liveness=True)`` turns on and the library never does,
    or does nothing more (torch 2.11): the replay path calls the C++ method of
    ``torch._C._CUDAGraph`` directly. Any other graph (the emulation's, a graph with a
    tracker) replays through its own ``replay``. Checked; if the frame does more, the test
    says so.
    """
    if isinstance(graph, torch.cuda.CUDAGraph) and getattr(graph, "_tracker", None) is None:
        return super(torch.cuda.CUDAGraph, graph).replay
    return graph.replay  # type: ignore[no-any-return]


NO_MEMORY = "invalid python storage"
"""What torch's error says of a storage that holds no memory: a wrapper subclass's own
(``_make_wrapper_subclass``), whose ``data_ptr`` raises ``RuntimeError`` with it. Matched by
`_values.storages.readable`, which tells such a storage from one made unreadable by a lease.
No public API tells them apart. Checked (torch 2.11, 2.13); if changed: a memoryless
subclass's error is raised as torch's, not the library's."""


# --- torch: borrowed outputs (`_values.borrowed`) ------------------------------------------


def _missing(*args: Any) -> Any:
    """What stands for a function this torch lacks (see `CAN_BORROW`): never called."""
    raise NotImplementedError


storage_over: Callable[[int, torch.device, int], torch.UntypedStorage] = getattr(
    torch._C, "_construct_storage_from_data_pointer", _missing
)
"""A new storage over ``nbytes`` of memory at ``data_ptr`` that it does not own (freeing it
frees nothing), ``storage_over(data_ptr, device, nbytes)``: what a borrowed output's tensors
view (``torch._C._construct_storage_from_data_pointer``, see `CAN_BORROW`). Called as it is,
on the borrowed replay path."""

cuda_tensor_over: Callable[[dict[str, Any], torch.UntypedStorage], torch.Tensor] = getattr(
    torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", _missing
)
"""A CUDA tensor over a storage, laid out as a dict of ``size``, ``stride``, ``dtype``,
``device`` and ``storage_offset``, in one call
(``torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata``, see `CAN_BORROW`)."""

_forbid_access: Callable[[int, str], None] = getattr(
    torch._C, "_set_storage_data_ptr_access_error_msg", _missing
)
CAN_BORROW = _missing not in (storage_over, cuda_tensor_over, _forbid_access)
"""Whether this torch can lend a CUDA graph's output memory with use-after-overwrite
detection: a new storage over memory it does not own (`storage_over`), a CUDA tensor over
it (`cuda_tensor_over`), and an error raised by every later access to the data of that
storage, whichever tensor or view reaches it (`forbid_access`:
``torch._C._set_storage_data_ptr_access_error_msg``, storage-wide, unlike
``_set_storage_access_error_msg``, which leaves a view taken before readable). What
torch.compile's CUDA graph trees use. Checked with torch 2.11 (CUDA 13.0); a CPU build has
the first only. If gone: outputs are returned in fresh memory, with a warning."""


def forbid_access(storage: torch.UntypedStorage, message: str) -> None:
    """Make every later access to the data of ``storage`` raise ``RuntimeError(message)``,
    through any tensor or view over it (see `CAN_BORROW`)."""
    _forbid_access(storage._cdata, message)


parse_to: Callable[..., tuple[Any, ...]] = torch._C._nn._parse_to
"""The ``(device, dtype, non_blocking, memory_format)`` that ``Tensor.to``'s arguments name
(``torch._C._nn._parse_to``): the emulation's lent outputs tell a copy to the host by it
(see `_emulation.lent`). Checked (torch 2.11, 2.13)."""

no_subclass_functions: Callable[[], Any] = torch._C.DisableTorchFunctionSubclass
"""A context in which a tensor subclass's ``__torch_function__`` is not called
(``torch._C.DisableTorchFunctionSubclass``): the emulation's lent outputs run torch's own
functions within it (see `_emulation.lent`). Checked; if gone: none."""


def clear_cublas_workspaces() -> None:
    """Free cuBLAS's per-stream workspaces, as torch's CUDA graph trees do around a recording.

    ``torch._C._cuda_clearCublasWorkspaces``: no public function does this, nor frees the
    workspaces of one stream alone. Checked (CUDA builds; CPU builds lack it); if gone:
    nothing is cleared.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def pool_blocks(device: torch.device, pool: Any) -> frozenset[int]:
    """The addresses of the allocated blocks of the graph memory pool ``pool`` on ``device``.

    From ``torch.cuda.memory_snapshot`` (public), whose ``mempool_id`` argument (torch 2.11
    and 2.13) limits it to the pool's segments; filtered here too, in case a version lists
    every segment. Each segment names its pool (``segment_pool_id``), each block its state.

    Its binding releases a reference to each item of the tuple it reads, which it only
    borrowed (torch 2.11, measured; the fix, pytorch/pytorch#196366, was still open in
    September 2026): the pool id's second int, once past the small ints that Python shares,
    was freed by a snapshot while the pool still held it, and its memory given to another
    object (a native crash later, anywhere). The references are given here, before the
    call, where a probe finds that torch takes them (`snapshot_releases_references`).
    """
    if snapshot_releases_references():
        # Given before the call: a reference that only the pool holds is freed within it.
        _give_back(pool)
    segments = torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False)
    return frozenset(
        block["address"]
        for segment in segments
        if segment["device"] == device.index and tuple(segment["segment_pool_id"]) == tuple(pool)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )


@functools.cache
def snapshot_releases_references() -> bool:
    """Whether ``torch.cuda.memory_snapshot(mempool_id=...)`` releases a reference to each
    item of the pool id that it reads (pytorch/pytorch#196366; see `pool_blocks`).

    Probed once with an int of its own (no other object holds it), whose reference is given
    back at once if it was taken; the ``0`` and ``False`` beside it too.
    """
    probe = int("4" * 15)  # made at run time: an int that no constant or cache shares
    pool = (0, probe)
    before = sys.getrefcount(probe)
    try:
        torch.cuda.memory_snapshot(mempool_id=pool, include_traces=False)
    finally:
        released = sys.getrefcount(probe) < before
        if released:
            _give_back(pool)
    return released


def _give_back(pool: Any) -> None:
    """Give the references that ``memory_snapshot(mempool_id=pool, include_traces=False)``
    releases: one to each item of the tuple that it passes its binding."""
    for item in (pool[0], pool[1], False):
        _incref(item)


_incref: Callable[[object], None] = ctypes.PYFUNCTYPE(None, ctypes.py_object)(
    ("Py_IncRef", ctypes.pythonapi)
)
"""Python's ``Py_IncRef`` (C API, stable ABI): gives an object back the reference that a
binding released without owning it (see `pool_blocks`)."""


raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
"""The handle of a device's current stream as an int (``torch._C._cuda_getCurrentRawStream``):
``torch.cuda.current_stream(device).cuda_stream`` builds a ``Stream`` object first, which the
replay path, comparing it at each call, does without. Checked (CUDA builds); ``None`` on a
CPU build, where no wrapper replays a CUDA graph; if gone: none (a CUDA replay fails)."""


def end_allocate_to_pool(device: torch.device, pool: Any) -> None:
    """End the allocator's record of a failed capture into ``pool`` on ``device``.

    ``CUDAGraph.capture_end`` ends it after ending the capture; when ending the capture
    fails (the function broke it), torch raises first and the allocator keeps the pool
    among the captures under way (the pool itself still refuses another capture, torch
    2.11: see `_capture.backend.SharedPool`). ``torch._C._cuda_endAllocateToPool``: no public
    function does it. Checked (CUDA builds; a test on the GPU says whether torch still
    leaves it); if gone: nothing is done.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:
        end(device.index, pool)


def end_capture(graph: torch.cuda.CUDAGraph) -> None:
    """``graph.capture_end()``, without torch's warning about an empty graph: a function that
    launches no kernel (it returns its input, or constants) makes one, which replays
    correctly; the warning is meant for captures on the wrong stream."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")
        graph.capture_end()


def end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool: Any) -> None:
    """End a capture into ``pool`` whose code raised, leaving CUDA as it was before it began.

    An error raised before the first kernel leaves the capture empty, and it ends as any
    other. An error that broke the capture (a host sync, say) also invalidated it: ending it
    raises again. torch 2.11 raises before the end of its own bookkeeping: the allocator's
    routing of the stream into the pool is ended here (`end_allocate_to_pool`; newer
    versions end it themselves, and the call then raises "not currently recording"), and the
    CUDA generator's mark as capturing, which fails the next random op outside a graph
    ("Offset increment outside graph capture encountered unexpectedly"), is cleared by a
    capture of one kernel on the current stream that ends well. Checked on CUDA by every
    test's teardown (``tests/conftest.py``).

    Where torch left the allocator's routing, it left the pinned-memory allocator's too,
    which no binding ends: at each pinned allocation under a later capture (``.item()`` pins
    its scalar) it asks the graph whether that capture is its own. The graph is then kept
    for the process (`BROKEN_CAPTURES`): freed, it would leave that question to a dangling
    pointer."""
    try:
        end_capture(graph)
    except RuntimeError:
        try:
            end_allocate_to_pool(device, pool)
        except RuntimeError:  # "not currently recording": torch ended its routings itself
            pass
        else:
            BROKEN_CAPTURES.append(graph)
        one_node_graph(device)


BROKEN_CAPTURES: list[torch.cuda.CUDAGraph] = []
"""The graphs whose capture broke, kept for the process (see `end_failed_capture`)."""


def one_node_graph(device: torch.device, pool: Any = None) -> torch.cuda.CUDAGraph:
    """A graph of one kernel, captured on the current stream into ``pool`` (None: a new
    one): a pool's anchor (see `_capture.backend.SharedPool`), or a capture that ends well."""
    scratch = torch.empty(1, device=device)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    scratch.zero_()  # a graph must hold a node for capture_end to accept it
    graph.capture_end()
    return graph


def distributions_validate_args() -> bool:
    """Whether ``torch.distributions`` validates arguments by default.

    Its setter, ``Distribution.set_default_validate_args``, is public; the value it sets is
    the class attribute ``Distribution._validate_args``. Checked; if gone: none.
    """
    return bool(torch.distributions.Distribution._validate_args)


# --- torch: nn.Module internals ----------------------------------------------------------

module_children: Callable[[torch.nn.Module], dict[str, Any]] = operator.attrgetter("_modules")
"""A module's own submodules, in the dict that ``nn.Module`` keeps them in (``_modules``).

The dict itself, not a copy: ``module.name = other`` replaces its entry, ``del module.name``
removes it, and the dict stays the same object, so that the state around a graph (`_state.state`)
reads through it what the module holds now. ``named_children()`` copies, and skips
``None``. The same for ``module_parameters`` (``_parameters``) and ``module_buffers``
(``_buffers``). Checked; if gone: none."""

module_parameters: Callable[[torch.nn.Module], dict[str, Any]] = operator.attrgetter("_parameters")
"""A module's own parameters, in its dict (``_parameters``): see ``module_children``."""

module_buffers: Callable[[torch.nn.Module], dict[str, Any]] = operator.attrgetter("_buffers")
"""A module's own buffers, in its dict (``_buffers``): see ``module_children``."""


def module_hooks(module: torch.nn.Module) -> list[str]:
    """The kinds of hooks registered on ``module`` itself ("forward pre", "forward", ...).

    ``nn.Module._forward_pre_hooks`` and the like: no public API lists them. Checked; if
    gone: none are seen (``make_graphed_callables`` no longer refuses a module with hooks).
    """
    kinds = ("forward pre", "forward", "backward pre", "backward")
    return [kind for kind in kinds if getattr(module, f"_{kind.replace(' ', '_')}_hooks", None)]


# --- tensordict --------------------------------------------------------------------------

_holder = getattr(probabilistic, "_interaction_type", None)
interaction_type: Callable[[], Any] = getattr(_holder, "get_mode", probabilistic.interaction_type)
"""tensordict's interaction type: ``interaction_type()`` returns its mode holder's
``get_mode()`` (``tensordict.nn.probabilistic._interaction_type``), and calling that directly
saves a Python call at every replay. Checked; if gone: the public function."""

td_entries: Callable[[TensorDict], dict[str, Any]] = operator.attrgetter("_tensordict")
"""The entries of a ``TensorDict`` by key, as it stores them (nested TensorDicts as such):
``TensorDict._tensordict``, the live dict, which avoids a copy per call. The replay path
reads it at every call: a C accessor, without a Python frame. Checked; if gone: none."""

td_batch_size: Callable[[TensorDict], torch.Size] = operator.attrgetter("_batch_size")
"""A ``TensorDict``'s batch size as it stores it (``_batch_size``, what ``batch_size`` and
``shape`` return): a C accessor, where the properties are two Python frames (``shape``
calls ``batch_size``). The replay path reads it at every call. Checked; if gone: none."""

td_device: Callable[[TensorDict], torch.device | None] = operator.attrgetter("_device")
"""A ``TensorDict``'s device as it stores it (``_device``, what ``device`` returns): a C
accessor, not the property's Python frame. The replay path reads it at every call.
Checked; if gone: none."""

td_has_names: Callable[[Any], bool] = operator.methodcaller("_has_names")
"""Whether a TensorDict has dimension names, without building them (``_has_names()``).
Checked; if gone: none."""

td_new_unsafe: Callable[[type], Callable[..., Any]] = operator.attrgetter("_new_unsafe")
"""``TensorDictBase._new_unsafe`` of a class: a tensor collection around entries, without
the public constructor's checks (the entries come from a TensorDict of this layout). With
``nested=False``, the entries are kept as given, in the source's order (no dict among them
is made a TensorDict): how a replay builds a TensorDict result. Checked; if gone: none."""


def td_get(td: Any, key: Any) -> Any:
    """The entry of a TensorDict at a string key, ``NonTensorData`` still wrapped
    (``_get_str(key, default)``). Checked; if gone: none."""
    return td._get_str(key, None)


def td_set(td: Any, key: Any, value: Any) -> None:
    """Set the entry of a ``TensorDict`` (the exact type: the callers check it) at a string
    key, unchecked (``_set_str(key, value, validated=True, inplace=False)``; a locked
    TensorDict still refuses it): for an entry whose batch size and device the caller knows
    to be the TensorDict's (a TensorDict rebuilt from the old entry; a graph's output of the
    captured shape). A function, not a ``functools.partial`` of the method: a partial with
    keywords merges them into a new dict at every call (120 ns more a call, measured). Checked;
    if gone: none (``td[key] = value`` would do, and check the entry again)."""
    td._set_str(key, value, validated=True, inplace=False)


def tensorclass_parts(tc: Any) -> tuple[Any, dict[str, Any]]:
    """A tensorclass instance's TensorDict of tensor fields, and its other fields
    (``_tensordict``, ``_non_tensordict``). Checked; if gone: none."""
    return tc._tensordict, tc._non_tensordict


def tensorclass_new(cls: type, td: TensorDict, others: dict[str, Any]) -> Any:
    """A tensorclass instance from its TensorDict and other fields
    (``_from_tensordict(td, non_tensordict=...)``). Checked; if gone: none."""
    return cls._from_tensordict(td, non_tensordict=others)  # type: ignore[attr-defined]


# --- torch: optimizers -------------------------------------------------------------------


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Let optimizers built with ``capturable=True`` step on CPU parameters (experimental).

    A captured training step needs a capturable optimizer, which torch refuses for CPU
    parameters. The CPU emulation (``backend="emulate"``) lifts that refusal inside its own
    calls; code that runs the same optimizer eagerly on the CPU (an eager twin in a test)
    runs it inside this context.

    Examples:
        >>> import torch
        >>> from cudagraph_td import capturable_on_cpu
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.Adam([w], lr=torch.tensor(0.1), capturable=True)
        >>> w.grad = torch.ones(3)
        >>> with capturable_on_cpu():
        ...     opt.step()
        >>> w.detach()
        tensor([0.9000, 0.9000, 0.9000])

    torch refuses ``capturable=True`` for CPU parameters through
    ``torch.optim.optimizer._get_capturable_supported_devices``, which each optimizer module
    imports by name (checked; if gone: the refusal stays, and the emulation's training steps
    with capturable optimizers fail); its capturable code paths are tensor operations that
    run on the CPU as they are. The context takes effect on its own thread only: another
    thread meanwhile gets torch's refusal.
    """
    global _capturable_entries
    with _CAPTURABLE_LOCK:
        if _capturable_entries == 0:
            _allow_cpu_captures()
        _capturable_entries += 1
    _capturable_here.depth += 1
    try:
        yield
    finally:
        _capturable_here.depth -= 1
        with _CAPTURABLE_LOCK:  # the last one out restores torch's (threads may overlap)
            _capturable_entries -= 1
            if _capturable_entries == 0:
                for module, original in _patched:
                    module._get_capturable_supported_devices = original
                _patched.clear()


_CAPTURABLE_LOCK = threading.Lock()
_capturable_entries = 0  # how many `capturable_on_cpu` contexts are open, in any thread
_patched: list[tuple[Any, Any]] = []  # (optimizer module, torch's function) while open


class _CapturableHere(threading.local):
    """How many contexts this thread has open: the patched function answers as torch's on
    other threads."""

    depth = 0


_capturable_here = _CapturableHere()


def _allow_cpu_captures() -> None:
    import torch.optim.optimizer as optimizer_module

    original = optimizer_module._get_capturable_supported_devices

    def with_cpu(*args: Any, **kwargs: Any) -> list[str]:
        devices = original(*args, **kwargs)
        return [*devices, "cpu"] if _capturable_here.depth else devices

    for module in _optimizer_modules(original):
        _patched.append((module, original))
        module._get_capturable_supported_devices = with_cpu


# The modules that import torch's function by name, found again when modules were imported
# since: the eager calls of a wrapper without CUDA enter `capturable_on_cpu` at every call,
# and a scan of every module's name cost about 1 ms.
_optimizer_modules_found: tuple[int, list[Any]] = (-1, [])


def _optimizer_modules(original: Any) -> list[Any]:
    global _optimizer_modules_found
    count, modules = _optimizer_modules_found
    if count != len(sys.modules):
        modules = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("torch.optim")
            and getattr(module, "_get_capturable_supported_devices", None) is original
        ]
        _optimizer_modules_found = (len(sys.modules), modules)
    return modules
