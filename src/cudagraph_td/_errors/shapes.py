"""The errors and warnings of ``shapes=``: batch dims, padding, and the number of graphs."""

from __future__ import annotations

import dataclasses
from typing import Any

from .inputs import InputMismatchError

_SHARP_EDGES = 'See the sharp edges page, "Several shapes".'


class GraphLimitWarning(UserWarning):
    """A call that no graph answers ran eagerly: past ``max_graphs`` graphs (shapes or
    static values), or a batch above the largest bucket. Issued once per reason; later
    such calls run eagerly in silence (``overflow="raise"`` refuses them instead), and
    ``graphs().eager_calls`` counts them."""


GraphLimitWarning.__module__ = "cudagraph_td"  # where users import it from


def no_batch_dims(name: str, path: str, shape: Any, batch_dims: int) -> InputMismatchError:
    received = "no tensor" if shape is None else f"shape {list(shape)}"
    message = (
        f'{name}(shapes="buckets") pads the {batch_dims} leading batch dim(s) of every input '
        f"tensor, but {path} has {received}. Pass values without batch dims as constants "
        f'(not tensors), set Buckets(batch_dims=...), or use shapes="exact". {_SHARP_EDGES}'
    )
    return InputMismatchError(message, path, captured=batch_dims, received=shape)


def batch_dims_differ(
    name: str, first: str, batch: Any, path: str, other: Any
) -> InputMismatchError:
    message = (
        f'{name}(shapes="buckets") pads every input to one batch size, but {first} has batch '
        f"dims {list(batch)} and {path} has {list(other)}. Give every input the same "
        f'leading dims, or use shapes="exact". {_SHARP_EDGES}'
    )
    return InputMismatchError(message, path, captured=batch, received=other)


def output_not_batched(name: str, path: str, shape: Any, padded: Any) -> RuntimeError:
    return RuntimeError(
        f'{name}(shapes="buckets") slices every output back to the call\'s rows, but {path} '
        f"has shape {list(shape)}, which does not start with the padded batch dims "
        f"{list(padded)}: a result computed across the batch (a mean, a loss) changes with "
        f'the padded rows. Return per-row outputs, or use shapes="exact". {_SHARP_EDGES}'
    )


def padding_refused(name: str, why: str) -> RuntimeError:
    return RuntimeError(
        f'{name}(shapes="buckets") does not pad {why}: padded rows would take part in the '
        'gradients or the loss. Use shapes="exact" (one graph per batch size), or pass '
        "shapes=Buckets(..., row_independent=True) if every output row depends on its own "
        f"input row only and the function computes no loss over the batch. {_SHARP_EDGES}"
    )


def input_returned_padded(name: str, output: str, input_path: str) -> ValueError:
    return ValueError(
        f'{name}(shapes="buckets") returns {output} as {input_path} or a view of it, which '
        "it cannot return on every call: a call padded to a bucket runs on a padded copy of "
        f"{input_path}, and a bucket's graph replays calls of fewer rows on its own buffers, so "
        "the output would be a copy instead of your tensor. Return a copy (`.clone()` the "
        "output), or use shapes=Exact() (one graph per batch size, which returns your tensor). "
        f"{_SHARP_EDGES}"
    )


# Why a call ran eagerly, as `graphs().eager_calls` and the log records count it.
PAST_MAX_GRAPHS = "past max_graphs"
PAST_MAX_STATIC_VALUES = "past max_graphs static values"
ABOVE_BUCKETS = "above the largest bucket"


def _above_buckets(name: str, batch: Any, buckets: Any, elsewhere: bool) -> str:
    """The start of the messages of a call above the largest bucket (``elsewhere``: a call of
    another rank of its DDP step)."""
    where = "and another rank of its DDP step a batch above" if elsewhere else "above"
    return (
        f"{name} received batch dims {list(batch)}, {where} its largest bucket {max(buckets)} "
        f"(sizes {list(buckets)})"
    )


def above_buckets_eager(name: str, batch: Any, buckets: Any, elsewhere: bool = False) -> str:
    """The ``GraphLimitWarning`` of a call above the largest bucket, with overflow="eager"."""
    return (
        f"{_above_buckets(name, batch, buckets, elsewhere)}: such calls run eagerly, without a "
        "graph (this warning is issued once; `graphs().eager_calls` counts them). Add a larger "
        f"size to Buckets, or pass Buckets(..., overflow='raise') to refuse them. {_SHARP_EDGES}"
    )


