"""``make_graphed_callables``: torch's function of that name, for pytrees, TensorDicts and kwargs."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from .._capture import default_backend as _default_backend
from .._capture.autograd import Capture, DifferentiableCall
from .._capture.backend import can_borrow, check_options, make_backend
from .._capture.entry import MISS, GraphEntry
from .._compat import module_hooks
from .._errors import graphed as _errors_graphed
from .._errors import inputs as _errors
from .._errors import state as _errors_state
from .._state.search import modules_state
from .._values.routes import routes
from .._values.signature import Signature
from .._values.tree import flatten, flatten_call


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    sample_kwargs: Any = None,
    capture_error_mode: str = "global",
    backend: Literal["auto", "cuda", "emulate", "eager"] = "auto",
    outputs: Literal["fresh", "borrowed"] = "fresh",
) -> Any:
    """Capture callables' forward and backward as CUDA graphs inside one autograd node each.

    A drop-in replacement for ``torch.cuda.make_graphed_callables``: the same arguments
    and return types. Each callable is warmed up ``num_warmup_iters`` times (forward and
    backward) on a side stream, then its forward is captured, then the backward of that
    forward. Calling the result replays the forward graph; ``backward()`` through its
    outputs replays the backward graph. Several callables passed as a tuple share one memory
    pool: their forwards are captured in order and their backwards in reverse order, and
    must be replayed in those orders.

    Beyond torch's version: arguments and outputs may be any pytree of tensors, TensorDicts
    and constants; keyword arguments are given with ``sample_kwargs``; outputs that do not
    require grad and constant outputs are allowed; gradients are returned in fresh memory, so
    that two backward passes accumulate as in eager mode; every call's inputs are checked
    against the samples (see the docs' Sharp edges page), but for ``requires_grad``, which
    may differ, as with torch's (a backward that needs a gradient the graphs do not compute
    raises). A module captured in training mode runs its original forward in eval mode,
    and the reverse, as torch's does.

    Args:
        callables: A callable or ``torch.nn.Module``, or a tuple of them.
        sample_args: A tuple of sample arguments, or a tuple of such tuples (one per callable).
            Their tensors' ``requires_grad`` says which arguments get gradients. A list of
            sample tuples for one callable captures a graph pair per entry (a batch size
            each, say); a call replays the pair whose shapes it has.
        num_warmup_iters: The eager forward and backward runs before the capture.
        allow_unused_input: Accept an argument that requires grad but that the outputs do not
            depend on (its gradient is ``None``).
        pool: A memory pool to capture into (``torch.cuda.graph_pool_handle()``, or another
            graph's ``pool()``). Defaults to a new pool per shape, shared by the callables.
            Graph pairs of two shapes get two pools: a forward of one shape, then one of the
            other before the first one's backward, would otherwise overwrite what the first
            saved for its backward. A pool given here is shared by all the shapes: replay
            each forward's backward before another shape's forward.
        sample_kwargs: The sample keyword arguments: a dict, or a tuple of dicts; a list of
            dicts for a list of sample tuples.
        capture_error_mode: Passed to ``torch.cuda.CUDAGraph.capture_begin``.
        backend: ``"cuda"``; ``"emulate"`` for the CPU emulation of the graph contract
            (experimental, for tests); ``"eager"``: the callables are returned unchanged;
            ``"auto"`` for what ``set_default_backend`` or the ``CUDAGRAPH_TD_BACKEND``
            environment variable set, else ``"cuda"`` when CUDA is available, else the
            callables are returned unchanged, with a warning.
        outputs: ``"fresh"`` (the default): outputs and gradients in fresh memory.
            ``"borrowed"``: the forward's outputs and the backward's gradients are the graphs'
            own memory, as torch's function returns them (no copy), valid until the next
            replay of the same graph; any use after it, of them or of a view of them, raises
            a ``RuntimeError`` that says so (torch's reads the overwritten values). With
            ``zero_grad(set_to_none=True)`` before each backward (torch's documented loop),
            a parameter's ``.grad`` may be the lent gradient itself; accumulating into it over
            two backward passes then raises: accumulate with ``"fresh"``. See the docs'
            Borrowed outputs page.

    Returns:
        The graphed callable (the same module, with its ``forward`` replaced, for a module),
        or a tuple of them when ``callables`` is a tuple.

    Raises:
        TypeError: ``sample_args`` is not a tuple (of tuples), or the counts differ.
        ValueError: A module has hooks or buffers that require grad; an argument that
            requires grad is unused and ``allow_unused_input`` is ``False``.
        RuntimeError: Autocast with its cache enabled; a capture failure (see
            ``CudaGraphModule``); ``"cuda"`` (given, or picked by the switch) on a machine
            without CUDA.
        InputMismatchError: Raised by a graphed callable when it is called (a
            ``ValueError``): an input differs from the samples, or shares memory with an
            input that the callable updates in place (such updates reach the caller's
            tensors, as in eager mode).

    Examples:
        >>> import torch
        >>> from cudagraph_td import make_graphed_callables
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> x = torch.randn(16, 4)
        >>> net = make_graphed_callables(net, (x,), backend="emulate")
        >>> loss = net(torch.randn(16, 4)).pow(2).mean()
        >>> loss.backward()
        >>> net[0].weight.grad.shape
        torch.Size([8, 4])

        On a GPU, as with torch's function:

        >>> net = make_graphed_callables(net.cuda(), (x.cuda(),))  # doctest: +SKIP
    """
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
        sample_kwargs = ({} if sample_kwargs is None else sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = tuple({} for _ in callables)
    _check_samples(callables, sample_args, sample_kwargs)
    check_options(backend, capture_error_mode, outputs)
    for fn in callables:
        if isinstance(fn, torch.nn.Module):
            _check_module(fn)
    # "auto" resolved by the process's switch, else by whether CUDA is available.
    chosen = _default_backend.resolve(_errors.GRAPHED_CALLABLES, backend)
    if chosen.backend == "eager":
        if backend == "auto" and chosen.switch is None:
            warnings.warn(
                "make_graphed_callables is called on a machine without CUDA: the callables are "
                "returned unchanged. To test them on the CPU emulation of CUDA graphs, pass "
                'backend="emulate", or set CUDAGRAPH_TD_BACKEND=emulate for the whole program.',
                UserWarning,
                stacklevel=2,
            )
        return callables[0] if single else callables
    borrow = outputs == "borrowed" and can_borrow(_errors.GRAPHED_CALLABLES, chosen.backend)
    # Each callable's samples: one (args, kwargs) per shape, a graph pair for each.
    samples = [
        _shapes_of(args, kwargs) for args, kwargs in zip(sample_args, sample_kwargs, strict=True)
    ]
    shapes = max(len(each) for each in samples)
    # One pool per shape, shared by the callables of the call (forwards captured in order,
    # backwards in reverse, as they replay): the graphs of two shapes may be replayed in any
    # order, and what one forward saves for its backward must not lie in memory that the
    # other shape's graphs use. A pool given by the user is shared by all.
    backends = []
    for k in range(shapes):
        shape_pool = (
            torch.cuda.graph_pool_handle() if chosen.backend == "cuda" and pool is None else pool
        )
        example, _ = flatten([each[k] for each in samples if k < len(each)])
        backends.append(
            make_backend(
                chosen.backend, None, shape_pool, capture_error_mode, example, borrow=borrow
            )
        )
    device = backends[0].device
    if torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled():
        raise _errors_graphed.autocast_cache()
    # Each shape's captures, with the index of their callable, all warmed up first.
    in_pools: list[list[tuple[int, Capture]]] = [[] for _ in backends]
    for i, (fn, each) in enumerate(zip(callables, samples, strict=True)):
        described = getattr(fn, "__qualname__", None) or type(fn).__name__
        name = f"{_errors.GRAPHED_CALLABLES}({described})"  # its errors tell by it
        forward = fn.forward if isinstance(fn, torch.nn.Module) else fn
        for (args, kwargs), graph_backend, in_pool in zip(each, backends, in_pools, strict=False):
            call = flatten_call(args, kwargs)
            signature = Signature(name, call, device, allow_grad=True, function=forward)
            capture = Capture(name, forward, signature, graph_backend, [], allow_unused_input)
            # The emulation builds its static buffers from an eager result, and lent outputs
            # their own memory (see `_capture.backend`): they need one run.
            eager_run = chosen.backend == "emulate" or borrow
            capture.warmup(max(1, num_warmup_iters) if eager_run else num_warmup_iters)
            in_pool.append((i, capture))
    calls: list[list[DifferentiableCall]] = [[] for _ in callables]  # in the shapes' order
    for in_pool in in_pools:
        for _, capture in in_pool:  # forwards in order, backwards in reverse
            capture.capture_forward()
        for i, capture in reversed(in_pool):
            calls[i].append(capture.capture_backward(modules_state(callables[i])))
    graphed = tuple(_graphed(fn, mine) for fn, mine in zip(callables, calls, strict=True))
    return graphed[0] if single else graphed


def _shapes_of(args: Any, kwargs: Any) -> list[tuple[Any, dict[str, Any]]]:
    """A callable's samples, one ``(args, kwargs)`` per shape: a list of argument tuples
    (with a list of kwargs dicts, or one dict for all) means one graph pair per entry."""
    if not isinstance(args, list):
        return [(args, kwargs)]
    kwargs = kwargs if isinstance(kwargs, list) else [kwargs] * len(args)
    if len(kwargs) != len(args):
        raise _errors_graphed.sample_counts(len(args), len(args), len(kwargs))
    return list(zip(args, kwargs, strict=True))


def _check_samples(callables: tuple[Any, ...], sample_args: Any, sample_kwargs: Any) -> None:
    if not isinstance(sample_args, tuple):
        raise _errors_graphed.sample_args_not_tuples(sample_args)
    for samples in sample_args:  # one callable's
        if not _all(samples, tuple):
            raise _errors_graphed.sample_args_not_tuples(samples)
    if not isinstance(sample_kwargs, tuple) or not all(_all(k, dict) for k in sample_kwargs):
        raise _errors_graphed.sample_kwargs_not_dicts()
    if not len(callables) == len(sample_args) == len(sample_kwargs):
        raise _errors_graphed.sample_counts(len(callables), len(sample_args), len(sample_kwargs))


def _all(samples: Any, kind: type) -> bool:
    """Whether ``samples`` is one ``kind``, or a non-empty list of them (one per shape)."""
    if isinstance(samples, list):
        return bool(samples) and all(isinstance(each, kind) for each in samples)
    return isinstance(samples, kind)


def _check_module(module: torch.nn.Module) -> None:
    for name, sub in module.named_modules():
        for kind in module_hooks(sub):
            where = f"its submodule `{name}`" if name else "it"
            raise _errors_graphed.hooks_registered(type(module).__name__, where, kind)
    for name, buffer in module.named_buffers():
        if buffer.requires_grad:
            raise _errors_graphed.buffer_requires_grad(type(module).__name__, name)


def _graphed(fn: Any, calls: list[DifferentiableCall]) -> Any:
    """The graphed callable: the entry of each shape's call in turn, then the slow path of
    the call whose shapes match (or the first one's error)."""
    entries = []
    for call in calls:  # each captured already: no warm-up, no backend of their own
        entry = GraphEntry(None, call.name, call.name, fn, 1, None, routes)
        entry.fill(call)
        entries.append(entry)

    def graphed(*args: Any, **kwargs: Any) -> Any:
        for entry in entries:
            out = entry.replay(args, kwargs)
            if out is not MISS:
                return out
        # The slow path. As with torch's function, the inputs' `requires_grad` may differ
        # from the samples': the forward replays, and an input whose gradient the graph
        # does not compute refuses the backward (see `DifferentiableCall.ungraded`).
        flat = flatten_call(args, kwargs)
        call = next(
            (c for c in calls if c.signature.diagnose(flat, requires_grad=False) is None),
            calls[0],
        )
        if call.state is not None and not call.state.fresh():  # no recapture here: refuse
            raise _errors_state.replaced_after_capture(call.name, call.state.changes())
        tensors = call.signature.match(flat, requires_grad=False)
        return call.outputs.rebuild(call.launch(tensors, call.ungraded(tensors)))

    if not isinstance(fn, torch.nn.Module):
        return graphed
    original, training = fn.forward, fn.training

    def forward(*args: Any, **kwargs: Any) -> Any:
        # The graph holds the mode it was captured in; the other mode runs eagerly.
        if fn.training == training:
            return graphed(*args, **kwargs)
        return original(*args, **kwargs)

    fn.forward = forward
    return fn
