"""The private torch and tensordict APIs of `_compat`: each behaves as the library assumes.

A failure here means an upstream release changed something the library relies on: read the
entry's note in `src/cudagraph_td/_compat.py` before changing the library.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import TensorDict, tensorclass
from tensordict.nn import InteractionType, set_interaction_type
from tensordict.nn.probabilistic import interaction_type as public_interaction_type
from tensordict.tensorclass import NonTensorData

from cudagraph_td import _compat

from .conftest import requires_cuda, run_python


def test_cuda_graph_replay_only_checks_the_liveness_tracker() -> None:
    # `graph_replay` calls the C++ replay and skips `CUDAGraph.replay`'s Python frame, whose
    # only work is (torch 2.13) the liveness tracker's check, or (torch 2.11) nothing. Any
    # other name in it (a hook, a counter) would be skipped too: read the new code before
    # accepting it here.
    names = set(torch.cuda.CUDAGraph.replay.__code__.co_names)
    assert {"super", "replay"} <= names <= {"_tracker", "check_alive", "pool", "super", "replay"}


@requires_cuda
def test_graph_replay_is_the_cpp_replay_for_a_graph_without_tracker() -> None:
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)
    replay = _compat.graph_replay(graph)
    assert replay == super(torch.cuda.CUDAGraph, graph).replay
    replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4


def test_other_graphs_replay_through_their_own_replay() -> None:
    class Recorded:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    graph = Recorded()
    _compat.graph_replay(graph)()
    assert graph.replays == 1


@requires_cuda
def test_cublas_workspaces_can_be_cleared() -> None:
    assert callable(torch._C._cuda_clearCublasWorkspaces)
    a = torch.randn(8, 8, device="cuda")
    _compat.clear_cublas_workspaces()
    torch.testing.assert_close(a @ a, (a.double() @ a.double()).float(), rtol=1e-4, atol=1e-4)


_POOL_BLOCKS = """
import gc, traceback, torch
from cudagraph_td import _compat

