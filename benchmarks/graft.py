"""Is the version before's replay code faster, or only its process? The old code grafted on.

Issue 52's redesign replaced the one-key TensorDict replay, written inline in the old
``GraphEntry.replay`` (one frame), by a fused route that the entry calls and that calls the
graph's one-tensor launch (three frames), and the table's lookup (three frames: its method,
the key, the mode's read) by one closure. On workload f (the policy called with random batch
sizes, ``shapes`` buckets or exact), this times in turn, in one process:

- ``before``: the version before (``benchmarks/baseline``, see `scripts/make_baseline.sh`);
- ``now``: the current wrapper;
- ``now, old replay``: the current wrapper whose entries replay through the version before's
  code, one frame written here over the current entry's parts (its route's keys and checks,
  its launch's static input, replay and output);
- ``now, old replay and lookup``: the same, and the table looked up as the version before did
  (the key ``(mode, shapes)``, read by a function of its own);
- with ``--pieces``: each version's graphs alone, cycled (the bare ``replay()``, and the copy
  in, replay and clone out), which says whether the graphs differ.

Each variant is built twice (``#2``), later in the process, to show what building the same
thing at another time changes. On a CPU, the emulation's replays are made no-ops once every
variant has been checked against its policy eager, and ``--cold MIB`` writes that much
memory before each call (untimed): a GPU host's driver leaves the caches so after each
launch, and a call then pays for every object it reads. If the grafted variants time as ``now``, the time is not in
the code that the redesign changed. On a machine without CUDA the wrappers run on the
emulation (a check that every variant still runs; its times say nothing of a GPU's).

    python benchmarks/graft.py --rounds 600 [--pieces]
    python benchmarks/graft.py --rounds 400 --cold 8    # on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import pathlib
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

sys.path[:0] = ["benchmarks", "benchmarks/baseline"]
import workloads  # noqa: E402
from run import time_bursts  # noqa: E402

import cudagraph_td  # noqa: E402
from cudagraph_td._compat import foreach_copy_, td_entries, td_set  # noqa: E402
from cudagraph_td._values.routes import MISS  # noqa: E402
from cudagraph_td._values.signature import metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OPTIONS: dict[str, Any] = {} if DEVICE.type == "cuda" else {"backend": "emulate"}

BEFORE: Any = None
with contextlib.suppress(ImportError):
    import cudagraph_td_baseline  # type: ignore[import-not-found]

    BEFORE = cudagraph_td_baseline


def batches(count: int) -> list[TensorDict]:
    return workloads.random_batches(DEVICE, count, seed=2)


def cycled(tds: list[TensorDict], f: Callable[[TensorDict], Any]) -> Callable[[], Any]:
    call = workloads.in_turn(tds, f)
    call.one = f  # type: ignore[attr-defined]  # a call on a batch of one's choosing
    call.eager = getattr(f, "eager", None)  # type: ignore[attr-defined]
    return call


def wrapper(library: Any, shapes: str, tds: list[TensorDict]) -> Any:
    """A wrapper of ``library`` over a policy of its own, every batch size of ``tds`` past
    its capture."""
    policy = workloads._policy(DEVICE)
    graphed = workloads.random_batch_wrapper(library, shapes, policy, tds, **OPTIONS)
    graphed.eager = policy  # what `check` compares with
    return graphed


def entries(graphed: Any, tds: list[TensorDict]) -> dict[int, Any]:
    """The entry that replays each batch size of ``tds``."""
    with torch.no_grad():
        return {td.batch_size[0]: graphed._table.find((td,), {})[0] for td in tds}


def launch_parts(entry: Any) -> tuple[Any, list[torch.Tensor], Any, Any]:
    """A current entry's fused route, and its launch's static input, replay and output."""
    route = entry._fused.__self__
    return (route, *route.parts)


def old_replay(entry: Any) -> Callable[..., Any]:
    """The version before's one-key TensorDict replay, in one frame, over ``entry``'s parts."""
    route, static, replay, output = launch_parts(entry)
    in_key, out_key, batch_size = route.in_key, route.out_key, route.batch_size
    device, expected, holds = route.device, route.expected, route.holds
    general = type(entry).replay

    def one_frame(args: Any, kwargs: Any) -> Any:
        if kwargs:
            return general(entry, args, kwargs)
        td = args[0] if len(args) == 1 else None
        if type(td) is not TensorDict or td.batch_size != batch_size:
            return MISS
        tensor = td_entries(td).get(in_key)
        try:
            same = metadata(tensor) == expected
        except Exception:
            same = False
        if not same or (holds is not None and not holds()):
            return MISS
        if tensor is not static[0]:
            foreach_copy_(static, (tensor,))
        replay()
        out = output()
        entry.replays += 1
        td_device = td.device
        if td_device is None or td_device == device:
            td_set(td, out_key, out)
        else:
            td[out_key] = out
        return td

    return one_frame


def old_lookup(graphed: Any, tds: list[TensorDict]) -> None:
    """The table looked up by the version before's key, ``(mode, shapes)``, in three frames."""
    table = graphed._table
    found = {(key[0], key[3]): known for key, known in table._entries.items()}
    read = table._mode

    def key(args: Any, kwargs: Any) -> Any:
        shapes = [getattr(a, "shape", None) for a in args]
        if kwargs:
            shapes.extend((name, getattr(v, "shape", None)) for name, v in kwargs.items())
        return (read(), tuple(shapes))

    def find(args: Any, kwargs: Any) -> Any:
        try:
            return found[key(args, kwargs)]
        except (KeyError, TypeError):
            return ()

    table.find = find
    with torch.no_grad():
        assert all(find((td,), {}) for td in tds), "a batch size that the old key misses"


