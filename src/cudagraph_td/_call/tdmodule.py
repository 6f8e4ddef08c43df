"""The TensorDict-module layer: ``in_keys`` and ``out_keys``, keyword calls, writes into the input.

A TensorDictModule reads its ``in_keys`` from a TensorDict, writes its ``out_keys`` into it,
and returns it. ``TensorDictLayer`` gives a captured module the same behaviour: it
accepts a TensorDict or keyword tensors named by the ``in_keys`` (through tensordict's own
``dispatch``), feeds the graph only the ``in_keys`` entries (other
entries are ignored, as the module ignores them), and writes the entries that the module
wrote into the caller's TensorDict (or ``tensordict_out``), which it returns.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, unravel_key
from tensordict.base import is_tensor_collection
from tensordict.nn import dispatch

from .._capture.captured import Captured
from .._errors import inputs as _errors
from .._shapes.graphs import Answer, Graphs
from .._values.input_views import is_module_input
from .._values.routes import key_tuple
from .._values.tree import flatten_call


def resolve_keys(name: str, module: Any, in_keys: Any, out_keys: Any) -> tuple[Any, Any]:
    """The keys a wrapper uses: the module's own when it has them, as tensordict does.

    Keys given as arguments that differ from the module's are ignored with a warning.
    """
    for attr, given in (("in_keys", in_keys), ("out_keys", out_keys)):
        own = getattr(module, attr, None)
        if own is not None and given and _as_keys(given) != _as_keys(own):
            warnings.warn(
                f"{name} ignores {attr}={given!r} because the module has its own "
                f"{attr}={own!r}, which it uses instead. Leave {attr} unset to silence this "
                "warning.",
                UserWarning,
                stacklevel=4,
            )
    in_keys = getattr(module, "in_keys", in_keys)
    out_keys = getattr(module, "out_keys", out_keys)
    if out_keys is None and in_keys is not None:
        out_keys = []
    return in_keys, out_keys


def _as_keys(keys: Any) -> list[Any]:
    keys = [keys] if isinstance(keys, str) else list(keys)
    return [unravel_key(key) for key in keys]


class TensorDictLayer:
    """Calls a graph with a TensorDict's ``in_keys`` entries, as a TensorDictModule is called.

    ``call`` is the full call, for a graph's warm-up, capture and slow path; ``routes``
    gives the replay path's readers and writers for the two common calls, ``module(td)`` and
    ``module(**tensors)``.
    """

    def __init__(
        self,
        name: str,
        in_keys: Sequence[Any],
        out_keys: Sequence[Any],
        *,
        module_reads_in_keys: bool = True,
    ):
        self.name = name
        self.in_keys = [unravel_key(key) for key in in_keys]
        self.out_keys = [unravel_key(key) for key in out_keys]
        # A module with in_keys of its own (a TensorDictModule) reads every one of them: a
        # call without one fails before the warm-up, with the error the module would raise.
        # A function given in_keys reads what it reads, as in eager mode (and tensordict's
        # class): an in_key that its TensorDicts never hold is no error.
        self._checks_in_keys = module_reads_in_keys
        # tensordict's own dispatch turns keyword tensors into a TensorDict and the result
        # into the out_keys' values, exactly as a TensorDictModule's forward does. Without
        # in_keys there is nothing to dispatch: the function takes a TensorDict.
        self._dispatched: Callable[..., Any] = self._call
        if self.in_keys:
            # Not the bound method: tensordict 0.14 skips a method's first parameter when it
            # looks for the one named `tensordict`, and finds `*args`.
            self._dispatched = dispatch(
                source=list(in_keys), dest=list(out_keys), auto_batch_size=False
            )(functools.partial(TensorDictLayer._call, self))

    def call(self, graphs: Graphs, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Answer:
        """Call the module's graph, which ``graphs`` (the mode's) run, as the module is
        called: the result, and the entry of the graph that answered (see
        `_shapes.graphs.Answer`)."""
        # The graphs go through dispatch as a keyword that no in_key can be named, with
        # whether the call is one of keyword tensors (dispatch makes their TensorDict), and
        # the list that receives the graphs' answer.
        # Positional tensors are in_keys values too (dispatch makes their TensorDict, of
        # batch size []), as keyword tensors are: the same graph as a TensorDict call's.
        keywords = "tensordict" not in kwargs and not any(map(is_tensor_collection, args))
        answers: list[Answer] = []
        result = self._dispatched(*args, **kwargs, **{_GRAPHS: (graphs, keywords, answers)})
        return answers[0]._replace(result=result)

    def _call(self, tensordict: Any, *args: Any, **kwargs: Any) -> Any:
        graphs, keywords, answers = kwargs.pop(_GRAPHS)
        tensordict_out: TensorDictBase | None = kwargs.pop("tensordict_out", None)
        if not is_tensor_collection(tensordict):
            raise _errors.not_a_tensordict(self.name, self.in_keys, tensordict)
        inputs = tensordict
        if self.in_keys:
            # After the capture, the full check refuses a call that lacks an entry the
            # graph reads.
            if graphs.captured is None and self._checks_in_keys:
                keys = tensordict.keys(include_nested=True, leaves_only=False)
                missing = [key for key in self.in_keys if key not in keys]
                if missing:
                    raise _errors.missing_in_keys(self.name, missing)
            inputs = _batched_as_out(tensordict.select(*self.in_keys, strict=False), tensordict_out)
            if graphs.captured is not None:
                inputs = _as_captured(inputs, graphs.captured, keywords)
        elif tensordict_out is not None:
            # A function that writes into its input writes into a copy, whose entries then
            # go to `tensordict_out`: the caller's TensorDict is left as it was.
            inputs = _batched_as_out(tensordict.copy(), tensordict_out)
        try:
            answer = graphs.run(flatten_call((inputs, *args), kwargs))
        except (_errors.InputMismatchError, _errors.InputKeyError, RuntimeError) as err:
            # The full check named the TensorDict that dispatch made (`args[0]`): a keyword
            # call is told about its keywords (missing, or of another shape, dtype, device or
            # `requires_grad`); any other error is raised as it is.
            captured = graphs.captured
            if not keywords or captured is None:
                raise
            raise self._keyword_error(captured, inputs) or err from None
        answers.append(answer)
        out = answer.result
        target = tensordict if tensordict_out is None else tensordict_out
        if is_module_input(out):
            return target.update(out[1])
        if tensordict_out is not None and is_tensor_collection(out):
            return tensordict_out.update(out)
        return out

    def _keyword_error(self, captured: Captured, inputs: Any) -> Exception | None:
        """For a keyword call that the graph refused, the error that names the first keyword
        tensor that differs from the captured entry, as the user passed it
        (``kwargs["observation"]``); None if none does (the full check's error stands)."""
        static = captured.signature.static_args
        if len(static) != 1 or not is_tensor_collection(static[0]):
            return None
        pairs = [
            (
                f'kwargs["{"_".join(key_tuple(key))}"]',
                static[0].get(key, None),
                inputs.get(key, None),
            )
            for key in self.in_keys
        ]
        missing = [where for where, old, new in pairs if old is not None and new is None]
        if missing:
            return _errors.missing_keywords(self.name, missing)
        for where, old, new in pairs:
            if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
                error = captured.signature.diagnose_tensor(where, old, new)
                if error is not None:
                    return error
        return None


_GRAPHS = "_cudagraph_td_graphs"


def _batched_as_out(inputs: Any, tensordict_out: TensorDictBase | None) -> Any:
    """``inputs`` (a new TensorDict) with ``tensordict_out``'s batch size when that is a
    prefix of theirs, as a TensorDictModule writes its outputs into ``tensordict_out``: a
    loss or metrics (scalars) written into ``TensorDict()`` (LeanRL's PPO update), which the
    inputs' batch size would refuse."""
    if tensordict_out is not None:
        batch_size = tensordict_out.batch_size
        if inputs.batch_size[: len(batch_size)] == batch_size:
            inputs.batch_size = batch_size
    return inputs


def _as_captured(inputs: Any, captured: Captured, keywords: bool) -> Any:
    """The ``in_keys`` entries of a call, with the batch size and the layout of the graph's
    TensorDict where the call's differ; the module reads the same tensors either way.

    The batch size, when the call's lacks one: a graph captured from ``module(td)`` also
    answers keyword calls (whose TensorDict, made by dispatch, has batch size ``[]``), and
    one captured from a keyword call answers ``module(td)``. The layout: a graph captured
    on a lazy stack replays a dense TensorDict's entries (unbound into one per stacked
    TensorDict: views, no copy), and a graph captured on a dense TensorDict a lazy stack's
    (stacked: a copy), as the module reads them eagerly. Other layouts, and entries that do
    not fit, are left to the full check."""
    static = captured.signature.static_args
    layout = static[0] if static and is_tensor_collection(static[0]) else None
    if layout is None:
        return inputs
    batch_size = layout.batch_size
    if inputs.batch_size != batch_size and (keywords or batch_size == ()):
        with contextlib.suppress(RuntimeError):  # entries of other shapes: the check says
            inputs.batch_size = batch_size
    if type(inputs) is type(layout):
        return inputs
    with contextlib.suppress(RuntimeError, ValueError):  # the full check says what differs
        if type(layout) is LazyStackedTensorDict and type(inputs) is TensorDict:
            dim = layout.stack_dim
            if inputs.batch_size == layout.batch_size:
                return LazyStackedTensorDict(*inputs.unbind(dim), stack_dim=dim)
        elif type(layout) is TensorDict and type(inputs) is LazyStackedTensorDict:
            return inputs.to_tensordict()
    return inputs
