"""LeanRL's real TD3 and SAC scripts on HalfCheetah-v4: steps per second and where a step's
time goes, tensordict's ``CudaGraphModule`` beside this library's.

    bash scripts/fetch_leanrl.sh   # the scripts into .leanrl/, their wheels into .whl-leanrl/
    python benchmarks/leanrl_scripts.py [--scripts td3,sac] [--variants ...] [--runs 3]
                                        [--total-timesteps N] [--learning-starts L] [--out DIR]

Each run is a fresh process that runs one script (``td3_continuous_action_torchcompile.py``
or ``sac_continuous_action_torchcompile.py`` from ``.leanrl/``, as LeanRL wrote it) with
its own arguments for a short run (``--total-timesteps``, ``--learning-starts``,
``--cudagraphs``; ``--compile`` stays off), through one variant:

* ``tensordict``: the script as written, with ``tensordict.nn.CudaGraphModule``;
* ``cudagraph_td``: ``tensordict.nn.CudaGraphModule`` replaced by
  ``cudagraph_td.CudaGraphModule`` before the script imports it (the default path);
* ``borrowed``: the same with ``outputs="borrowed"`` (``functools.partial``);
* ``eager`` (not run unless asked): ``--no-cudagraphs``.

Every variant runs with the same three stand-ins, set before the script starts: ``wandb``
is a module whose ``init`` and ``log`` do nothing (the scripts call both unconditionally);
``to_module`` defaults to ``preserve_module_state=False``, and a ``TensorDictModule`` keeps
the first of its function's outputs when it returns more than its ``out_keys`` (tensordict
0.15 changed both since the scripts were written in September 2024: without them TD3's
``.numpy()`` of an action fails, the action requiring grad, and SAC's policy raises; see
``tests/corpus/test_leanrl.py``).

How a step is timed. The script's source is parsed, and each statement of its main loop
(``for global_step in pbar:``) is put in a ``with`` block naming the part of a step it
belongs to: ``policy`` (the action, its ``.cpu().numpy()`` included), ``environment``
(``envs.step``), ``transition`` (the environment's output made tensors on the device and a
``TensorDict``), ``replay buffer`` (``extend_and_sample``: torchrl's ``extend`` and
``sample``), ``update_main``, ``update_pol`` (SAC: with its ``alpha.copy_``), ``target
update`` (the ``lerp_`` calls), ``logging`` (episode returns, the progress bar's text,
``wandb.log`` every 100 steps) and ``other``; a statement holding several parts (an ``if``
around the updates) is split into its own statements. Nothing else changes: the code runs
as the script, line numbers kept. The learning steps are split in three windows:
``--warmup-steps`` (warm-up and capture, not timed), the host window (each part's host time
by ``time.perf_counter``, and steps per second from the start of one step to the start of
the last, every 100th step's logging included), and the last ``--gpu-steps`` steps, where
each part is also bracketed by CUDA events on the current stream: its GPU time is the
stream's time between the two (the work the part put there, and any time the stream
waited on the host inside it). ``loop`` is a step's time outside every part (tqdm's
iteration). Figures are per step, median over ``--runs`` runs; the variants take turns.

A variant that fails prints its error (the tail of its output) and the rest go on. With
``--emulate`` (on a machine without CUDA), the script runs on the CPU (``--no-cuda``) and
cudagraph_td on its CPU emulation: a check that the pieces run, no figure of a GPU's.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = {
    "td3": "td3_continuous_action_torchcompile.py",
    "sac": "sac_continuous_action_torchcompile.py",
}
VARIANTS = ("tensordict", "cudagraph_td", "borrowed", "eager")
PARTS = (
    "policy",
    "environment",
    "transition",
    "replay buffer",
    "update_main",
    "update_pol",
    "target update",
    "logging",
    "other",
)


# -- The parts of a step: which statements of the main loop belong to which ------------------


def _part_of(node: ast.AST) -> str | None:
    """The part a simple statement (or expression) belongs to, from the names it uses."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            name = sub.func.id
            if name in ("update_main", "update_pol", "policy"):
                return name
            if name == "extend_and_sample":
                return "replay buffer"
        if isinstance(sub, ast.Attribute):
            base = sub.value.id if isinstance(sub.value, ast.Name) else None
            if sub.attr == "lerp_":
                return "target update"
            if sub.attr == "step" and base == "envs":
                return "environment"
            if sub.attr == "numpy" or (sub.attr == "sample" and base != "rb"):
                return "policy"  # the action to the host; random actions before learning
            if sub.attr == "copy_" and base == "alpha":
                return "update_pol"  # SAC's entropy coefficient, after its policy update
            if sub.attr == "set_description" or base == "wandb":
                return "logging"
        if isinstance(sub, ast.Name) and sub.id in ("avg_returns", "max_ep_ret", "desc"):
            return "logging"
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in ("TensorDict", "next_obs", "real_next_obs"):
            return "transition"
    return None


