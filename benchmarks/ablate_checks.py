"""Ablation of the per-call checks (CPU us per call).

On the TensorDict policy of workload c, times, interleaved: the version before the checks
(benchmarks/baseline, if made), the current wrapper, the same with its state check removed,
and each check alone. On the SAC update of workload d (``--sac``): the version before and
the current one, the state check and the training step's watch alone, then a profile of
the current call. With ``--borrowed``: the policy's call with borrowed outputs and its
inputs in place (issue 43) taken apart, beside a bare ``replay()`` of its graph and the
same graph's replay with its output lent by hand. On workload f (``--buckets``): a call with ``shapes=Buckets(...)`` taken
apart, beside a floor that replays the same graphs. With ``--after``: the policy's no_grad
replay path after other work (what workload g's taking turns costs).

With ``--emulate``, the policy and the buckets run on the CPU emulation's graphs (no
baseline, no floors of workload f, no ``--sac``): their times say nothing of a GPU's, but
every step is still found and run (the test suite runs it so, with ``--emulate --all``: the
policy, ``--buckets`` and ``--after`` in one process).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from typing import Any

import torch
from tensordict import TensorDict

sys.path[:0] = ["benchmarks", "benchmarks/baseline"]
import workloads  # noqa: E402
from run import sync, time_cpu  # noqa: E402

from cudagraph_td import Buckets, CudaGraphModule  # noqa: E402
from cudagraph_td._compat import td_entries, td_set  # noqa: E402

EMULATE = "--emulate" in sys.argv
DEVICE = torch.device("cpu" if EMULATE else "cuda")
BACKEND = "emulate" if EMULATE else "cuda"
if not EMULATE:  # the version before, where benchmarks/baseline has one (on CUDA only)
    with contextlib.suppress(ImportError):
        import cudagraph_td_baseline  # type: ignore[import-not-found]

        workloads.BASELINE = cudagraph_td_baseline


def _without_state_check(entry: Any) -> None:
    """An entry's graph refilled without its state check (an ablation: never in the library)."""
    entry.captured.state = None
    entry.fill(entry.captured)