def pieces(graphed: Any, tds: list[TensorDict], old: bool) -> dict[str, Callable[[], Any]]:
    """A wrapper's graphs alone: the bare replay, and the copy in, replay and clone out."""
    parts = {}
    for n, entry in entries(graphed, tds).items():
        if old:
            parts[n] = (entry._one_tensor_replay, entry._static_inputs, entry._one_output)
        else:
            _, static, replay, output = launch_parts(entry)
            parts[n] = (replay, static, output)

    def launch(td: TensorDict) -> Any:
        replay, static, output = parts[td.batch_size[0]]
        foreach_copy_(static, (td_entries(td)["observation"],))
        replay()
        return output()

    return {
        "bare replay": cycled(tds, lambda td: parts[td.batch_size[0]][0]()),
        "copy+replay+clone": cycled(tds, launch),
    }


def variants(tds: list[TensorDict], with_pieces: bool) -> dict[str, Callable[[], Any]]:
    calls: dict[str, Callable[[], Any]] = {}
    for shapes in ("buckets", "exact"):
        for copy in ("", "#2"):
            if BEFORE is not None:
                graphed = wrapper(BEFORE, shapes, tds)
                calls[f"{shapes}: before{copy}"] = cycled(tds, graphed)
                if with_pieces:
                    for name, call in pieces(graphed, tds, old=True).items():
                        calls[f"{shapes}: before{copy}, {name}"] = call
            graphed = wrapper(cudagraph_td, shapes, tds)
            calls[f"{shapes}: now{copy}"] = cycled(tds, graphed)
            if with_pieces:
                for name, call in pieces(graphed, tds, old=False).items():
                    calls[f"{shapes}: now{copy}, {name}"] = call
            for lookup in (False, True):
                graphed = wrapper(cudagraph_td, shapes, tds)
                for entry in entries(graphed, tds).values():
                    entry.replay = old_replay(entry)
                name = "old replay and lookup" if lookup else "old replay"
                if lookup:
                    old_lookup(graphed, tds)
                calls[f"{shapes}: now, {name}{copy}"] = cycled(tds, graphed)
    return calls