def check():
    pool = torch.cuda.graph_pool_handle()
    device = torch.device("cuda", torch.cuda.current_device())
    outside = torch.empty(1 << 20, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        kept = torch.ones(1 << 20, device=device)
        freed = torch.ones(3 << 20, device=device)
    blocks = _compat.pool_blocks(device, pool)
    assert kept.data_ptr() in blocks and freed.data_ptr() in blocks, blocks
    assert outside.data_ptr() not in blocks
    del freed
    assert _compat.pool_blocks(device, pool) == {kept.data_ptr()}

check()
gc.collect()
torch.manual_seed(0)
traceback.format_stack()
print("ok")
"""


@requires_cuda
def test_pool_blocks_lists_the_allocated_blocks_of_one_pool() -> None:
    # `pool_blocks` reads `torch.cuda.memory_snapshot(mempool_id=...)`; the workspace logic
    # of `_capture.sharing` tells from it whether a clear freed its workspaces. In a process of its
    # own: before `pool_blocks` gave torch the references it takes (see the test below), the
    # next test's setup once crashed after it in the GPU suite.
    done = run_python("-c", _POOL_BLOCKS)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@requires_cuda
def test_raw_stream_is_the_current_streams_handle() -> None:
    assert _compat.raw_stream is not None
    side = torch.cuda.Stream()
    assert _compat.raw_stream(0) == torch.cuda.current_stream(0).cuda_stream
    with torch.cuda.stream(side):
        assert _compat.raw_stream(0) == side.cuda_stream


def test_interaction_type_reads_the_same_mode_as_the_public_function() -> None:
    # The mode holder's own getter, not the public function (its fallback).
    assert _compat.interaction_type is not public_interaction_type
    assert _compat.interaction_type() == public_interaction_type()
    for mode in InteractionType:
        with set_interaction_type(mode):
            assert _compat.interaction_type() == public_interaction_type() == mode


def test_distributions_validate_args_reads_the_default_set_by_its_setter() -> None:
    before = _compat.distributions_validate_args()
    try:
        for value in (False, True):
            torch.distributions.Distribution.set_default_validate_args(value)
            assert _compat.distributions_validate_args() is value
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def test_tensordict_batch_size_and_device_are_what_its_properties_return() -> None:
    # The replay path reads both as stored: they must be what `batch_size`, `shape` and
    # `device` say, also after a user sets the batch size or moves the TensorDict.
    td = TensorDict(a=torch.zeros(3, 2), batch_size=[3, 2])
    assert _compat.td_batch_size(td) is td.batch_size == td.shape == torch.Size([3, 2])
    assert _compat.td_device(td) is td.device is None
    td.batch_size = [3]
    assert _compat.td_batch_size(td) == td.shape == torch.Size([3])
    moved = td.to("cpu")
    assert _compat.td_device(moved) == moved.device == torch.device("cpu")
    td.batch_size = []
    assert _compat.td_batch_size(td) == td.shape == torch.Size([])


def test_tensordict_entries_are_its_stored_entries() -> None:
    td = TensorDict(
        a=torch.zeros(2), nested=TensorDict(b=torch.ones(2), batch_size=[2]), batch_size=[2]
    )
    entries = _compat.td_entries(td)
    assert set(entries) == {"a", "nested"}
    assert entries["a"] is td.get("a")
    assert isinstance(entries["nested"], TensorDict) and entries["nested"]["b"] is td["nested", "b"]
    td["c"] = torch.ones(2)
    assert "c" in _compat.td_entries(td)  # the live dict, not a copy


def test_tensordict_get_keeps_non_tensor_data_wrapped() -> None:
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    td["label"] = "text"
    assert isinstance(_compat.td_get(td, "label"), NonTensorData)
    assert _compat.td_get(td, "a") is td["a"]


def test_tensordict_names_and_unchecked_construction() -> None:
    td = TensorDict(a=torch.zeros(2, 3), batch_size=[2])
    assert not _compat.td_has_names(td)
    named = td.clone().refine_names("batch")
    assert _compat.td_has_names(named)
    rebuilt = _compat.td_new_unsafe(TensorDict)(
        source={"a": td["a"]}, batch_size=td.batch_size, device=td.device, names=("batch",)
    )
    assert type(rebuilt) is TensorDict and rebuilt.names == ["batch"]
    assert rebuilt["a"] is td["a"] and rebuilt.batch_size == td.batch_size
    # nested=False: the entries as given (a TensorDict entry the same object), in order.
    inner = TensorDict(c=torch.ones(2), batch_size=[2])
    built = _compat.td_new_unsafe(TensorDict)(
        source={"b": td["a"], "inner": inner, "a": td["a"]},
        batch_size=td.batch_size,
        device=None,
        names=None,
        nested=False,
    )
    assert type(built) is TensorDict and list(built.keys()) == ["b", "inner", "a"]
    assert _compat.td_get(built, "inner") is inner and built["b"] is td["a"]
    assert built.batch_size == td.batch_size and built.device is None
    assert not _compat.td_has_names(built)


@tensorclass
class _Sample:
    obs: torch.Tensor
    label: str


def test_tensorclass_parts_round_trip() -> None:
    sample = _Sample(obs=torch.zeros(2, 3), label="x", batch_size=[2])
    td, others = _compat.tensorclass_parts(sample)
    assert isinstance(td, TensorDict) and td["obs"] is sample.obs
    assert isinstance(others, dict)  # fields kept outside the TensorDict (none here)
    # Every field is on one side or the other.
    assert set(td.keys()) | set(others) == {"obs", "label"}
    rebuilt = _compat.tensorclass_new(_Sample, td, others)
    assert type(rebuilt) is _Sample and rebuilt.obs is sample.obs and rebuilt.label == "x"


def test_foreach_copy_and_as_strided() -> None:
    dst, src = [torch.zeros(3)], [torch.arange(3.0)]
    _compat.foreach_copy_(dst, src)
    assert dst[0].tolist() == [0.0, 1.0, 2.0]
    flat = torch.arange(6.0)
    assert _compat.as_strided(flat, (2, 2), (1, 2), 1).tolist() == [[1.0, 3.0], [2.0, 4.0]]


def test_foreach_zero_() -> None:
    tensors = [torch.ones(3), torch.ones(2, 2)]
    _compat.foreach_zero_(tensors)
    assert [t.sum().item() for t in tensors] == [0.0, 0.0]


def test_version_counts_in_place_writes() -> None:
    t = torch.zeros(3)
    before = _compat.version(t)
    t.add_(1)
    assert _compat.version(t) > before
    _ = t + 1  # an out-of-place op leaves it
    assert _compat.version(t) == before + 1


def test_module_hooks_lists_the_registered_kinds() -> None:
    net = torch.nn.Linear(2, 2)
    assert _compat.module_hooks(net) == []
    net.register_forward_pre_hook(lambda module, args: None)
    net.register_forward_hook(lambda module, args, out: None)
    net.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    assert _compat.module_hooks(net) == ["forward pre", "forward", "backward"]
    net.register_full_backward_pre_hook(lambda module, grad_out: None)
    assert _compat.module_hooks(net) == ["forward pre", "forward", "backward pre", "backward"]


def test_the_recorder_sees_operations_and_the_writes_they_declare() -> None:
    # `_emulation.recording` relies on a dispatch mode seeing each ATen operation with its tensors,
    # and on a schema's alias information marking the arguments an operation writes.
    x = torch.ones(3)
    seen = _dispatched(lambda: x.add_(1))
    assert seen == [torch.ops.aten.add_.Tensor]
    written = [
        a.alias_info is not None and a.alias_info.is_write for a in _compat.op_arguments(seen[0])
    ]
    assert written[0] and not any(written[1:])
    with torch.no_grad(), _compat.below_autograd():
        torch.ops.aten.add_.Tensor(x, torch.ones(3))
    assert torch.equal(x, torch.full((3,), 3.0))


def test_default_device_set_sees_both_ways_of_setting_one() -> None:
    # `_emulation.host_calls` treats a factory without `device=` as a CPU tensor only when no
    # default device is set: torch's function mode stack holds a `DeviceContext` while one is.
    assert not _compat.default_device_set()
    with torch.device("cpu"):
        assert _compat.default_device_set()
    torch.set_default_device("cpu")
    try:
        assert _compat.default_device_set()
    finally:
        torch.set_default_device(None)
    assert not _compat.default_device_set()


def test_capturable_on_cpu_outlives_none_of_its_contexts() -> None:
    # Contexts in two threads may close in any order: torch's check comes back once the
    # last one closes, never while one is still open.
    import torch.optim.adam as adam
    import torch.optim.optimizer as optimizer

    original = optimizer._get_capturable_supported_devices
    first, second = _compat.capturable_on_cpu(), _compat.capturable_on_cpu()
    first.__enter__()
    second.__enter__()
    assert "cpu" in adam._get_capturable_supported_devices()
    first.__exit__(None, None, None)  # the first one out, while the other is open
    assert "cpu" in adam._get_capturable_supported_devices()
    second.__exit__(None, None, None)
    assert adam._get_capturable_supported_devices is original
    assert optimizer._get_capturable_supported_devices is original


def test_any_autocast_enabled_sees_every_device_type() -> None:
    assert not _compat.any_autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compat.any_autocast_enabled()
    assert not _compat.any_autocast_enabled()


def test_set_grad_enabled_and_inference_mode_state_set_the_thread_modes() -> None:
    try:
        _compat.set_grad_enabled(False)
        assert not torch.is_grad_enabled()
        _compat.set_grad_enabled(True)
        assert torch.is_grad_enabled()
    finally:
        _compat.set_grad_enabled(True)
    with _compat.inference_mode_state(True):
        assert torch.is_inference_mode_enabled()
        assert torch.ones(1).is_inference()
    with _compat.inference_mode_state(False):
        assert not torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()


def test_capturable_on_cpu_lets_only_its_own_thread_step_on_the_cpu() -> None:
    import threading

    def adam_step() -> None:
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.Adam([w], lr=torch.tensor(0.1), capturable=True)
        w.grad = torch.ones(2)
        opt.step()

    inside, entered, done = [], threading.Event(), threading.Event()

    def holder() -> None:
        with _compat.capturable_on_cpu():
            adam_step()  # allowed here
            inside.append(True)
            entered.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert entered.wait(10)
        with pytest.raises(AssertionError, match="capturable=True"):
            adam_step()  # another thread: torch's refusal, while the context is open
    finally:
        done.set()
        thread.join(10)
    assert inside == [True]


def test_tensordict_set_replaces_an_entry_unchecked() -> None:
    # `_values.tree` sets a TensorDict rebuilt from an entry back in its place.
    td = TensorDict(a=TensorDict(b=torch.zeros(2), batch_size=[2]), batch_size=[2])
    new = TensorDict(b=torch.ones(2), batch_size=[2])
    _compat.td_set(td, "a", new)
    assert _compat.td_entries(td)["a"] is new and td["a", "b"] is new["b"]
    _compat.td_set(td, "c", torch.ones(2))  # a new key, too
    assert set(td.keys()) == {"a", "c"}


def test_module_dicts_are_the_live_dicts_that_assignments_update() -> None:
    # `_state.state` follows a module's state through these dicts: it reads what the module holds
    # now, after `module.name = ...` or `del module.name`, from the dict it listed at capture.
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    children, linear = _compat.module_children(net), net[0]
    parameters, buffers = _compat.module_parameters(linear), _compat.module_buffers(net[1])
    assert list(children) == ["0", "1"] and children["0"] is linear
    assert set(parameters) == {"weight", "bias"} and parameters["weight"] is linear.weight
    assert set(buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    weight, mean, tanh = torch.nn.Parameter(torch.ones(2, 2)), torch.ones(2), torch.nn.Tanh()
    linear.weight, net[1].running_mean, net[0] = weight, mean, tanh
    assert _compat.module_parameters(linear) is parameters and parameters["weight"] is weight
    assert _compat.module_buffers(net[1]) is buffers and buffers["running_mean"] is mean
    assert _compat.module_children(net) is children and children["0"] is tanh
    linear.register_parameter("bias", None)
    assert "bias" in parameters and parameters["bias"] is None  # kept, as None
    del linear.weight
    assert "weight" not in parameters
    net.extra = torch.nn.ReLU()  # a submodule added
    assert list(children) == ["0", "1", "extra"]
    linear.scale = torch.ones(2)  # a plain tensor attribute is in neither dict
    assert "scale" not in parameters and vars(linear)["scale"] is linear.scale


def _dispatched(fn: Any) -> list[Any]:
    """The ATen operations that ``fn`` dispatches, as the emulation's recorder sees them."""
    seen: list[Any] = []

    class Seeing(_compat.TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seeing():
        fn()
    return seen


def test_the_underscored_aten_operations_are_what_public_calls_dispatch() -> None:
    # The recorder refuses these operations by identity: each must be what the public call
    # it stands for dispatches, or the refusal is lost.
    x = torch.arange(6.0)
    a = torch.randn(3, 3)
    spd = a @ a.T + 3 * torch.eye(3)
    assert _compat.aten_local_scalar_dense in _dispatched(lambda: x[1].item())
    assert _compat.aten_unique2 in _dispatched(lambda: torch.unique(x))
    assert _compat.aten_unique is torch.ops.aten._unique.default
    assert _compat.aten_linalg_check_errors in _dispatched(lambda: torch.linalg.cholesky(spd))
    assert _compat.aten_linalg_check_errors in _dispatched(lambda: torch.linalg.inv(spd))
    assert _compat.aten_linalg_eigh in _dispatched(lambda: torch.linalg.eigh(spd))
    assert _compat.aten_linalg_eigh in _dispatched(lambda: torch.linalg.eigvalsh(spd))
    # `_check_indexing` reads an index put's arguments by position.
    names = [argument.name for argument in _compat.op_arguments(_compat.aten_index_put_impl_)]
    assert names[:4] == ["self", "indices", "values", "accumulate"]


def test_a_missing_aten_operation_is_none() -> None:
    assert _compat._aten("no_such_operation_in_aten") is None


_POOL_ID_REFERENCES = """
import sys, torch
from cudagraph_td import _compat

device = torch.device("cuda", torch.cuda.current_device())
pool = torch.cuda.graph_pool_handle()
while pool[1] <= 256:  # past the ints that Python shares and never frees
    pool = torch.cuda.graph_pool_handle()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, pool=pool):
    kept = torch.ones(1 << 20, device=device)
before = sys.getrefcount(pool[1])
for _ in range(20):
    assert _compat.pool_blocks(device, pool) == {kept.data_ptr()}
assert sys.getrefcount(pool[1]) == before, (before, sys.getrefcount(pool[1]))
print("released" if _compat.snapshot_releases_references() else "kept")
"""


@requires_cuda
def test_pool_blocks_leaves_the_pool_id_its_references() -> None:
    # torch 2.11's `memory_snapshot(mempool_id=pool)` releases a reference to each int of the
    # pool id (pytorch/pytorch#196366): past 256, the second was freed by a snapshot (the
    # first, where the pool alone held it) while the pool held it, and the GPU suite crashed
    # later where its memory had gone. In a process of its own: without the fix, this one
    # crashes.
    done = run_python("-c", _POOL_ID_REFERENCES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() in {"released", "kept"}, done.stdout


_RELEASING_BINDING = """
import ctypes, sys, torch
from cudagraph_td import _compat

decref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))
pool = (0, int("301"))  # past the shared small ints; only the pool holds it, as a workspace's
other = (0, int("302"))
segments = [
    {"device": 0, "segment_pool_id": pool, "blocks": [{"address": 4096, "state": "active_allocated"},
                                                      {"address": 8192, "state": "inactive"}]},
    {"device": 0, "segment_pool_id": other, "blocks": [{"address": 16384, "state": "active_allocated"}]},
]

def binding(arg):  # torch 2.11's, played: `memory_snapshot` passes it (pool[0], pool[1], False)
    if RELEASES:
        for item in arg:
            decref(item)
    return {"segments": segments}

torch._C._cuda_memorySnapshot = binding
before = sys.getrefcount(pool[1])
for _ in range(20):
    assert _compat.pool_blocks(torch.device("cuda", 0), pool) == {4096}
after = sys.getrefcount(pool[1])
assert after == before, (before, after)
assert _compat.snapshot_releases_references() is RELEASES
print("ok")
"""


@pytest.mark.parametrize("releases", [True, False], ids=["torch-2.11-binding", "fixed-binding"])
def test_pool_blocks_gives_what_the_snapshot_binding_releases(releases: bool) -> None:
    # The binding's fault, played on any machine, under torch's own `memory_snapshot`: the
    # pool id's int, held by the pool alone, must outlive every snapshot. In a process of its
    # own: a reference given too late frees the int, and the process crashes.
    done = run_python("-c", f"RELEASES = {releases}\n" + _RELEASING_BINDING)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch")
def test_the_cuda_bindings_exist_in_a_cuda_build() -> None:
    # Each is looked up with a default (a CPU build has none): gone from a CUDA build, the
    # library would lose its use silently.
    assert _compat.raw_stream is not None
    assert callable(torch._C._cuda_clearCublasWorkspaces)
    assert callable(torch._C._cuda_endAllocateToPool)


def test_memory_snapshot_takes_a_pool() -> None:
    import inspect

    assert {"mempool_id", "include_traces"} <= set(
        inspect.signature(torch.cuda.memory_snapshot).parameters
    )


_END_ALLOCATE = """
import torch
from cudagraph_td import _compat

device = torch.device("cuda", torch.cuda.current_device())
pool = torch.cuda.graph_pool_handle()
side = torch.cuda.Stream()
torch.cuda.synchronize()


def capture(pool, broken):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool)
        x = torch.ones(1 << 10, device=device)
        if broken:
            try:
                x.sum().item()  # refused, and the capture with it
            except RuntimeError:
                pass
        graph.capture_end()
    return graph, x


try:
    capture(pool, broken=True)
except RuntimeError:
    pass
else:
    raise SystemExit("ending the broken capture did not raise")
assert not torch.cuda.is_current_stream_capturing()
# torch left the pool registered as captured into (else this raises), and this ends it.
_compat.end_allocate_to_pool(device, pool)
try:
    torch._C._cuda_endAllocateToPool(device.index, pool)
except RuntimeError as err:
    assert "not currently recording" in str(err), err
else:
    raise SystemExit("end_allocate_to_pool did not end it")
graph, x = capture(torch.cuda.graph_pool_handle(), broken=False)  # in a new pool
graph.replay()
torch.cuda.synchronize()
assert x.sum().item() == 1 << 10
print("ok")
"""


@requires_cuda
def test_end_allocate_to_pool_ends_what_a_failed_capture_left() -> None:
    # In a process of its own, as the failed capture may leave state behind.
    done = run_python("-c", _END_ALLOCATE)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_cuda_build_can_lend_output_memory() -> None:
    # Looked up with a default (a CPU build has only the first): gone from a CUDA build,
    # outputs="borrowed" would fall back to fresh outputs, with a warning.
    assert callable(_compat.storage_over)
    if torch.cuda.is_available():
        assert _compat.CAN_BORROW


@requires_cuda
def test_a_lent_storage_made_unreadable_stops_every_view_of_it() -> None:
    static = torch.arange(12.0, device="cuda").reshape(4, 3)
    storage = static.untyped_storage()
    lent_storage = _compat.storage_over(storage.data_ptr(), static.device, storage.nbytes())
    layout = {
        "size": static.shape,
        "stride": static.stride(),
        "dtype": static.dtype,
        "device": static.device,
        "storage_offset": 0,
    }
    lent = _compat.cuda_tensor_over(layout, lent_storage)
    assert lent.data_ptr() == static.data_ptr()
    torch.testing.assert_close(lent, static)
    view = lent[1:, :2]
    _compat.forbid_access(lent_storage, "lent memory overwritten")
    for use in (lambda: view.sum(), lambda: lent + 1, lambda: lent.cpu(), lambda: view.clone()):
        with pytest.raises(RuntimeError, match="lent memory overwritten"):
            use()
    # The memory itself, and the tensors that own it, stay readable.
    torch.testing.assert_close(static.sum().cpu(), torch.tensor(66.0))


def test_no_subclass_functions_runs_torch_functions_of_a_subclass_as_torch_s() -> None:
    seen = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            seen.append(func)
            with _compat.no_subclass_functions():
                return func(*args, **(kwargs or {}))

    t = torch.ones(2).as_subclass(Sub)
    out = t + 1
    assert type(out) is torch.Tensor and len(seen) == 1


def test_a_memoryless_wrapper_subclass_storage_raises_the_matched_message() -> None:
    # `_values.storages.readable` tells a wrapper subclass's own storage (no memory) from a
    # lent one made unreadable by the words of torch's error, `_compat.NO_MEMORY`.
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, payload: torch.Tensor) -> Wrapper:
            return torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=payload.dtype)

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise NotImplementedError

    wrapped = Wrapper(torch.zeros(3))
    with pytest.raises(RuntimeError, match=_compat.NO_MEMORY):
        torch.Tensor.untyped_storage(wrapped).data_ptr()


class _Graph:
    """A stand-in for ``torch.cuda.CUDAGraph`` whose ``capture_end`` raises ``error``."""

    def __init__(self, error: BaseException | None):
        self.error = error

    def capture_end(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("torch_ended_it", [False, True], ids=["routing left", "routing ended"])
def test_a_broken_capture_keeps_its_graph_where_torch_left_its_routing(
    monkeypatch: pytest.MonkeyPatch, torch_ended_it: bool
) -> None:
    # The rule of `end_failed_capture`, on the CPU with stand-ins for torch's calls (CUDA
    # runs it for real: tests/test_capture.py): a capture whose end raises keeps its graph
    # where the allocator's routing was still there to end, and only there; the generator's
    # mark is cleared either way.
    ended: list[Any] = []

    def end_allocate_to_pool(device: torch.device, pool: Any) -> None:
        if torch_ended_it:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        ended.append(pool)

    cleared: list[torch.device] = []
    monkeypatch.setattr(_compat, "end_allocate_to_pool", end_allocate_to_pool)
    monkeypatch.setattr(_compat, "one_node_graph", cleared.append)
    monkeypatch.setattr(_compat, "BROKEN_CAPTURES", [])
    broken = _Graph(RuntimeError("operation not permitted when stream is capturing"))
    device = torch.device("cuda", 0)
    _compat.end_failed_capture(broken, device, "pool")  # type: ignore[arg-type]
    kept: list[Any] = _compat.BROKEN_CAPTURES
    assert kept == ([] if torch_ended_it else [broken])
    assert ended == ([] if torch_ended_it else ["pool"])
    assert cleared == [device]
    # A capture that ends (an error before its first kernel): nothing to undo, nothing kept.
    _compat.end_failed_capture(_Graph(None), device, "pool")  # type: ignore[arg-type]
    assert len(kept) == (0 if torch_ended_it else 1)
    assert cleared == [device]
