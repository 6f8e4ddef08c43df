"""Does a capture that broke inside ``torch.cuda.graph`` mislead later captures? (GPU only.)

On torch 2.11, ``CUDAGraph.capture_end`` raises on a broken capture before it ends the
allocators' routing of the capture's pool, whose filter keeps a raw pointer to the graph
(pytorch#180395 ends them first). This breaks a capture as tensordict's class does when it
fails (a host sync inside ``torch.cuda.graph``), frees the graph, then captures one
allocation with each of ``--graphs`` new graphs, each into a pool of its own, and counts the
captures whose allocation did not land in their own pool: made at the dead graph's address,
a new graph answers its filter, and its capture allocates in the dead capture's pool.

    python3 scripts/stale_routing_probe.py            # the failure left as torch leaves it
    python3 scripts/stale_routing_probe.py --keep     # the failed graph kept alive
    python3 scripts/stale_routing_probe.py --end      # its caching-allocator routing ended

It prints one JSON line: the torch version, the mode, how many captures were misrouted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json

import torch

from cudagraph_td import _compat


def break_a_capture(device: torch.device, kept: list[torch.cuda.CUDAGraph]) -> int:
    """A capture inside ``torch.cuda.graph`` broken by a host sync, as tensordict's fails;
    the number ``n`` of its pool's id ``(n, 0)``."""
    first = next_pool_number(device)
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(4, device=device)
    with contextlib.suppress(RuntimeError), torch.cuda.graph(graph):
        (x * 2).sum().item()  # a host sync: the capture is invalidated
    kept.append(graph)
    return first


def next_pool_number(device: torch.device) -> int:
    with torch.cuda.stream(torch.cuda.Stream(device)):
        return int(_compat.one_node_graph(device).pool()[0]) + 1


def misrouted(device: torch.device, graphs: int) -> int:
    """Of ``graphs`` captures of one allocation, each into a pool of its own, how many
    allocated outside it."""
    count = 0
    stream = torch.cuda.Stream(device)
    for _ in range(graphs):
        pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            made = torch.empty(1024, device=device)
            made.zero_()
            ptr = made.data_ptr()
            graph.capture_end()
        count += ptr not in _compat.pool_blocks(device, pool)
        del made, graph
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--keep", action="store_true", help="keep the failed graph alive")
    mode.add_argument("--end", action="store_true", help="end its routing and keep it")
    parser.add_argument("--graphs", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    kept: list[torch.cuda.CUDAGraph] = []
    number = break_a_capture(device, kept)
    if args.end:
        with contextlib.suppress(RuntimeError):
            _compat.end_allocate_to_pool(device, (number, 0))
    if not (args.keep or args.end):
        kept.clear()  # the graph freed: its filter's pointer dangles
        gc.collect()
    result = {
        "torch": torch.__version__,
        "mode": "keep" if args.keep else "end" if args.end else "freed",
        "graphs": args.graphs,
        "misrouted": misrouted(device, args.graphs),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