def above_buckets(name: str, batch: Any, buckets: Any, elsewhere: bool = False) -> RuntimeError:
    return RuntimeError(
        f"{_above_buckets(name, batch, buckets, elsewhere)}, with overflow='raise'. Add a "
        "larger size to Buckets, or pass Buckets(..., overflow='eager') to run such calls "
        "eagerly (on every rank)."
    )


def padding_moves_state(name: str, paths: list[str]) -> RuntimeError:
    shown = ", ".join(f"`{p}`" for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    return RuntimeError(
        f'{name}(shapes="buckets") does not pad a call of a function that updates the state '
        f"it reads in place ({shown}; put back as it was): the padded rows would move it, "
        "as a BatchNorm's running statistics in training mode. Call it in eval mode, use "
        'shapes="exact" (one graph per batch size), or pass shapes=Buckets(..., '
        f"row_independent=True) if the update does not depend on the rows. {_SHARP_EDGES}"
    )


def rows_depend_on_padding(name: str, path: str, batch: Any, size: Any) -> RuntimeError:
    return RuntimeError(
        f'{name}(shapes="buckets") padded a call of batch dims {list(batch)} to the bucket '
        f"{list(size)}, and checked it: the rows of {path} that the call keeps changed when "
        "only the padded rows did. The function computes across the batch (a mean, a "
        "softmax or a normalisation over dim 0), so a padded graph would answer wrongly. "
        f'Use shapes="exact" (one graph per batch size). {_SHARP_EDGES}'
    )


def too_many_graphs(
    name: str, max_graphs: int, seen: list[Any], overflow: str, what: str = "Shapes"
) -> str:
    """``what``: ``"Shapes"`` (graphs per shape) or ``"Static values"`` (per static value)."""
    action = "run eagerly" if overflow == "eager" else "raise this error"
    fix = (
        "use shapes=Buckets() to pad batch sizes to a few graphs"
        if what == "Shapes"
        else "pass the argument that takes many values as a tensor"
    )
    return (
        f"{name} reached max_graphs={max_graphs}: calls that need another graph {action}. "
        f"{what} with a graph: {'; '.join(map(str, seen))}. Raise max_graphs (a field of the "
        f"shapes= value: Static, Exact or Buckets), or {fix}. {_SHARP_EDGES}"
    )


def buckets_without_mode(shapes: str, sizes: Any) -> ValueError:
    sizes = list(sizes) if isinstance(sizes, list | tuple) else sizes
    return ValueError(
        f"`buckets=` is the list of batch sizes of shapes='buckets', but shapes={shapes!r}. "
        f"Pass `shapes=Buckets({sizes!r})` (from cudagraph_td) instead of both."
    )


def deprecated_keywords(name: str, keywords: list[str], value: Any, dropped: list[str]) -> str:
    """The warning for the keywords that ``shapes=`` values replace: ``value`` is the call's
    options as one value; ``dropped``, keywords that had no effect without buckets."""
    shown = ", ".join(f"{keyword}=" for keyword in keywords)
    left_out = ", ".join(f"{keyword}=" for keyword in dropped)
    note = f" ({left_out} had no effect without buckets: left out)" if dropped else ""
    return (
        f"{name}({shown}) is deprecated and will be removed in the next release: the shape "
        f"options are one value now. Pass `shapes={value!r}` instead (from cudagraph_td)"
        f"{note}."
    )


def keywords_beside_value(name: str, value: Any, keywords: list[str], merged: Any) -> TypeError:
    """Deprecated keywords beside a ``shapes=`` value; ``merged``: the value with their
    options, or None where it has no such fields or they are not valid."""
    shown = ", ".join(f"`{keyword}=`" for keyword in keywords)
    if merged is not None:
        fix = f"Pass `shapes={merged!r}` alone."
    else:
        fields = ", ".join(field.name for field in dataclasses.fields(value))
        fix = f"`{type(value).__name__}` takes {fields}: pass them as its fields."
    return TypeError(
        f"{name} got `shapes={value!r}` beside the deprecated keyword(s) {shown}: the shape "
        f"options are the fields of the shapes= value now. {fix}"
    )


def not_captured_after_precapture(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name}.precapture() ran the example, but the call ran eagerly instead of being "
        "captured (its batch is above the largest bucket, or max_graphs is reached)."
    )