def _parts_in(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With)):
        found = set()
        for child in (*stmt.body, *getattr(stmt, "orelse", ())):
            found |= _parts_in(child)
        return found
    return {_part_of(stmt) or "other"}


def _timed(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` with each statement in ``with __parts__(name):``; a compound statement that
    holds several parts (``other`` aside) keeps its test and has its own statements timed
    instead."""
    out: list[ast.stmt] = []
    for stmt in body:
        parts = _parts_in(stmt) - {"other"}  # a part's own bookkeeping counts as that part
        if len(parts) > 1:
            stmt.body = _timed(stmt.body)  # type: ignore[attr-defined]
            if getattr(stmt, "orelse", None):
                stmt.orelse = _timed(stmt.orelse)  # type: ignore[attr-defined]
            out.append(stmt)
            continue
        name = parts.pop() if parts else "other"
        call = ast.Call(ast.Name("__parts__", ast.Load()), [ast.Constant(name)], [])
        block = ast.With([ast.withitem(call)], [stmt])
        out.append(ast.copy_location(block, stmt))
    return out


def instrument(source: str, filename: str) -> types.CodeType:
    """The script compiled with its main loop's statements timed by part: the loop
    ``for global_step in ...`` gets ``__parts__.step(global_step)`` first, and
    ``__parts__.done()`` runs after it."""
    tree = ast.parse(source, filename)
    loops = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and node.target.id == "global_step"
    ]
    if len(loops) != 1:
        raise RuntimeError(
            f"{filename}: expected one `for global_step in ...` loop, found {len(loops)}"
        )
    loop = loops[0]
    tick = ast.parse("__parts__.step(global_step)").body[0]
    loop.body = [ast.copy_location(tick, loop.body[0]), *_timed(loop.body)]
    return compile(ast.fix_missing_locations(tree), filename, "exec")


class _Untimed:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _Host:
    def __init__(self, parts: Parts, name: str):
        self.parts, self.name = parts, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        host = self.parts.host
        host[self.name] = host.get(self.name, 0.0) + time.perf_counter() - self.start


class _Gpu:
    def __init__(self, parts: Parts, name: str):
        self.parts, self.name = parts, name

    def __enter__(self) -> None:
        self.start = self.parts.event()

    def __exit__(self, *exc: object) -> None:
        self.parts.spans.append((self.name, self.start, self.parts.event()))


class Parts:
    """Where a step's time goes: ``__parts__`` in the instrumented script. Learning steps
    ``learning_starts + 1 + warmup`` to ``total - gpu_steps`` are the host window (host time
    per part, and the step rate); the last ``gpu_steps`` steps the GPU window (CUDA events
    around each part)."""

    def __init__(self, learning_starts: int, total: int, warmup: int, gpu_steps: int, cuda: bool):
        self.host_from = learning_starts + 1 + warmup
        self.gpu_from = total - gpu_steps if cuda else total
        self.total = total
        self.untimed = _Untimed()
        self.mode = "untimed"
        self.host: dict[str, float] = {}
        self.starts: list[float] = []
        self.spans: list[tuple[str, Any, Any]] = []
        self.step_events: list[Any] = []
        self.events: list[Any] = []
        if cuda and gpu_steps:
            import torch

            # Made before the window: a CUDA event's creation is not what a step costs.
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(gpu_steps * 40)]

    def event(self) -> Any:
        event = self.events.pop()
        event.record()
        return event

    def step(self, global_step: int) -> None:
        if self.host_from <= global_step <= self.gpu_from:
            self.starts.append(time.perf_counter())  # the window's last start ends its last step
        if global_step >= self.gpu_from:
            self.mode = "gpu"
            self.step_events.append(self.event())
        elif global_step >= self.host_from:
            self.mode = "host"

    def __call__(self, name: str) -> Any:
        if self.mode == "host":
            return _Host(self, name)
        if self.mode == "gpu":
            return _Gpu(self, name)
        return self.untimed

    def done(self) -> dict[str, Any]:
        """The run's figures, per step, in microseconds."""
        if self.mode == "host":  # no GPU window: the loop's end ends the last step
            self.starts.append(time.perf_counter())
        steps = len(self.starts) - 1
        if steps < 2:
            raise RuntimeError("no steps in the host window: raise --total-timesteps")
        elapsed = self.starts[-1] - self.starts[0]
        result: dict[str, Any] = {
            "steps_per_s": steps / elapsed,
            "timed_steps": steps,
            "host_us": {k: 1e6 * v / steps for k, v in self.host.items()},
            "step_host_us": 1e6 * elapsed / steps,
        }
        result["host_us"]["loop"] = result["step_host_us"] - sum(result["host_us"].values())
        if self.step_events:
            import torch

            self.step_events.append(self.event())
            torch.cuda.synchronize()
            gpu_steps = len(self.step_events) - 1
            gpu: dict[str, float] = {}
            for name, start, end in self.spans:
                gpu[name] = gpu.get(name, 0.0) + 1e3 * start.elapsed_time(end) / gpu_steps
            first, last = self.step_events[0], self.step_events[-1]
            result["step_gpu_us"] = 1e3 * first.elapsed_time(last) / gpu_steps
            result["gpu_us"] = gpu
            result["gpu_steps"] = gpu_steps
        return result


# -- One run: the stand-ins, the variant's class, the instrumented script ---------------------


def stand_ins() -> None:
    """What every variant runs with (the module docstring says why)."""
    wandb = types.ModuleType("wandb")
    wandb.init = wandb.log = wandb.finish = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    sys.modules["wandb"] = wandb

    import tensordict
    from tensordict.nn import TensorDictModule

    owner = next(c for c in type(tensordict.TensorDict()).__mro__ if "to_module" in c.__dict__)
    to_module = owner.__dict__["to_module"]

    @functools.wraps(to_module)
    def to_module_as_in_2024(self: Any, module: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preserve_module_state", False)
        return to_module(self, module, **kwargs)

    setattr(owner, "to_module", to_module_as_in_2024)  # noqa: B010  (a method replaced)
    write = TensorDictModule._write_to_tensordict

    @functools.wraps(write)
    def write_first_outputs(
        self: Any, tensordict: Any, tensors: Any, *args: Any, **kwargs: Any
    ) -> Any:
        out_keys = kwargs.get("out_keys") or (args[1] if len(args) > 1 else None)
        keys = self.out_keys_source if out_keys is None else out_keys
        return write(self, tensordict, tensors[: len(keys)], *args, **kwargs)

    setattr(TensorDictModule, "_write_to_tensordict", write_first_outputs)  # noqa: B010


def use_variant(variant: str, emulate: bool) -> None:
    """Make ``tensordict.nn.CudaGraphModule`` the variant's class."""
    if variant in ("tensordict", "eager"):
        return
    import tensordict.nn

    from cudagraph_td import CudaGraphModule

    options: dict[str, Any] = {"backend": "emulate"} if emulate else {}
    if variant == "borrowed":
        options["outputs"] = "borrowed"
    setattr(tensordict.nn, "CudaGraphModule", functools.partial(CudaGraphModule, **options))  # noqa: B010


def script_args(args: argparse.Namespace, variant: str) -> list[str]:
    return [
        f"--total-timesteps={args.total_timesteps}",
        f"--learning-starts={args.learning_starts}",
        "--no-compile",
        "--no-cudagraphs" if variant == "eager" else "--cudagraphs",
        *(["--no-cuda"] if args.emulate else []),
    ]


def run_child(args: argparse.Namespace) -> None:
    """One run in this process; its figures go to ``args.result`` as JSON."""
    stand_ins()
    use_variant(args.variant, args.emulate)
    import tensordict.nn
    import torch

    path = pathlib.Path(args.leanrl_dir) / SCRIPTS[args.script]
    code = instrument(path.read_text(), str(path))
    cuda = torch.cuda.is_available() and not args.emulate
    parts = Parts(
        args.learning_starts, args.total_timesteps, args.warmup_steps, args.gpu_steps, cuda
    )
    sys.argv = [str(path), *script_args(args, args.variant)]
    namespace = {"__name__": "__main__", "__file__": str(path), "__parts__": parts}
    if args.emulate:
        from cudagraph_td import _compat

        context: Any = _compat.capturable_on_cpu()  # the eager and tensordict runs' optimizers
    else:
        context = contextlib.nullcontext()
    with context:
        exec(code, namespace)
    result = parts.done()
    wrapper = tensordict.nn.CudaGraphModule  # what the script's import found
    options = getattr(wrapper, "keywords", {})
    wrapper = getattr(wrapper, "func", wrapper)
    result.update(
        wrapper=f"{wrapper.__module__}.{wrapper.__qualname__}{options or ''}",
        script=args.script,
        variant=args.variant,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        torch=torch.__version__,
        tensordict=tensordict.__version__,
    )
    pathlib.Path(args.result).write_text(json.dumps(result))


# -- The runs, and their tables ---------------------------------------------------------------


def run_once(args: argparse.Namespace, script: str, variant: str) -> dict[str, Any]:
    """One run in a fresh process; raises RuntimeError with the tail of its output if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", "--script", script, "--variant", variant]
        command += ["--result", str(result), *args.passed]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])
        )
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=args.timeout
            )
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"no result within {args.timeout} s") from err
        if done.returncode or not result.exists():
            lines = (done.stdout + done.stderr).strip().splitlines()
            raise RuntimeError(
                f"exit {done.returncode}:\n    " + "\n    ".join(lines[-args.tail :])
            )
        found: dict[str, Any] = json.loads(result.read_text())
        return found


def _median(runs: list[dict[str, Any]], key: str, part: str | None = None) -> float | None:
    values = [r.get(key) if part is None else r.get(key, {}).get(part) for r in runs]
    found = [float(v) for v in values if v is not None]
    return statistics.median(found) if found else None


def _cell(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(script: str, runs: dict[str, list[dict[str, Any]]], failed: dict[str, str]) -> str:
    """The markdown tables of one script: steps per second, then the step's breakdown."""
    names = [v for v in runs if runs[v]]
    rate = {v: _median(runs[v], "steps_per_s") for v in names}
    lines = [
        f"### {script}",
        "",
        "| variant | steps/s (median) | runs | / tensordict |",
        "|---|---|---|---|",
    ]
    for v in names:
        each = ", ".join(f"{r['steps_per_s']:.0f}" for r in runs[v])
        ratio = rate[v] / rate["tensordict"] if rate.get("tensordict") else None  # type: ignore[operator]
        lines.append(f"| {v} | {_cell(rate[v])} | {each} | {_cell(ratio, 3)} |")
    for v, why in failed.items():
        lines.append(f"| {v} | failed: {why.strip().splitlines()[-1].strip()[:100]} | | |")
    if not names:
        return "\n".join(lines)
    lines += ["", "Time per step, microseconds (host / GPU; median over runs):", ""]
    lines.append("| part | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for part in (*PARTS, "loop"):
        cells = [
            f"{_cell(_median(runs[v], 'host_us', part), 1)} / {_cell(_median(runs[v], 'gpu_us', part), 1)}"
            for v in names
        ]
        if any(c != "n/a / n/a" for c in cells):
            lines.append(f"| {part} | " + " | ".join(cells) + " |")
    steps = [
        f"{_cell(_median(runs[v], 'step_host_us'), 1)} / {_cell(_median(runs[v], 'step_gpu_us'), 1)}"
        for v in names
    ]
    lines.append("| **step** | " + " | ".join(steps) + " |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> None:
    scripts = [s.strip() for s in args.scripts.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name, known in (("script", SCRIPTS), ("variant", VARIANTS)):
        chosen = scripts if name == "script" else variants
        unknown = [c for c in chosen if c not in known]
        if unknown:
            sys.exit(f"unknown {name}(s) {unknown}: choose from {list(known)}")
    missing = [s for s in scripts if not (pathlib.Path(args.leanrl_dir) / SCRIPTS[s]).exists()]
    if missing:
        sys.exit(
            f"{args.leanrl_dir} lacks {[SCRIPTS[s] for s in missing]}: run `bash scripts/fetch_leanrl.sh`"
        )
    print(
        f"LeanRL's {', '.join(scripts)} on HalfCheetah-v4: {args.total_timesteps} steps, learning from "
        f"{args.learning_starts}, {args.warmup_steps} untimed, the GPU window the last "
        f"{args.gpu_steps}; {args.runs} runs a variant{' (CPU emulation)' if args.emulate else ''}",
        flush=True,
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {v: [] for v in variants} for s in scripts
    }
    failed: dict[str, dict[str, str]] = {s: {} for s in scripts}
    first: dict[str, Any] = {}
    for r in range(args.runs):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            for script in scripts:
                if variant in failed[script]:
                    continue
                try:
                    result = run_once(args, script, variant)
                except Exception as err:
                    failed[script][variant] = str(err)
                    print(f"{script} / {variant}: failed, {err}", flush=True)
                    continue
                first = first or result
                runs[script][variant].append(result)
                rate = f"{result['steps_per_s']:.0f} steps/s"
                print(f"{script} / {variant} run {r + 1}: {rate} ({result['wrapper']})", flush=True)
    if first:
        print(f"\n{first['device']}, torch {first['torch']}, tensordict {first['tensordict']}")
    for script in scripts:
        print("\n" + table(script, runs[script], failed[script]))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("passed", "child")}
        report = {"settings": settings, "runs": runs, "failed": failed}
        (out / "leanrl_scripts.json").write_text(json.dumps(report, indent=1))
        print(f"\nwritten: {out / 'leanrl_scripts.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scripts", default="td3,sac", help="comma-separated: td3, sac")
    p.add_argument("--variants", default="tensordict,cudagraph_td,borrowed", help=f"of {VARIANTS}")
    p.add_argument("--runs", type=int, default=3, help="runs a variant (median reported)")
    p.add_argument("--total-timesteps", type=int, default=2500, help="the scripts' own argument")
    p.add_argument("--learning-starts", type=int, default=1000, help="the scripts' own argument")
    p.add_argument("--warmup-steps", type=int, default=100, help="learning steps not timed")
    p.add_argument("--gpu-steps", type=int, default=200, help="last steps, with CUDA events")
    p.add_argument("--leanrl-dir", default=str(ROOT / ".leanrl"), help="where the scripts are")
    p.add_argument("--out", help="folder for leanrl_scripts.json")
    p.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    p.add_argument("--tail", type=int, default=15, help="lines of a failed run's output shown")
    p.add_argument("--emulate", action="store_true", help="CPU: cudagraph_td's emulation")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--script", choices=SCRIPTS, help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.child:
        run_child(args)
        return
    if args.warmup_steps + args.gpu_steps + 3 > args.total_timesteps - args.learning_starts:
        parser().error(
            "--total-timesteps must leave steps to time after --learning-starts, "
            "--warmup-steps and --gpu-steps"
        )
    # The settings a run needs, passed on to each child.
    args.passed = [
        f"--total-timesteps={args.total_timesteps}",
        f"--learning-starts={args.learning_starts}",
        f"--warmup-steps={args.warmup_steps}",
        f"--gpu-steps={args.gpu_steps}",
        f"--leanrl-dir={args.leanrl_dir}",
        *(["--emulate"] if args.emulate else []),
    ]
    run_all(args)


if __name__ == "__main__":
    main()
