"""Warm-up and capture: failures are explained, the context is left clean, the wrapper recovers."""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cudagraph_td import CudaGraphModule, _compat

from .conftest import Backend, current_entry, requires_cuda


class Flaky:
    """A function that raises while ``broken`` is set, with ``fail`` as the failing statement."""

    def __init__(self, fail: Callable[[torch.Tensor], Any]):
        self.fail = fail
        self.broken = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if self.broken:
            self.fail(y)
        return y + 1


def _raise_value_error(y: torch.Tensor) -> None:
    raise ValueError("bad value in the user's code")


def _answered_while_recording() -> tuple[Any, ...]:
    """torch's own functions, which the emulation's recording answers for on its thread."""
    cuda = torch.cuda
    return (
        cuda.is_available,
        cuda.is_current_stream_capturing,
        cuda.synchronize,
        cuda.current_stream,
        cuda.default_stream,
        cuda.Event,
        torch.serialization.location_tag,
    )


_TORCH_CUDA = _answered_while_recording()


def _assert_not_capturing(backend: Backend) -> None:
    assert _answered_while_recording() == _TORCH_CUDA  # the recording ended, failed or not
    if backend.name == "cuda":
        assert not torch.cuda.is_current_stream_capturing()
        torch.cuda.synchronize()  # no sticky error left behind


@pytest.mark.parametrize("warmup", [1, 2], ids=["at-capture", "at-warm-up"])
def test_user_exception_is_explained_and_chained(backend: Backend, warmup: int) -> None:
    fn = Flaky(_raise_value_error)
    graphed = backend.wrap(fn, warmup=warmup)
    x = backend.randn(3)
    stage = "run the capturing call" if warmup == 1 else "run warm-up call 1 of 1"
    with pytest.raises(RuntimeError, match=re.escape(f"CudaGraphModule could not {stage}")) as info:
        graphed(x)
    assert isinstance(info.value.__cause__, ValueError)
    assert "the function itself raised ValueError" in str(info.value)
    assert "bad value in the user's code" in str(info.value)
    _assert_not_capturing(backend)
    assert not graphed.is_captured
    fn.broken = False  # the cause removed, the next calls warm up, capture and replay
    for _ in range(warmup + 2):
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), x * 2 + 1)
    assert graphed.is_captured


def test_reset_after_a_failed_capture(backend: Backend) -> None:
    fn = Flaky(_raise_value_error)
    graphed = backend.wrap(fn, warmup=1)
    with pytest.raises(RuntimeError):
        graphed(backend.randn(3))
    fn.broken = False
    graphed.reset()
    x = backend.randn(3)
    torch.testing.assert_close(graphed(x), x * 2 + 1)
    torch.testing.assert_close(graphed(x), x * 2 + 1)


FLAG = True
SCALE = 2.0


def test_python_values_are_frozen_at_the_capture(backend: Backend) -> None:
    # A replay runs no Python, on CUDA as on the emulation: globals read at the capture keep
    # their captured values (see the sharp edges).
    global FLAG, SCALE
    FLAG, SCALE = True, 2.0
    graphed = backend.wrap(lambda x: x * SCALE if FLAG else x * 3, warmup=1)
    graphed(backend.randn(2))
    FLAG, SCALE = False, 5.0
    try:
        x = backend.randn(2)
        torch.testing.assert_close(graphed(x), x * 2)
    finally:
        FLAG, SCALE = True, 2.0


def test_random_operations_draw_new_numbers_at_each_replay(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x + torch.randn_like(x), warmup=1)
    x = backend.randn(64)
    draws = [graphed(x) - x for _ in range(4)]  # the capture's, then three replays'
    for i in range(1, 4):
        assert not torch.equal(draws[i], draws[i - 1])
        assert draws[i].std() > 0.5  # standard normal draws, not a constant


def _noise(backend: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x + torch.randn_like(x)


def _dropout(backend: Backend) -> Callable[[torch.Tensor], torch.Tensor]:
    # Captured for autograd (a parameter, grad mode): forward and backward graphs.
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)).to(backend.device)


