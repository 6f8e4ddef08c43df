"""Quickstart: a policy and a whole training step captured as graphs, checked against eager.

On a GPU the graphs are CUDA graphs, and the script prints the time per call, eager and
graphed. On a machine without CUDA it runs the same code on the CPU emulation of a graph
(``backend="emulate"``): the function is recorded once, later calls replay the recording on
the wrapper's static buffers without running its Python, and what a CUDA capture refuses
fails there too. It is how code that uses the wrapper is tested without a GPU.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from cudagraph_td import CudaGraphModule, InputMismatchError, capturable_on_cpu


def time_per_call(fn, obs: torch.Tensor, iters: int) -> float:
    """Microseconds per call, averaged over ``iters`` calls after 10 untimed ones."""
    for _ in range(10):
        fn(obs)
    if obs.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn(obs)
    if obs.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def make_policy(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(17, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 6)
    ).to(device)


def policy_replays(device: str, backend: str) -> None:
    policy = make_policy(device)
    calls = 0

    def act(obs: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1  # Python that a replay does not run
        return policy(obs)

    graphed = CudaGraphModule(act, warmup=2, backend=backend)
    with torch.no_grad():
        for _ in range(10):
            obs = torch.randn(32, 17, device=device)
            torch.testing.assert_close(graphed(obs), policy(obs))
    # The capturing call runs the Python twice: once eagerly, for its result, then recorded.
    replays = sum(info.replays for info in graphed.graphs())
    print(f"policy: 10 calls; the function's Python ran {calls} times: once at the warm-up call,")
    print("        twice at the capturing call (eagerly for its result, then recorded), and not")
    print(f"        at the {replays} replays, whose actions equal eager's")
    try:
        with torch.no_grad():
            graphed(torch.randn(16, 17, device=device))
    except InputMismatchError as err:  # a ValueError that names the input
        print(f"an input of another shape: {type(err).__name__} at {err.path}:")
        print(f"        captured {err.captured}, received {err.received}")


def training_step(device: str, backend: str) -> None:
    """A whole step (forward, backward, optimizer step) as one graph, beside an eager twin."""
    nets = [make_policy(device) for _ in range(2)]
    lr = torch.tensor(1e-3, device=device)  # a tensor: the graph reads its current value
    opts = [torch.optim.Adam(net.parameters(), lr=lr, capturable=True) for net in nets]

    def make_step(net: nn.Module, opt: torch.optim.Optimizer):
        def step(obs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = (net(obs) - target).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    graphed = CudaGraphModule(make_step(nets[0], opts[0]), warmup=2, backend=backend)
    twin = make_step(nets[1], opts[1])
    for _ in range(20):
        obs, target = torch.randn(64, 17, device=device), torch.randn(64, 6, device=device)
        loss = graphed(obs, target)
        torch.testing.assert_close(loss, twin(obs, target))
    for p, q in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    print(f"training step: 20 steps, losses and parameters equal to the eager twin's ({loss:.4f})")


def main() -> None:
    cuda = torch.cuda.is_available()
    device, backend = ("cuda", "cuda") if cuda else ("cpu", "emulate")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'} (backend={backend!r})")
    if not cuda:
        print("No CUDA here: the CPU emulation of a graph runs the same code.")
    policy_replays(device, backend)
    if cuda:
        training_step(device, backend)
    else:
        # torch refuses capturable optimizers on the CPU; the emulation lifts that inside its
        # calls, and capturable_on_cpu() does for the eager twin.
        with capturable_on_cpu():
            training_step(device, backend)
    if cuda:  # the point of it all: the time per call
        policy = make_policy(device)
        graphed = CudaGraphModule(policy, warmup=2)
        obs = torch.randn(32, 17, device=device)
        with torch.no_grad():
            eager_us = time_per_call(policy, obs, 2000)
            graphed_us = time_per_call(graphed, obs, 2000)
        print(f"eager:   {eager_us:8.1f} us/call")
        print(f"graphed: {graphed_us:8.1f} us/call ({eager_us / graphed_us:.2f}x eager)")


if __name__ == "__main__":
    main()
