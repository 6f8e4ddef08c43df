"""``make_graphed_callables``: torch's function of that name, for pytrees, TensorDicts and kwargs."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from . import _errors, _errors_state, _replay
from ._autograd import Capture, DifferentiableCall
from ._backend import check_options, make_backend
from ._compat import module_hooks
from ._replay import MISS
from ._signature import Signature
from ._training import modules_state


def make_graphed_callables(
    callables: Any,
    sample_args: Any,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool: Any = None,
    *,
    sample_kwargs: Any = None,
    capture_error_mode: str = "global",
    backend: Literal["auto", "cuda", "emulate"] = "auto",
) -> Any:
    """Capture callables' forward and backward as CUDA graphs inside one autograd node each.

    A drop-in replacement for :func:`torch.cuda.make_graphed_callables`: the same arguments
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
    against the samples (see [sharp edges][sharp-edges]). A module captured in training
    mode runs its original forward in eval mode, and the reverse, as torch's does.

    Args:
        callables: A callable or :class:`torch.nn.Module`, or a tuple of them.
        sample_args: A tuple of sample arguments, or a tuple of such tuples (one per callable).
            Their tensors' ``requires_grad`` says which arguments get gradients.
        num_warmup_iters: The eager forward and backward runs before the capture.
        allow_unused_input: Accept an argument that requires grad but that the outputs do not
            depend on (its gradient is ``None``).
        pool: A memory pool to capture into (``torch.cuda.graph_pool_handle()``, or another
            graph's ``pool()``). Defaults to a new pool shared by the callables.
        sample_kwargs: The sample keyword arguments: a dict, or a tuple of dicts.
        capture_error_mode: Passed to :meth:`torch.cuda.CUDAGraph.capture_begin`.
        backend: ``"cuda"``; ``"emulate"`` for the CPU emulation of the graph contract
            (experimental, for tests); ``"auto"`` for ``"cuda"`` when CUDA is available, else
            the callables are returned unchanged, with a warning.

    Returns:
        The graphed callable (the same module, with its ``forward`` replaced, for a module),
        or a tuple of them when ``callables`` is a tuple.

    Raises:
        TypeError: ``sample_args`` is not a tuple (of tuples), or the counts differ.
        ValueError: A module has hooks or buffers that require grad; an argument that
            requires grad is unused and ``allow_unused_input`` is ``False``.
        RuntimeError: Autocast with its cache enabled; a capture failure (see
            :class:`CudaGraphModule`).

    Example:
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
    _check_arguments(
        callables, sample_args, sample_kwargs, num_warmup_iters, capture_error_mode, backend
    )
    if backend == "auto":
        if not torch.cuda.is_available():
            warnings.warn(
                "make_graphed_callables is called on a machine without CUDA: the callables are "
                "returned unchanged.",
                UserWarning,
                stacklevel=2,
            )
            return callables[0] if single else callables
        backend = "cuda"
    if backend == "cuda" and pool is None:
        pool = torch.cuda.graph_pool_handle()  # one pool for all the callables of the call
    graph_backend = make_backend(
        backend, None, pool, capture_error_mode, (sample_args, sample_kwargs)
    )
    if torch.is_autocast_enabled(graph_backend.device.type) and torch.is_autocast_cache_enabled():
        raise _errors.autocast_cache()
    captures = []
    for fn, args, kwargs in zip(callables, sample_args, sample_kwargs, strict=True):
        name = f"make_graphed_callables({_describe(fn)})"
        forward = fn.forward if isinstance(fn, torch.nn.Module) else fn
        signature = Signature(name, args, kwargs, graph_backend.device, allow_grad=True)
        capture = Capture(name, forward, signature, graph_backend, [], allow_unused_input)
        # The emulation builds its static buffers from an eager result: it needs one run.
        capture.warmup(num_warmup_iters if backend == "cuda" else max(1, num_warmup_iters))
        captures.append(capture)
    # One pool for all: forwards in order, backwards in reverse, as they will replay.
    for capture in captures:
        capture.capture_forward()
    calls = [
        capture.capture_backward(modules_state(fn))
        for fn, capture in zip(callables[::-1], reversed(captures), strict=True)
    ][::-1]
    graphed = tuple(_graphed(fn, call) for fn, call in zip(callables, calls, strict=True))
    return graphed[0] if single else graphed


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _check_arguments(
    callables: tuple[Any, ...],
    sample_args: Any,
    sample_kwargs: Any,
    num_warmup_iters: int,
    capture_error_mode: str,
    backend: str,
) -> None:
    if not isinstance(sample_args, tuple) or not all(isinstance(a, tuple) for a in sample_args):
        raise _errors.sample_args_not_tuples(sample_args)
    if not isinstance(sample_kwargs, tuple) or not all(isinstance(k, dict) for k in sample_kwargs):
        raise _errors.sample_kwargs_not_dicts()
    if not len(callables) == len(sample_args) == len(sample_kwargs):
        raise _errors.sample_counts(len(callables), len(sample_args), len(sample_kwargs))
    check_options(backend, capture_error_mode)
    for fn in callables:
        if isinstance(fn, torch.nn.Module):
            _check_module(fn)


def _check_module(module: torch.nn.Module) -> None:
    for name, sub in module.named_modules():
        for kind in module_hooks(sub):
            where = f"its submodule `{name}`" if name else "it"
            raise _errors.hooks_registered(type(module).__name__, where, kind)
    for name, buffer in module.named_buffers():
        if buffer.requires_grad:
            raise _errors.buffer_requires_grad(type(module).__name__, name)


def _graphed(fn: Any, call: DifferentiableCall) -> Any:
    replay = _replay.replay_function(call, _replay.default_routes(call))

    def graphed(*args: Any, **kwargs: Any) -> Any:
        out = replay(args, kwargs)
        if out is not MISS:
            return out
        if call.state is not None and not call.state.fresh():  # no recapture here: refuse
            raise _errors_state.replaced_after_capture(call.name, call.state.changes())
        return _replay.call(call, args, kwargs)

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