@pytest.mark.parametrize("make", [_noise, _dropout], ids=["randn_like", "dropout-autograd"])
def test_a_graphed_run_draws_the_numbers_of_an_eager_run_seeded_alike(
    backend: Backend, make: Callable[[Backend], Callable[[torch.Tensor], torch.Tensor]]
) -> None:
    # A capture draws no numbers (each replay takes the graph's offset into the generator):
    # seeded alike, the graphed calls and the eager draws after them are an eager run's, as
    # LeanRL's scripts, seeded once, assume. The emulated capture drew a call's numbers.
    fn = make(backend)
    x = backend.randn(64)

    def run(f: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        draws = [f(x) for _ in range(5)]
        return [d.detach() for d in draws] + [torch.randn(3, device=backend.device)]

    torch.testing.assert_close(run(backend.wrap(fn, warmup=2)), run(fn))


def test_cpu_values_made_in_the_function_are_frozen_at_the_capture(backend: Backend) -> None:
    # CPU tensors are numbers to a CUDA kernel: their values at the capture are recorded,
    # not the CPU work that made them (the emulation leaves it out too).
    graphed = backend.wrap(lambda x: x * torch.tensor(2.0) + torch.rand(()), warmup=1)
    x = backend.randn(8)
    graphed(x)  # the capturing call: its result is an eager run's, the capture draws again
    noise = graphed(x) - x * 2  # the capture's draw, replayed
    for _ in range(3):
        x = backend.randn(8)
        torch.testing.assert_close(graphed(x), x * 2 + noise)


def test_cpu_state_made_in_a_warm_up_is_frozen_at_the_capture(backend: Backend) -> None:
    # State that the function makes on its first call without `device=` (a counter here) is
    # on the CPU in a GPU run too: the capture runs the CPU work on it once, and its replays
    # use the value it had then.
    state: dict[str, torch.Tensor] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        if "count" not in state:
            state["count"] = torch.zeros(())
        state["count"] += 1
        return x * state["count"]

    graphed = backend.wrap(fn, warmup=2)
    x = backend.randn(3)
    torch.testing.assert_close(graphed(x), x)  # the warm-up: count 1
    torch.testing.assert_close(graphed(x), x * 2)  # the capturing call's eager run: count 2
    for _ in range(3):  # the capture counted once more; the replays do not count
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), x * 3)
    assert state["count"].device.type == "cpu"
    assert state["count"].item() == 3
    state["count"].fill_(10.0)  # a number to the captured kernel: its value at the capture
    torch.testing.assert_close(graphed(x), x * 3)


CPU_TENSORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "added": lambda x: x + torch.ones(3),
    # A CPU scalar is a number to an elementwise operation, not to a concatenation.
    "stacked-cpu-scalar": lambda x: torch.stack([x.sum(), torch.tensor(0.0)]),
    "concatenated": lambda x: torch.cat([x, torch.zeros(1)]),
}


@pytest.mark.parametrize("case", list(CPU_TENSORS))
def test_a_cpu_tensor_made_in_the_function_fails_at_the_capture(
    backend: Backend, case: str
) -> None:
    # `torch.ones(3)` is on the CPU in a GPU run: CUDA refuses to add it to a device tensor
    # (in the capturing call's eager run), the emulation at its recording.
    graphed = backend.wrap(CPU_TENSORS[case], warmup=1)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as info:
        graphed(backend.randn(3))
    assert "make it on their device (`torch.ones(3, device=x.device)`)" in str(info.value)
    _assert_not_capturing(backend)


def test_a_branch_on_a_tensor_value_fails_at_the_capture(backend: Backend) -> None:
    graphed = backend.wrap(lambda x: x * 2 if x.sum() > 0 else x * 3, warmup=1)
    with pytest.raises(RuntimeError, match="synchronises the host"):
        graphed(backend.randn(2).abs())


@requires_cuda
def test_a_broken_capture_keeps_its_graph_where_torch_left_its_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host sync broke the capture. Where torch left the allocators' routing of it (2.11),
    # the pinned-memory allocator's stays, and asks the graph, under every later capture,
    # whether that capture is its own: the library keeps the graph, never a dangling pointer
    # there. Where torch ended its routings itself, nothing is kept.
    ended_here = []
    end = _compat.end_allocate_to_pool

    def recording(device: torch.device, pool: Any) -> None:
        end(device, pool)  # raises where torch ended it
        ended_here.append(pool)

    monkeypatch.setattr(_compat, "end_allocate_to_pool", recording)
    before = list(_compat.BROKEN_CAPTURES)
    graphed = CudaGraphModule(lambda x: x * 2 if x.sum() > 0 else x * 3, warmup=1)
    with pytest.raises(RuntimeError, match="synchronises the host"):
        graphed(torch.rand(2, device="cuda"))
    assert _compat.BROKEN_CAPTURES[: len(before)] == before  # the same graphs, kept
    assert len(_compat.BROKEN_CAPTURES) == len(before) + len(ended_here)
    # A later capture that pins memory (`.item()` pins its scalar) is refused as ever.
    item = CudaGraphModule(lambda x: x * x.sum().item(), warmup=1)
    with pytest.raises(RuntimeError, match="synchronises the host"):
        item(torch.rand(2, device="cuda"))


