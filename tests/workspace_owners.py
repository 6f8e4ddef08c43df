"""A graph of torch's that uses a cuBLAS workspace it does not own, for tests/test_coexistence.py
(run in a process of its own: what it checks can end in a memory fault).

    python tests/workspace_owners.py TRIGGER

torch caches cuBLAS's workspaces by stream, and hands out the streams of its pool again every
32 streams: tensordict's ``CudaGraphModule`` takes its capture stream from that pool, and
``torch.cuda.graph`` captures on a stream of that pool too. Here a graph is captured on the
stream that ``torch.cuda.graph`` will use (its workspace is made in that graph's pool), then
kept; a graph captured with ``torch.cuda.graph`` then uses that workspace (pytorch#193402).
TRIGGER then runs: ``cudagraph_td`` (a capture and a warm-up of this library), ``clear`` (a
clear of the workspaces, as each recording of torch.compile's CUDA graph trees does), or
``none``; the first graph is freed, and ``torch.cuda.empty_cache()`` (every
``torch.cuda.graph`` capture calls it) gives its pool back to the driver unless the
workspace still holds it. The second graph replays: after ``clear``, into memory that is no
longer there. Prints ``ok`` when its results are eager's and other tensors are untouched.
"""

from __future__ import annotations

import gc
import sys

import torch
from torch import nn

import cudagraph_td


def main(trigger: str) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(device)
    x = torch.randn(128, 64, device=device)
    net(x)  # cuBLAS's handles for this thread: no capture can make them

    torch.cuda.graph(torch.cuda.CUDAGraph())  # makes torch.cuda.graph's capture stream
    shared = torch.cuda.graph.default_capture_stream
    assert shared is not None
    stream = next(s for s in (torch.cuda.Stream() for _ in range(64)) if s == shared)
    torch._C._cuda_clearCublasWorkspaces()
    other = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(other, stream=stream):
        net(x)  # the same products: the same kinds of workspace
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):  # on that stream: with that workspace
        static_out = net(static)

    if trigger == "cudagraph_td":
        with torch.no_grad():
            mine = cudagraph_td.CudaGraphModule(nn.Linear(64, 64).to(device), warmup=2)
            for _ in range(3):
                mine(x)
    elif trigger == "clear":
        torch._C._cuda_clearCublasWorkspaces()
    del other  # the pool of the workspace's maker is freed once nothing holds the workspace
    gc.collect()
    torch.cuda.empty_cache()
    fillers = [torch.full((n << 20,), float("nan"), device=device) for n in (1, 4, 16)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(static_out, net(x))
    assert all(bool(f.isnan().all()) for f in fillers), "a replay wrote into other tensors"
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
