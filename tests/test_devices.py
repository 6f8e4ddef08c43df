"""Graphs per device: a wrapper follows its inputs to another GPU, or says why it cannot."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from cudagraph_td import CudaGraphModule, InputMismatchError

two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (run scripts/gpu_check.sh on a machine with two)",
)
pytestmark = two_gpus

D0, D1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_a_function_follows_its_inputs_to_another_device() -> None:
    graphed = CudaGraphModule(lambda x, y: (x * 2 + y, x.sum()), warmup=2)
    results = []
    for _ in range(4):  # each device: a warm-up, a capture, then replays, calls interleaved
        for device in (D0, D1):
            x, y = torch.randn(8, device=device), torch.randn(8, device=device)
            results.append(((x, y), graphed(x, y)))
    for (x, y), (a, b) in results:  # every result its own memory, on its inputs' device
        assert a.device == x.device and b.device == x.device
        torch.testing.assert_close(a, x * 2 + y)
        torch.testing.assert_close(b, x.sum())
    infos = graphed.graphs()
    assert [(info.mode, info.captured) for info in infos] == [
        ("grad, cuda:0", True),
        ("grad, cuda:1", True),
    ]
    assert all(info.replays == 2 for info in infos)


def test_a_module_on_another_device_than_the_current_one() -> None:
    # Capture and replay run on the module's device and that device's current stream,
    # whichever device is current.
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).to(D1)
    graphed = CudaGraphModule(net, warmup=2)
    stream = torch.cuda.Stream(D1)
    with torch.cuda.device(D0), torch.no_grad():
        for _ in range(4):
            x = torch.randn(5, 6, device=D1)
            with torch.cuda.stream(stream):
                out = graphed(x)
            stream.synchronize()
            torch.testing.assert_close(out, net(x))
    (info,) = graphed.graphs()
    assert info.captured and info.replays == 2


def test_a_module_that_cannot_follow_raises_naming_the_input_and_the_parameter() -> None:
    net = nn.Linear(4, 2).to(D0)
    graphed = CudaGraphModule(net, warmup=1)
    with torch.no_grad():
        graphed(torch.randn(3, 4, device=D0))
        message = (
            "CudaGraphModule has graphs on cuda:0, and received args[0] on cuda:1: a graph there "
            "would read `module.weight`, which is on cuda:0. Move the inputs with "
            "`.to('cuda:0')`, or the module and its optimizer to cuda:1"
        )
        with pytest.raises(InputMismatchError, match=re.escape(message)) as info:
            graphed(torch.randn(3, 4, device=D1))
        assert (info.value.path, info.value.captured, info.value.received) == ("args[0]", D0, D1)
        x = torch.randn(3, 4, device=D0)  # the wrapper is still usable on its device
        torch.testing.assert_close(graphed(x), net(x))


def test_a_module_moved_to_another_device_is_followed() -> None:
    net = nn.Linear(4, 2).to(D0)
    graphed = CudaGraphModule(net, warmup=1)
    with torch.no_grad():
        graphed(torch.randn(3, 4, device=D0))
        net.to(D1)
        for _ in range(3):
            x = torch.randn(3, 4, device=D1)
            torch.testing.assert_close(graphed(x), net(x))
    assert [(info.mode, info.captured) for info in graphed.graphs()] == [
        ("no_grad, train, cuda:0", True),
        ("no_grad, train, cuda:1", True),
    ]


def test_a_wrapper_given_a_device_does_not_follow() -> None:
    graphed = CudaGraphModule(lambda x: x + 1, warmup=1, device="cuda:0")
    graphed(torch.randn(2, device=D0))
    with pytest.raises(
        ValueError, match=re.escape("on device cuda:0, but received it on device cuda:1")
    ):
        graphed(torch.randn(2, device=D1))


def test_inputs_on_two_devices_are_refused_naming_the_leaf() -> None:
    graphed = CudaGraphModule(lambda x, y: x + y.to(x.device), warmup=1)
    with pytest.raises(
        ValueError, match=re.escape("captures its graph on cuda:0, but args[1] is on cuda:1")
    ):
        graphed(torch.randn(2, device=D0), torch.randn(2, device=D1))