# What a CUDA capture cannot record: each case raises inside the capture.
HOST_SYNCS: dict[str, Callable[[torch.Tensor], Any]] = {
    "item": lambda y: y.sum().item(),
    "print": lambda y: print(y),
    "tolist": lambda y: y.tolist(),
    # As device-agnostic code does it (a capture says CUDA is available, on the emulation too).
    "synchronize": lambda y: torch.cuda.is_available() and torch.cuda.synchronize(),
    "nonzero": lambda y: y.nonzero(),
    "boolean-mask": lambda y: y[y > 0],
    "boolean-mask-assignment": lambda y: y.clone().__setitem__(y.abs() + 1 > 0, y * 2),
    "bincount": lambda y: torch.bincount((y > 0).long()),
    "repeat-interleave": lambda y: y.repeat_interleave(torch.ones_like(y, dtype=torch.long)),
    "python-data-to-cuda": lambda y: torch.tensor([1.0, 2.0], device=y.device),
    "python-scalar-to-cuda": lambda y: torch.tensor(2.0, device=y.device),
    "copy-to-cpu": lambda y: y.cpu(),
    "copy-into-cpu-tensor": lambda y: torch.zeros(3).copy_(y),
    "cpu-tensor-to-cuda": lambda y: y + torch.ones(3).to(y.device),
    "cpu-index-tensor": lambda y: y[torch.tensor([0, 2])],
    "python-list-index": lambda y: y[[0, 2]],  # made into an index tensor on y's device
    # A Python number assigned by indexing is a CPU tensor (of `y`'s dtype) on CUDA too: a
    # copy into one element, or at tensor indices (a boolean mask makes a `masked_fill_`).
    "number-assigned-to-one-element": lambda y: y.clone().__setitem__(0, 1.0),
    "number-assigned-at-tensor-indices": lambda y: y.clone().__setitem__(
        torch.arange(2, device=y.device), 1.0
    ),
    "device-value-assigned-by-mask": lambda y: y.clone().__setitem__(y > 0, y.sum()),
    "tensor-of-device-values": lambda y: torch.tensor([y.sum(), y.mean()]),
    "new-tensor-of-python-data": lambda y: y.new_tensor([1.0, 2.0, 3.0]),
    "factory-filled-with-a-device-value": lambda y: torch.full((3,), y.sum()),
    "equal": lambda y: torch.equal(y, y * 2),
    "allclose": lambda y: torch.allclose(y, y * 2),
    # CUDA kernels that read a value on the host (torch 2.11): a 0-dim value tensor of the
    # graph given to `masked_fill` or `index_fill`, the range of `histc` (by default), the
    # error codes of `torch.linalg`'s checked routines, the number of classes of `one_hot`.
    "device-value-of-masked-fill": lambda y: y.masked_fill(y > 0, y.sum()),
    "device-value-of-index-fill": lambda y: y.index_fill(
        0, torch.zeros(1, dtype=torch.long, device=y.device), y.sum()
    ),
    "histc-range-read-from-the-values": lambda y: torch.histc(y, bins=4),
    "linalg-error-check": lambda y: torch.linalg.cholesky(
        torch.outer(y, y) + torch.eye(3, device=y.device)
    ),
    "one-hot-classes-read-from-the-values": lambda y: F.one_hot((y > 0).long()),
    # A decomposition whose CUDA solver reads on the host (torch 2.11, seen on the H100).
    "linalg-eigh": lambda y: torch.linalg.eigh(torch.outer(y, y) + torch.eye(3, device=y.device)),
    # torch.normal's check that a tensor of standard deviations is >= 0 (torch 2.11, seen on
    # the H100 through torch.distributions.Normal.sample in torchrl's CrossQ).
    "normal-with-a-tensor-std": lambda y: torch.normal(y, y.abs() + 1),
    "distribution-sample": lambda y: torch.distributions.Normal(y, y.abs() + 1).sample(),
    # torch.save copies a CUDA storage to pageable host memory before it writes it.
    "torch-save": lambda y: torch.save(y, io.BytesIO()),
    # Synchronisations and queries of the capturing stream, and of an event recorded on it
    # (as tensordict waits for its copies to the host); an event never recorded is no CUDA
    # event yet, and its `synchronize()` does nothing, on CUDA as on the emulation.
    "stream-synchronize": lambda y: (
        torch.cuda.is_available() and torch.cuda.current_stream().synchronize()
    ),
    "stream-query": lambda y: torch.cuda.is_available() and torch.cuda.current_stream().query(),
    "event-synchronize": lambda y: torch.cuda.is_available() and _recorded_event().synchronize(),
    "event-query": lambda y: torch.cuda.is_available() and _recorded_event().query(),
}


