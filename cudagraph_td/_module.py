"""``CudaGraphModule``: warm up, capture and replay a function, a module or a TensorDictModule."""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal

import torch

from . import _errors, _graph, _replay, _tdmodule, _verify
from ._backend import Backend, check_options, make_backend
from ._compat import interaction_type
from ._replay import MISS

BackendName = Literal["auto", "cuda", "emulate"]

# What changes what the function computes, and so needs a graph of its own: tensordict's
# interaction type (a stochastic policy captured while sampling must not replay its samples
# when called for its mode), grad mode (a graph captured for autograd under grad mode, a
# plain one under no_grad), a module's training mode (dropout), and the autocast state
# (None when autocast is off everywhere, else each device type's (enabled, dtype)).
Mode = tuple[Any, bool, Any, Any]
# A graph's key: its mode, and the call key that tells graphs of one mode apart (always
# None: one graph per mode).
GraphKey = tuple[Mode, Hashable]

# Read at every call, so bound once.
_is_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds only

_AUTOCAST_DEVICES = ("cuda", "cpu")


def _autocast_state() -> Any:
    if not _any_autocast():
        return None
    return tuple(
        (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    )


class CudaGraphModule:
    """Capture a function as a CUDA graph, then replay it at each call.

    A drop-in replacement for :class:`tensordict.nn.CudaGraphModule`. Calls ``1`` to
    ``warmup - 1`` run the function eagerly on a side stream; call ``warmup`` captures the
    graph and returns a real result; every later call copies its tensor inputs into the
    graph's static buffers, replays the graph on the caller's current stream, and returns
    the outputs in fresh memory, so that a result never changes when the wrapper is called
    again.

    Inputs and outputs may be any pytree of tensors, TensorDicts, tensorclasses and
    non-tensor constants, passed positionally or by keyword. Every replay checks its inputs
    against the captured ones (structure, shapes, dtypes, devices, constants) and raises an
    error that names the offending leaf, before anything is copied. In-place updates of
    input tensors by the function reach the caller, as in eager mode.

    A module with ``in_keys`` (a TensorDictModule), or a function given ``in_keys``, is
    called as a TensorDictModule is: with a TensorDict, whose ``in_keys`` entries feed the
    graph and which receives the written entries and is returned, or with keyword tensors
    named by the ``in_keys``, returning the ``out_keys``' values; ``tensordict_out=`` is
    accepted.

    The wrapper keeps one graph per mode that changes what the function computes: grad
    mode, a module's training mode, and tensordict's interaction type. In grad mode, when
    the captured outputs require grad, the forward and its backward are captured inside one
    autograd node (see [make_graphed_callables][cudagraph_td.make_graphed_callables]), so ``loss.backward()`` replays the
    backward graph; under ``torch.no_grad()`` a plain graph is captured.

    Without CUDA (and with ``backend="auto"``), the constructor warns once and every call
    runs the function directly. See [sharp edges][sharp-edges] for what a graph cannot capture.

    Args:
        module: The function, :class:`torch.nn.Module` or TensorDictModule to capture.
        warmup: The call that captures the graph; the calls before it are eager warm-ups.
            A ``torch.compile``d function needs enough warm-up calls to finish compiling:
            ``warmup=3`` (see [training steps][with-torchcompile]).
        in_keys: The input keys, for a module that takes a TensorDict. Taken from
            ``module.in_keys`` when the module has them.
        out_keys: The output keys, for a module that returns a TensorDict. Taken from
            ``module.out_keys`` when the module has them.
        device: The CUDA device of the graph. Defaults to the device of the first CUDA
            tensor input, else the current CUDA device.
        pool: A memory pool (``torch.cuda.graph_pool_handle()``, or another graph's
            ``pool()``) to share with other graphs. Defaults to a private pool.
        capture_error_mode: Passed to :meth:`torch.cuda.CUDAGraph.capture_begin`: one of
            ``"global"``, ``"thread_local"``, ``"relaxed"``.
        backend: ``"cuda"`` for CUDA graphs; ``"emulate"`` for the CPU emulation of their
            contract (static buffers, outputs overwritten at each replay), which lets the
            code that uses the wrapper be tested on a machine without a GPU (experimental);
            ``"auto"`` for ``"cuda"`` when CUDA is available, else eager calls.
        verify: How many replays, after the capture, also run the function eagerly on
            copies of their inputs and compare the results and the inputs updated in place,
            raising a [VerificationError][cudagraph_td.VerificationError] that names the
            first leaf that differs and its likely cause (see [sharp edges][sharp-edges]).
            A debugging aid: a verified replay synchronises the host and costs an eager
            call more. It cannot check a training step, nor a function that draws random
            numbers. Defaults to 0.

    Raises:
        ValueError: ``warmup``, ``capture_error_mode``, ``backend`` or ``verify`` has no valid
            value.
        RuntimeError: ``backend="cuda"`` on a machine without CUDA.

    Example:
        >>> import torch
        >>> from cudagraph_td import CudaGraphModule
        >>> def step(x, *, scale):
        ...     return {"y": x * scale, "norm": x.norm()}
        >>> graphed = CudaGraphModule(step, warmup=2, backend="emulate")
        >>> for _ in range(4):
        ...     x = torch.randn(8)
        ...     out = graphed(x, scale=2.0)
        >>> torch.testing.assert_close(out["y"], x * 2.0)
        >>> graphed(x, scale=3.0)
        Traceback (most recent call last):
        ...
        cudagraph_td.InputMismatchError: CudaGraphModule was captured with the non-tensor argument kwargs["scale"] = 2.0, but received 3.0. ...
        >>> try:
        ...     graphed(x, scale=3.0)
        ... except ValueError as err:  # an InputMismatchError is a ValueError
        ...     print(err.path, err.captured, err.received)
        kwargs["scale"] 2.0 3.0

        On a GPU, the same code with ``backend="auto"`` and CUDA tensors replays a CUDA graph:

        >>> graphed = CudaGraphModule(step)  # doctest: +SKIP
        >>> out = graphed(torch.randn(8, device="cuda"), scale=2.0)  # doctest: +SKIP
    """

    def __init__(
        self,
        module: Callable[..., Any],
        warmup: int = 2,
        in_keys: Any = None,
        out_keys: Any = None,
        device: torch.device | str | int | None = None,
        *,
        pool: Any = None,
        capture_error_mode: str = "global",
        backend: BackendName = "auto",
        verify: int = 0,
    ):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise _errors.invalid_option("warmup", warmup, "an integer greater than 0")
        if isinstance(verify, bool) or not isinstance(verify, int) or verify < 0:
            raise _errors.invalid_option("verify", verify, "an integer of 0 or more")
        check_options(backend, capture_error_mode)
        name = type(self).__name__
        if backend == "cuda" and not torch.cuda.is_available():
            raise _errors.no_cuda(name)
        self.module = module
        self._warmup = warmup
        self.in_keys, self.out_keys = _tdmodule.resolve_keys(name, module, in_keys, out_keys)
        self.device = None if device is None else torch.device(device)
        self._pool = pool
        self._capture_error_mode = capture_error_mode
        self._backend_name: str = backend
        if backend == "auto":
            self._backend_name = "cuda" if torch.cuda.is_available() else "eager"
        if self._backend_name == "eager":
            warnings.warn(
                "CudaGraphModule is created on a machine without CUDA: calls run the function "
                "eagerly, with no graph and no input checks.",
                UserWarning,
                stacklevel=2,
            )
        self._fn = module
        self._verifier = _verify.Verifier(name, module, verify) if verify else None
        self._layer: _tdmodule.TensorDictLayer | None = None
        if self.in_keys is not None:
            self._fn = _tdmodule.recording_writes(module)
            self._layer = _tdmodule.TensorDictLayer(name, self.in_keys, self.out_keys)
        self._has_training = hasattr(module, "training")
        self._graphs: dict[GraphKey, _graph.GraphRunner] = {}
        # The last call's mode and replay function (see `__call__`): none yet.
        self._last: tuple[Any, ...] = (None, None, None, None, _not_captured)
        # One call at a time: threads that share the wrapper take turns, so that none reads
        # another's static buffers (re-entrant: the function may call the wrapper).
        self._lock = threading.RLock()
        # The CUDA stream of the last call, and its device (see `_follow_stream`).
        self._stream: Any = None
        self._raw_stream: int | None = None
        self._stream_device: int | None = None

    def _mode(self) -> Mode:
        training = getattr(self.module, "training", None)
        return (interaction_type(), torch.is_grad_enabled(), training, _autocast_state())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The replay path. While the mode is the last call's (compared part by part, by
        # identity: no tuple built), the last call's graph replays, through its replay
        # function (see `_replay`), which answers MISS for a call it leaves to `_call`.
        self._lock.acquire()
        try:
            if self._raw_stream is not None and self._raw_stream != _raw_stream(  # type: ignore[misc]
                self._stream_device
            ):
                self._follow_stream()  # a call on another stream than the last one
            interaction, grad, training, autocast, replay = self._last
            if (
                interaction_type() is interaction
                and _is_grad_enabled() is grad
                and (not self._has_training or self.module.training is training)  # type: ignore[attr-defined]
                and (not _any_autocast() if autocast is None else _autocast_state() == autocast)
            ):
                out = replay(args, kwargs)
                if out is not MISS:
                    return out
            return self._call(args, kwargs)
        finally:
            self._lock.release()

    def _follow_stream(self) -> None:
        """Order this call's stream after the last call's: a replay overwrites the static
        buffers that the last one's copies may still be reading on its own stream."""
        stream = torch.cuda.current_stream(self._stream_device)
        if self._stream is not None:
            stream.wait_stream(self._stream)
        self._stream, self._raw_stream = stream, stream.cuda_stream

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The slow path: a warm-up, a capture, a replay checked in full, or a verified one."""
        runner = self._select()
        verifier = self._verifier
        backend = runner.backend
        if self._stream_device is None and backend is not None and backend.device.type == "cuda":
            self._stream_device = backend.device.index  # from now on, calls follow streams
            self._follow_stream()
        if verifier is not None and (runner.captured is None or not verifier.left):
            verifier = None  # only replays are verified, and only the first ones
        copies = None if verifier is None else verifier.copy_inputs(args, kwargs)
        if self._layer is not None:
            out = self._layer.call(runner, args, kwargs)
        else:
            out = runner.run(args, kwargs)
        if verifier is not None:
            assert runner.backend is not None and runner.captured is not None
            with _graph.capture_turn(self._lock):  # the function runs only under it
                verifier.check(
                    copies,
                    args,
                    kwargs,
                    out,
                    device=runner.backend.device,
                    training_step=runner.captured.training_step,
                )
        self._select()  # the replay path, once captured (or once the last replay is verified)
        return out

    def _select(self) -> _graph.GraphRunner:
        """Choose the graph of the current call by its key (the one place that does), and make
        its replay function the one that ``__call__`` tries."""
        mode = self._mode()
        key: GraphKey = (mode, None)
        runner = self._graphs.get(key)
        if runner is None:
            runner = self._graphs[key] = self._new_runner()
        if runner.captured is not None and runner.replay is None:
            runner.replay = self._replay_function(runner.captured)
        replay = runner.replay or _not_captured
        if self._verifier is not None and self._verifier.left:
            replay = _not_captured  # replays to verify take `_call`
        self._last = (*mode, replay)
        return runner

    def _replay_function(self, captured: _replay.Captured) -> _replay.ReplayFunction:
        """The replay path of a captured graph: its routes, from the TensorDict layer's
        readers and writers for a TensorDict module, else the fastest for the call."""
        if self._layer is not None:
            return _replay.replay_function(captured, self._layer.routes(captured))
        return _replay.replay_function(captured, _replay.default_routes(captured))

    def _new_runner(self) -> _graph.GraphRunner:
        make_backend = None
        if self._backend_name != "eager":
            make_backend = functools.partial(
                _make_runner_backend,
                self._backend_name,
                self.device,
                self._pool,
                self._capture_error_mode,
            )
        return _graph.GraphRunner(
            type(self).__name__, self._fn, self._warmup, make_backend, self._lock
        )

    def _current_runner(self) -> _graph.GraphRunner | None:
        return self._graphs.get((self._mode(), None))

    @property
    def counter(self) -> int:
        """How many calls ran before the first replay (warm-up calls, then the capture)."""
        runner = self._current_runner()
        return 0 if runner is None else runner.counter

    def reset(self) -> None:
        """Drop the captured graphs and their buffers; the next call starts the warm-up again."""
        self._graphs.clear()
        self._last = (None, None, None, None, _not_captured)

    @property
    def is_captured(self) -> bool:
        """Whether the graph of the current interaction type is captured, so calls replay it."""
        runner = self._current_runner()
        return runner is not None and runner.captured is not None

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's ``state_dict``, or ``{}`` for a function without one."""
        state_dict = getattr(self.module, "state_dict", None)
        return {} if state_dict is None else state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Load ``state_dict`` into the wrapped module, in place, so a captured graph sees it.

        Raises:
            TypeError: The wrapped function has no ``load_state_dict`` and the state is not empty.
        """
        load = getattr(self.module, "load_state_dict", None)
        if load is None:
            if state_dict:
                raise _errors.no_state_dict(type(self).__name__, self.module)
            return None
        return load(state_dict, *args, **kwargs)

    def _stage(self, runner: _graph.GraphRunner) -> str:
        if runner.captured is not None:
            return "captured: calls replay the graph"
        return f"warming up: {runner.counter} of {self._warmup - 1} warm-up calls done"

    def __repr__(self) -> str:
        if self._backend_name == "eager":
            state = "eager (no CUDA)"
        elif not self._graphs:
            state = f"warming up: 0 of {self._warmup - 1} warm-up calls done"
        else:  # one entry per mode the wrapper was called in, with its graph's stage
            state = "; ".join(
                f"{_mode_name(key)}: {self._stage(runner)}" for key, runner in self._graphs.items()
            )
        fields = {
            "module": repr(self.module).replace("\n", "\n    "),
            "warmup": self._warmup,
            "in_keys": self.in_keys,
            "out_keys": self.out_keys,
            "backend": repr(self._backend_name),
            "state": state,
        }
        body = ",\n".join(f"    {key}={value}" for key, value in fields.items())
        return f"{type(self).__name__}(\n{body}\n)"


def _not_captured(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The replay function of a graph not yet captured: every call takes the slow path."""
    return MISS


def _mode_name(key: GraphKey) -> str:
    (interaction, grad, training, autocast), _ = key
    parts = ["grad" if grad else "no_grad"]
    if training is not None:
        parts.append("train" if training else "eval")
    if interaction is not None:
        parts.append(f"interaction {interaction}")
    if autocast is not None:
        enabled = [
            f"{device} {str(dtype).removeprefix('torch.')}"
            for device, (on, dtype) in zip(_AUTOCAST_DEVICES, autocast, strict=True)
            if on
        ]
        parts.append(f"autocast {', '.join(enabled)}")
    return ", ".join(parts)


def _make_runner_backend(
    name: str,
    device: torch.device | None,
    pool: Any,
    capture_error_mode: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Backend:
    return make_backend(name, device, pool, capture_error_mode, (args, kwargs))
