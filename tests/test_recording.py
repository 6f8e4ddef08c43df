"""What a capture allows: the pairs of the refusals in test_capture.py.

A CUDA capture records no CPU work, but it allows it: CPU tensors that the function makes
may be read on the host and used as numbers, Python numbers assigned where CUDA fills with
them. The emulation, where every tensor is on the CPU, must not refuse them, nor freeze the
graph's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from .conftest import Backend


def _zero_the_positives(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 0] = 0.0  # one value: a `masked_fill_` on CUDA, which reads no count of values
    return y


def _assign_numbers(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[0] = 1.0  # a row: CUDA fills it with the number (`fill_`), no copy
    y[:, 1] = 0.0
    return y


def _assign_into_a_cpu_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = torch.zeros(2)
    scale[0] = 3.0  # CPU work, frozen at the capture
    return x * scale.sum()


def _vmapped(x: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(2.0)  # a CPU tensor, made before `vmap`'s batched tensors
    return torch.vmap(lambda row: row.sin() * 2)(x) * scale


CPU_WORK: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cpu-scalar-operand": lambda x: x * torch.tensor(2.0),
    "host-read-of-a-cpu-tensor": lambda x: x * len(torch.arange(3).tolist()),
    "item-of-a-cpu-tensor": lambda x: x * torch.tensor(3.0).item(),
    "print-of-a-cpu-tensor": lambda x: x * (print(torch.arange(2)) or 2),
    "dtype-cast-of-a-cpu-scalar": lambda x: x * torch.tensor(2).to(torch.float32),
    "factory-on-the-device": lambda x: x + torch.ones(x.shape, device=x.device),
    "vmap": _vmapped,
    "boolean-mask-assignment-of-a-number": _zero_the_positives,
    "boolean-mask-fill": lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
    "number-assigned-to-a-row": _assign_numbers,
    "number-assigned-into-a-cpu-tensor": _assign_into_a_cpu_tensor,
    "graph-tensor-through-as-tensor": lambda x: torch.as_tensor(x) * 2 + torch.asarray(x),
    "equal-of-a-tensor-and-itself": lambda x: x * torch.equal(x, x),
    "python-list-index-of-a-cpu-tensor": lambda x: x * torch.arange(4.0)[[1, 3]].sum(),
    "tuple-of-basic-indices": lambda x: x[(slice(None), 1)] * 2,
    "one-hot-with-its-number-of-classes": lambda x: F.one_hot((x[:, :2] > 0).long().sum(-1), 3) * x,
    "masked-fill-with-a-cpu-value": lambda x: x.masked_fill(x > 0, torch.tensor(2.0)),
    "nonzero-of-a-static-size": lambda x: torch.nonzero_static(x > 0, size=6) * x.sum(),
    "histc-with-its-range": lambda x: torch.histc(x, bins=4, min=-3.0, max=3.0),
    "repeat-interleave-with-its-size": lambda x: x.repeat_interleave(
        torch.full((4,), 2, device=x.device), dim=0, output_size=8
    ),
}


@pytest.mark.parametrize("case", list(CPU_WORK))
def test_cpu_work_in_the_function_is_captured(backend: Backend, case: str) -> None:
    fn = CPU_WORK[case]
    graphed = backend.wrap(fn, warmup=2)
    for _ in range(4):  # a warm-up, the capture, two replays
        x = backend.randn(4, 3)
        torch.testing.assert_close(graphed(x), fn(x))
    assert graphed.is_captured


def test_a_tensor_made_into_a_device_buffer_is_not_a_cpu_tensor(backend: Backend) -> None:
    buffer = torch.empty(4, 3, device=backend.device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ones(4, 3, out=buffer) + x  # `out=`: on the buffer's device

    graphed = backend.wrap(fn, warmup=1)
    for _ in range(3):
        x = backend.randn(4, 3)
        torch.testing.assert_close(graphed(x), x + 1)


def test_factories_follow_a_default_device_set_by_the_caller(backend: Backend) -> None:
    # Under `torch.set_default_device(device)` or `with torch.device(device):`, a factory
    # without `device=` makes its tensor on the graph's device, not on the CPU.
    graphed = backend.wrap(lambda x: x + torch.ones(3) * torch.arange(3), warmup=2)
    with torch.device(backend.device):
        for _ in range(4):
            x = backend.randn(3)
            torch.testing.assert_close(graphed(x), x + torch.arange(3.0, device=x.device))
    assert graphed.is_captured