def _n(count: int) -> int:
    """``count`` repetitions on a GPU; on the emulation, which times nothing of a GPU's and
    only shows that every step runs, a hundredth of them (at least 2)."""
    return max(2, count // 100) if EMULATE else count


def main() -> None:
    device = DEVICE
    td = TensorDict(observation=torch.randn(32, 17, device=device), batch_size=[32])
    calls: dict[str, Any] = {}
    wrappers: list[Any] = []
    policy = workloads._policy(device)
    now = CudaGraphModule(policy, backend=BACKEND)  # type: ignore[arg-type]
    stateless = CudaGraphModule(workloads._policy(device), backend=BACKEND)  # type: ignore[arg-type]
    if workloads.BASELINE is not None:  # the version before (imported above, on CUDA only)
        before = workloads.BASELINE.CudaGraphModule(workloads._policy(device))
        wrappers.append(before)
        calls["before"] = lambda: before(td)
    with torch.no_grad():
        for g in (now, stateless, *wrappers):
            for _ in range(4):
                g(td)
        graphs = stateless._current_graphs()
        _without_state_check(graphs.entries[graphs.key])
        for _ in range(2):
            stateless(td)
        now_graphs = now._current_graphs()
        state = now_graphs.entries[now_graphs.key].captured.state
        calls |= {
            "now": lambda: now(td),
            "now without the state check": lambda: stateless(td),
            "State.fresh alone": state.fresh,
            "RLock with-block alone": lambda: _locked(now._lock),
            **_raw_stream(),
            "any autocast alone": torch._C._is_any_autocast_enabled,
            "get_ident alone": threading.get_ident,
        }
        _time(calls, rounds=_n(400), burst=16)


def _raw_stream() -> dict[str, Any]:
    if EMULATE:
        return {}
    return {"raw stream alone": lambda: torch._C._cuda_getCurrentRawStream(0)}


def sac() -> None:
    import cProfile
    import pstats

    device = torch.device("cuda")
    workload = workloads.sac_update(device)
    now = workload.variants["cudagraph_td"]()
    calls: dict[str, Any] = {"now": now}
    if workloads.BEFORE in workload.variants:
        calls["before"] = workload.variants[workloads.BEFORE]()
    for _ in range(4):
        for call in calls.values():
            call()
    wrapper = next(  # the wrapper that the call calls
        cell.cell_contents
        for cell in now.__closure__  # type: ignore[attr-defined]
        if isinstance(cell.cell_contents, CudaGraphModule)
    )
    graphs = wrapper._current_graphs()
    captured = graphs.entries[graphs.key].captured
    calls["State.fresh alone"] = captured.state.fresh
    calls["watch alone"] = captured._watch
    _time(calls, rounds=300, burst=8)
    print("entries followed:", len(captured.state.followed))
    profile = cProfile.Profile()
    profile.runcall(lambda: [now() for _ in range(2000)])
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def _time(calls: dict[str, Any], *, rounds: int, burst: int) -> None:
    """Print the median CPU time of each call, over ``rounds`` bursts of ``burst`` calls,
    one burst of each in turn, in a new random order each round (`run.time_cpu`)."""
    for name, us in time_cpu(calls, rounds, burst).items():
        print(f"{name:32s} {us:8.3f} us")


def _cycling(graphed: Any, graphs: Any) -> dict[str, Any]:
    """The layers of the wrapper's call, over batches of random sizes (as workload f), and a
    floor replaying the same graphs through views made once per size."""
    tds = workloads.random_batches(DEVICE, _n(512), seed=1)
    for td in tds:
        graphed(td)
    views = {}
    for n in range(1, 65):
        size = next(b for b in workloads.BUCKETS if b >= n)
        captured = graphs.entries[graphs.key._replace(shapes=(size,))].captured
        static, out = captured._static_inputs[0], captured.outputs.static[0]
        views[n] = ([static[:n]], out[:n], captured._replay)
    # The replay path of each batch size: what the graph table finds for it.
    paths = {td.batch_size[0]: graphed._table.find((td,), {})[0] for td in tds}
    position = [0]  # one position for all: each call takes the next batch

    def cycled(f: Any) -> Any:
        return workloads.in_turn(tds, f, position)

    def floor(td: TensorDict) -> TensorDict:
        heads, out, replay = views[td.batch_size[0]]
        torch._foreach_copy_(heads, [td["observation"]])
        replay()
        td["action"] = out.clone()
        return td

    one = tds[0]
    return {
        "one size: floor, same graphs": lambda: floor(one),
        "one size: wrapper": lambda: graphed(one),
        "cycled: floor, same graphs": cycled(floor),
        "cycled: wrapper": cycled(graphed),
        "cycled: lookup + path": cycled(
            lambda td: graphed._table.find((td,), {})[0].replay((td,), {})
        ),
        "cycled: path alone": cycled(lambda td: paths[td.batch_size[0]].replay((td,), {})),
    }


def _layers_of_versions() -> dict[str, Any]:
    """Per version (the current one, and the version before where benchmarks/baseline has
    one) and per shapes (buckets, exact): the wrapper's call, its table's lookup alone and
    the entry's replay alone, over the same batches of random sizes (as workload f): where
    a difference between the versions lies."""
    tds = workloads.random_batches(DEVICE, _n(512), seed=2)
    libraries = {"now": sys.modules["cudagraph_td"]}
    if workloads.BASELINE is not None:
        libraries["before"] = workloads.BASELINE
    options = {"backend": BACKEND} if EMULATE else {}
    calls: dict[str, Any] = {}
    for version, library in libraries.items():
        for shapes in ("buckets", "exact"):
            policy = workloads._policy(DEVICE)
            graphed = workloads.random_batch_wrapper(library, shapes, policy, tds, **options)
            table = graphed._table
            paths = {td.batch_size[0]: table.find((td,), {})[0] for td in tds}
            calls |= {
                f"{version}, {shapes}: wrapper": workloads.in_turn(tds, graphed),
                f"{version}, {shapes}: lookup alone": workloads.in_turn(
                    tds, lambda td, table=table: table.find((td,), {})
                ),
                f"{version}, {shapes}: path alone": workloads.in_turn(
                    tds, lambda td, paths=paths: paths[td.batch_size[0]].replay((td,), {})
                ),
            }
    return calls


def _pieces(graphed: Any, td: TensorDict) -> dict[str, Any]:
    """Each step of the wrapper's call, alone (what the replay path's layers cost)."""
    from cudagraph_td._compat import interaction_type, td_entries
    from cudagraph_td._values.signature import metadata

    t = td["observation"]
    module = graphed.module
    return {
        "RLock with-block alone": lambda: _locked(graphed._lock),
        **_raw_stream(),
        "interaction type alone": interaction_type,
        "grad mode alone": torch.is_grad_enabled,
        "training alone": lambda: module.training,
        "any autocast alone": torch._C._is_any_autocast_enabled,
        "entries get alone": lambda: td_entries(td).get("observation"),
        "metadata alone": lambda: metadata(t),
        "data_ptr alone": t.data_ptr,
        "empty lambda": lambda: None,
    }


def _locked(lock: Any) -> None:
    with lock:
        pass


def buckets() -> None:
    """Workload f: where the CPU time of a call with shapes="buckets" goes, beside the floor
    (run under no_grad); on CUDA, beside the benchmark's variants of f, those of the version
    before too where ``benchmarks/baseline`` has one (both shapes, timed in turn)."""
    device = DEVICE
    calls: dict[str, Any] = {}
    if not EMULATE:
        workload = workloads.policy_random_batch(device)
        names = ["floor", "cudagraph_td", "cudagraph_td exact"]
        names += [
            n for n in (workloads.BEFORE, f"{workloads.BEFORE} exact") if n in workload.variants
        ]
        calls = {name: workload.variants[name]() for name in names}
    graphed = CudaGraphModule(
        workloads._policy(device),
        shapes=Buckets(workloads.BUCKETS),
        backend=BACKEND,  # type: ignore[arg-type]
    )
    td = TensorDict(observation=torch.randn(37, 17, device=device), batch_size=[37])
    with torch.no_grad():
        graphed.precapture(td)
        for _ in range(3):
            graphed(td)
        graphs = graphed._current_graphs()
        (path,) = graphed._table.find((td,), {})
        captured = graphs.entries[graphs.key._replace(shapes=(64,))].captured
        calls |= _cycling(graphed, graphs)
        calls |= _layers_of_versions()
        calls |= {
            "wrapper, one size": lambda: graphed(td),
            "lookup + path": lambda: graphed._table.find((td,), {})[0].replay((td,), {}),
            "path alone": lambda: path.replay((td,), {}),
            "State.fresh alone": captured.state.fresh,
            "td.shape alone": lambda: td.shape,
            **_pieces(graphed, td),
        }
        _time(calls, rounds=_n(300), burst=16)
        profile_calls = calls.get("cudagraph_td", calls["wrapper, one size"])
    import cProfile
    import pstats

    with torch.no_grad():
        profile = cProfile.Profile()
        profile.runcall(lambda: [profile_calls() for _ in range(_n(3000))])
    sync()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def after_other_work() -> None:
    """What the policy's no_grad replay path costs back to back, after a no_grad call, after
    a grad-mode call of the same wrapper (workload g takes turns so), and after unrelated
    eager work (a forward and backward of another network). With ``--emulate`` the
    emulation's replays are stubbed: the library's Python path alone."""
    if EMULATE:
        from cudagraph_td._emulation.recording import RecordedGraph

        RecordedGraph.replay = lambda self: None  # type: ignore[method-assign]
    graphed = CudaGraphModule(workloads._policy(DEVICE), warmup=2, backend=BACKEND)  # type: ignore[arg-type]
    tds = [
        TensorDict(observation=torch.randn(32, 17, device=DEVICE), batch_size=[32])
        for _ in range(3)
    ]
    for _ in range(3):
        for i, td in enumerate(tds):
            _call_in(graphed, td, grad=i > 0)
    with torch.no_grad():
        (path,) = graphed._table.find((tds[0],), {})
    net, x = workloads._policy(DEVICE).module, torch.randn(32, 17, device=DEVICE)
    before: dict[str, Any] = {
        "back to back": lambda i: None,
        "after a no_grad call": lambda i: _call_in(graphed, tds[0], grad=False),
        "after a grad-mode call": lambda i: _call_in(graphed, tds[1 + i % 2], grad=True),
        "after an eager forward and backward": lambda i: net(x).sum().backward(),
    }
    for name, work in before.items():
        times = []
        for i in range(_n(4000)):
            work(i)
            sync()
            with torch.no_grad():
                start = time.perf_counter()
                path.replay((tds[0],), {})
                times.append(time.perf_counter() - start)
        print(f"no_grad replay path, {name:40s} {statistics.median(times) * 1e6:8.3f} us")


def borrowed() -> None:
    """The policy's in-place call with borrowed outputs, taken apart: the graph's bare
    ``replay()``; the replay and its output lent (`_values.borrowed.LentOutputs.one`); the
    same with the output set into the TensorDict (the least a TensorDict call does); the
    wrapper's call (`_capture.entry.GraphEntry.replay` alone, the whole call, the whole call
    without the state check); the state check alone; and on CUDA, the whole call with its
    loan renewed in place (`_renewing`, a prototype), with and without the state check."""
    device = DEVICE
    td = TensorDict(observation=torch.randn(32, 17, device=device), batch_size=[32])

    def wrapper() -> tuple[Any, TensorDict, Any]:
        graphed = CudaGraphModule(
            workloads._policy(device),
            backend=BACKEND,  # type: ignore[arg-type]
            outputs="borrowed",
        )
        for _ in range(4):
            graphed(td.clone())
        (buffers,), _ = graphed.input_buffers(td)
        buffers["observation"].copy_(td["observation"])
        return graphed, buffers, graphed._table.entries()[0]

    now, buffers, entry = wrapper()
    stateless, stateless_buffers, stateless_entry = wrapper()
    _without_state_check(stateless_entry)
    renewing, renewing_buffers, renewing_entry = wrapper()
    bare, bare_buffers, bare_entry = wrapper()  # renewing, and no state check
    _without_state_check(bare_entry)
    if EMULATE:  # an emulated graph's replay and loan, through its launch
        one, lend = None, None
    else:
        one = entry.captured.one_tensor
        lend = entry.captured.outputs.copies.one
    hand = TensorDict(observation=td["observation"], batch_size=td.batch_size)

    def replay_lend_set() -> None:
        one.replay()
        td_set(hand, "action", lend())

    calls: dict[str, Any] = {}
    if one is not None:
        calls |= {
            "bare replay()": one.replay,
            "replay, output lent": lambda: (one.replay(), lend()),
            "replay, output lent, set in the TensorDict": replay_lend_set,
        }
    calls |= {
        "GraphEntry.replay alone": lambda: entry.replay((buffers,), {}),
        "wrapper, in place, borrowed": lambda: now(buffers),
        "the same without the state check": lambda: stateless(stateless_buffers),
        "State.fresh alone (borrowed)": entry.captured.state.fresh,
    }
    if one is not None:  # the prototype of a loan renewed in place (see `_renewing`)
        renewing_entry._one_output = _renewing(renewing_entry, renewing_buffers)
        bare_entry._one_output = _renewing(bare_entry, bare_buffers)
        calls |= {
            "wrapper, loan renewed in place": lambda: renewing(renewing_buffers),
            "loan renewed, no state check": lambda: bare(bare_buffers),
        }
    _time(calls, rounds=_n(400), burst=16)


def _renewing(entry: Any, td: TensorDict) -> Any:
    """A prototype, not in the library: the entry's one output lent again as the same tensor
    when nothing but ``td``'s ``"action"`` entry holds the previous one (no reference, no
    view, no C++ holder, the same layout): no new storage, tensor or error message. What a
    loan could save at best, for an in-place call whose caller drops its outputs."""
    copies = entry.captured.outputs.copies
    lend, held = copies.one, {}
    refs, storage_users = sys.getrefcount, torch._C._storage_Use_Count

    def one() -> torch.Tensor:
        previous = held.get("tensor")
        if previous is not None:
            holders = 4 if td_entries(td).get("action") is previous else 3
            if (
                refs(previous) == holders
                and previous._use_count() == 1
                and storage_users(held["storage"]._cdata) == 2
                and (previous.shape, previous.stride(), previous.storage_offset()) == held["layout"]
            ):
                return previous
        lent = lend()
        held.update(
            tensor=lent,
            storage=copies.lease.held[0],
            layout=(lent.shape, lent.stride(), lent.storage_offset()),
        )
        return lent

    return one


def _call_in(graphed: Any, td: TensorDict, *, grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        graphed(td)


if __name__ == "__main__":
    if "--all" in sys.argv:  # the three parts that run on the emulation, in one process
        if not EMULATE:
            raise SystemExit("--all runs on the emulation only (with --emulate)")
        with torch.enable_grad():
            main()
        with torch.no_grad():  # workload f is called under no_grad
            buckets()
        with torch.no_grad():
            borrowed()
        with torch.enable_grad():
            after_other_work()  # last: it stubs the emulation's replays
        raise SystemExit
    # Workload f and the borrowed policy are called under no_grad.
    torch.set_grad_enabled("--buckets" not in sys.argv and "--borrowed" not in sys.argv)
    if "--sac" in sys.argv:
        if EMULATE:
            raise SystemExit("--sac runs on CUDA only")
        sac()
    elif "--buckets" in sys.argv:
        buckets()
    elif "--after" in sys.argv:
        after_other_work()
    elif "--borrowed" in sys.argv:
        borrowed()
    else:
        main()