def _recorded_event() -> Any:
    event = torch.cuda.Event()
    event.record()
    return event


@pytest.mark.parametrize("case", list(HOST_SYNCS))
def test_capture_failure_is_explained_and_leaves_a_clean_context(
    backend: Backend, case: str
) -> None:
    fn = Flaky(HOST_SYNCS[case])
    graphed = backend.wrap(fn, warmup=2)
    graphed(backend.randn(3))  # the eager warm-up runs the host sync without trouble
    with pytest.raises(
        RuntimeError, match=re.escape("CudaGraphModule could not capture the graph")
    ) as info:
        graphed(backend.randn(3))
    message = str(info.value)
    assert info.value.__cause__ is not None
    # Said of a CUDA capture only; the emulation has no CUDA context.
    assert ("The CUDA context was left out of capture mode" in message) is (backend.name == "cuda")
    assert message.index("could not capture the graph at tests/test_capture.py:") == 16
    if case != "synchronize":
        assert "synchronises the host" in message or "broke the capture" in message, message
    _assert_not_capturing(backend)
    if backend.name == "cuda":  # other CUDA work still runs
        torch.testing.assert_close(torch.ones(2, device="cuda").sum().cpu(), torch.tensor(2.0))
    fn.broken = False  # the wrapper captures once the cause is removed
    for _ in range(3):
        x = backend.randn(3)
        torch.testing.assert_close(graphed(x), x * 2 + 1)
    assert graphed.is_captured


def test_linalg_works_after_a_failed_capture_of_eigh(backend: Backend) -> None:
    # On CUDA, eigh's solver fails the capture with a cuSOLVER error that cuSOLVER reports
    # again at its next call: the user's next decomposition, outside any graph, must work.
    def spectrum(y: torch.Tensor) -> torch.Tensor:
        return torch.linalg.eigvalsh(torch.outer(y, y) + torch.eye(3, device=y.device))

    graphed = backend.wrap(spectrum, warmup=2)
    graphed(backend.randn(3))
    with pytest.raises(RuntimeError, match=r"could not capture the graph at .*: the function"):
        graphed(backend.randn(3))
    a = torch.outer(*[backend.randn(3)] * 2) + torch.eye(3, device=backend.device)
    q, r = torch.linalg.qr(a)
    torch.testing.assert_close(q @ r, a)
    # qr itself captures, and its replays follow their inputs.
    qr = backend.wrap(lambda m: torch.linalg.qr(m)[1].abs(), warmup=2)
    for _ in range(3):
        m = torch.outer(*[backend.randn(3)] * 2) + torch.eye(3, device=backend.device)
        torch.testing.assert_close(qr(m), torch.linalg.qr(m)[1].abs())


def test_a_generator_of_the_functions_own_fails_the_capture(backend: Backend) -> None:
    # A capture gives its graph an offset into the default generator only: torch refuses to
    # advance another one while capturing (its replays would draw the same numbers).
    generator = torch.Generator(device=backend.device)
    noise = {"generator": generator}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn(x.shape, device=x.device, **noise)

    graphed = backend.wrap(fn, warmup=2)
    graphed(backend.randn(3))
    with pytest.raises(RuntimeError, match=re.escape("could not capture")) as info:
        graphed(backend.randn(3))
    assert "draws random numbers from a `torch.Generator` of its own" in str(info.value)
    _assert_not_capturing(backend)
    noise.clear()  # the default generator: new numbers at each replay
    x = backend.randn(3)
    first, second = graphed(x), graphed(x)
    assert not torch.equal(first, second)


def test_cpu_output_is_refused_on_cuda(cuda: Backend) -> None:
    graphed = cuda.wrap(lambda x: (x * 2, torch.zeros(2)), warmup=1)
    with pytest.raises(RuntimeError, match=re.escape("(output[1] is on cpu)")):
        graphed(cuda.randn(3))
    _assert_not_capturing(cuda)


def test_replay_does_not_synchronize_the_host(cuda: Backend) -> None:
    graphed = cuda.wrap(lambda x, td: {"y": x.exp(), "z": td["a"] * 2}, warmup=2)
    from tensordict import TensorDict

    def inputs() -> tuple[torch.Tensor, TensorDict]:
        return cuda.randn(64), TensorDict(a=cuda.randn(8, 2), batch_size=[8])

    for _ in range(3):
        graphed(*inputs())
    x, td = inputs()
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "a prototype feature"
            torch.cuda.set_sync_debug_mode("error")
        for _ in range(5):
            out = graphed(x, td)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out["y"], x.exp())