def check(calls: dict[str, Callable[[], Any]], tds: list[TensorDict]) -> None:
    """Every wrapper variant writes its policy's action, as the policy eager."""
    with torch.no_grad():
        for name, call in calls.items():
            policy = call.eager  # type: ignore[attr-defined]
            if policy is None:  # a graph alone
                continue
            td = tds[1]
            call.one(td)  # type: ignore[attr-defined]
            expected = policy.module(td["observation"])
            torch.testing.assert_close(td["action"], expected, msg=lambda m, n=name: f"{n}: {m}")


@contextlib.contextmanager
def replays_switch() -> Any:
    """On the CPU: the emulation's graph replays of both versions behind a switch, set on
    while the variants are built and checked; ``switch[0] = False`` makes them no-ops (what
    is left is the wrappers' own path, the input copy and the output's clone, as on a GPU,
    where the replay is one launch). Put back as they were at the end."""
    switch, patched = [True], []
    for library in (cudagraph_td, BEFORE):
        if library is not None and DEVICE.type == "cpu":
            recording = importlib.import_module(f"{library.__name__}._emulation.recording")
            original = recording.RecordedGraph.replay

            def replay(self: Any, original: Any = original) -> None:
                if switch[0]:
                    original(self)

            recording.RecordedGraph.replay = replay
            patched.append((recording.RecordedGraph, original))
    try:
        yield switch
    finally:
        for graph_class, original in patched:
            graph_class.replay = original


def time_cold(calls: dict[str, Callable[[], Any]], rounds: int, mib: int) -> dict[str, list[float]]:
    """µs a call, each call timed alone after ``mib`` MiB are written (untimed): the caches
    left cold, as a GPU host's driver leaves them after each graph launch. A round's figure
    is the median of 8 calls."""
    memory = bytearray(mib << 20)
    ones = b"\x01" * (len(memory) // 64)
    per: dict[str, list[float]] = {name: [] for name in calls}
    names, order = list(calls), random.Random(0)
    for _ in range(rounds):
        order.shuffle(names)
        for name in names:
            call, times = calls[name], []
            for _ in range(8):
                memory[::64] = ones  # a write to every cache line
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            per[name].append(statistics.median(times) * 1e6)
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=600, help="rounds of each variant")
    parser.add_argument("--pieces", action="store_true", help="time each version's graphs too")
    parser.add_argument("--batches", type=int, default=512)
    parser.add_argument(
        "--cold",
        type=int,
        default=0,
        metavar="MIB",
        help="on the CPU: MiB written before each call",
    )
    parser.add_argument("--json", default="", help="a file for the medians, with the setup")
    args = parser.parse_args()
    if args.cold and DEVICE.type == "cuda":
        raise SystemExit("--cold plays on the CPU what a GPU's launches do: on CUDA, time without")
    tds = batches(args.batches)
    with replays_switch() as switch:
        calls = variants(tds, args.pieces)
        check(calls, tds)
        switch[0] = False  # on the CPU, from here on: the replays are no-ops
        with torch.no_grad():
            if args.cold:
                per = time_cold(calls, args.rounds, args.cold)
            else:
                per = time_bursts(calls, args.rounds)
    if BEFORE is None:
        print("no benchmarks/baseline: the version before is not timed")
    medians = {}
    for name, times in per.items():
        low, medians[name], high = statistics.quantiles(times, n=4)
        print(f"{name:40s} {medians[name]:8.3f} us  (IQR {low:.3f}..{high:.3f})")
    if args.json:
        meta = {
            "device": (
                torch.cuda.get_device_name()
                if DEVICE.type == "cuda"
                else f"CPU ({platform.machine()}), the emulation, replays made no-ops"
            ),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/graft.py", *sys.argv[1:]]),
            "baseline": getattr(BEFORE, "REVISION", None),
        }
        pathlib.Path(args.json).write_text(
            json.dumps({"meta": meta, "median_us": medians}, indent=1)
        )


if __name__ == "__main__":
    main()
