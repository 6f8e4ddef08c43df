"""Quickstart: capture a small policy network as a CUDA graph and compare it with eager calls.

On a GPU this prints the time per call, eager and graphed. On a machine without CUDA it says
so and runs the wrapper's eager fallback, which needs no change to the code.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from cudagraph_td import CudaGraphModule


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


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = nn.Sequential(
        nn.Linear(17, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 6)
    ).to(device)
    if device == "cpu":
        print("CUDA graphs need CUDA, which this machine lacks: running the eager fallback.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one warning that says the same
            graphed = CudaGraphModule(policy)
    else:
        graphed = CudaGraphModule(policy, warmup=2)

    obs = torch.randn(32, 17, device=device)
    with torch.no_grad():
        torch.testing.assert_close(graphed(obs), policy(obs))
        for _ in range(3):
            torch.testing.assert_close(graphed(obs), policy(obs))
        iters = 2000 if device == "cuda" else 200
        eager_us = time_per_call(policy, obs, iters)
        graphed_us = time_per_call(graphed, obs, iters)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"eager:   {eager_us:8.1f} us/call")
    if device == "cuda":
        print(f"graphed: {graphed_us:8.1f} us/call ({eager_us / graphed_us:.2f}x eager)")
    else:
        print(f"wrapped: {graphed_us:8.1f} us/call (the eager fallback: no graph without CUDA)")


if __name__ == "__main__":
    main()