def test_outputs_are_ordered_on_the_callers_stream(cuda: Backend) -> None:
    graphed = cuda.wrap(lambda x: x @ x, warmup=2)
    stream = torch.cuda.Stream()
    x = cuda.randn(256, 256)
    for _ in range(3):
        graphed(x)
    with torch.cuda.stream(stream):
        y = cuda.randn(256, 256)  # produced on the side stream, consumed there too
        out = graphed(y)
        expected = y @ y
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)


def test_shared_pool_and_capture_error_mode(cuda: Backend) -> None:
    pool = torch.cuda.graph_pool_handle()
    first = cuda.wrap(lambda x: x + 1, warmup=1, pool=pool)
    second = cuda.wrap(lambda x: x * 3, warmup=1, pool=pool, capture_error_mode="thread_local")
    x = cuda.randn(4)
    a1, b1 = first(x), second(x)
    a2, b2 = first(x), second(x)
    for a, b in ((a1, b1), (a2, b2)):
        torch.testing.assert_close(a, x + 1)
        torch.testing.assert_close(b, x * 3)


def test_graph_device_follows_the_inputs(cuda: Backend) -> None:
    graphed = cuda.wrap(lambda x: x + 1, warmup=1)
    graphed(cuda.randn(2))
    entry = current_entry(graphed)
    assert entry.backend is not None and entry.backend.device == cuda.device


def test_graph_survives_cleared_cublas_workspaces(cuda: Backend) -> None:
    # torch.compile's CUDA graph trees clear cuBLAS workspaces around each recording. A graph
    # whose matrix products used a workspace made outside its pool (during the warm-up) would
    # then write into memory that other tensors reuse.
    net = torch.nn.Sequential(
        torch.nn.Linear(17, 256), torch.nn.Tanh(), torch.nn.Linear(256, 6)
    ).cuda()
    graphed = cuda.wrap(net, warmup=2)
    with torch.no_grad():
        for _ in range(3):
            graphed(cuda.randn(32, 17))
        torch._C._cuda_clearCublasWorkspaces()
        fillers = [torch.full((n << 20,), float("nan"), device="cuda") for n in (1, 2, 4, 8, 16)]
        for _ in range(3):
            x = cuda.randn(32, 17)
            torch.testing.assert_close(graphed(x), net(x))
    cuda.sync()
    assert all(bool(f.isnan().all()) for f in fillers), "a replay wrote into reused memory"


@pytest.mark.filterwarnings("ignore::UserWarning:torch", "ignore::DeprecationWarning:torch")
def test_graph_next_to_torch_compile_cuda_graph_trees(cuda: Backend) -> None:
    # The case that crashed: a CudaGraphModule policy and a model compiled with
    # mode="reduce-overhead" (CUDA graph trees) replayed in turns in one process.
    torch._dynamo.reset()
    net = torch.nn.Sequential(
        torch.nn.Linear(17, 256), torch.nn.Tanh(), torch.nn.Linear(256, 6)
    ).cuda()
    compiled = torch.compile(copy.deepcopy(net), mode="reduce-overhead")
    graphed = cuda.wrap(net, warmup=2)
    with torch.no_grad():
        for _ in range(3):  # captured before the compiled model records its graphs
            graphed(cuda.randn(32, 17))
        for _ in range(20):
            x = cuda.randn(32, 17)
            torch.compiler.cudagraph_mark_step_begin()
            expected = compiled(x).clone()
            torch.testing.assert_close(graphed(x), expected)


def test_garbage_collection_is_held_off_during_capture(cuda: Backend) -> None:
    # A collection during a capture may free tensors of other streams, which is illegal
    # while a stream captures (pytorch#161037): the wrapper holds it off, and restores it,
    # after a capture that failed too.
    import gc

    seen: list[bool] = []
    fail = {"now": True}

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        if fail["now"] and torch.cuda.is_current_stream_capturing():
            raise ValueError("fails while recording")
        return x * 2

    graphed = cuda.wrap(fn, warmup=2)
    x = cuda.randn(3)
    graphed(x)  # warm-up
    with pytest.raises(RuntimeError):
        graphed(x)  # the eager run of the capturing call, then the failed recording
    assert seen == [True, True, False] and gc.isenabled()
    fail["now"] = False
    torch.testing.assert_close(graphed(x), x * 2)
    assert seen[3:] == [True, False] and gc.isenabled()
    torch.testing.assert_close(graphed(x), x * 2)
    assert len(seen) == 5  # the replay runs no Python
