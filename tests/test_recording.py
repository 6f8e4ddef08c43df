"""What a capture may do with CPU tensors: the pairs of the refusals in test_capture.py.

A CUDA capture records no CPU work, but it allows it: CPU tensors that the function makes
may be read on the host and used as numbers. The emulation, where every tensor is on the
CPU, must not refuse them either.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from .conftest import Backend


def _zero_the_positives(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y > 0] = 0.0  # one value: a `masked_fill_` on CUDA, which reads no count of values
    return y


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
