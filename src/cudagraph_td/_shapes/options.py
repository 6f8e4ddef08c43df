"""The shape options of a wrapper as one value: ``Static()``, ``Exact()`` or ``Buckets()``.

Each is a small, immutable value that checks its fields when it is made, so a wrong option
raises where it is written. ``resolve`` turns the ``shapes=`` argument of a wrapper (a value,
or the shorthand ``"static"``, ``"exact"``, ``"buckets"``) into the value, which the graphs of
the wrapper read (`_shapes.graphs`).

The keywords that these values replace (``buckets=``, ``max_graphs=``, ``batch_dims=``,
``overflow=``, ``row_independent=``) are accepted for one release more: ``resolve`` folds them
into the value, with a ``FutureWarning`` that names the new spelling.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, TypedDict

from .._errors import inputs as _errors
from .._errors import shapes as _errors_shapes

_OVERFLOW = ("eager", "raise")


def _not_positive(number: Any) -> bool:
    return isinstance(number, bool) or not isinstance(number, int) or number < 1


def _check_limits(max_graphs: Any, overflow: Any) -> None:
    if _not_positive(max_graphs):
        raise _errors.invalid_option("max_graphs", max_graphs, "an integer greater than 0")
    if overflow not in _OVERFLOW:
        raise _errors.invalid_option("overflow", overflow, _OVERFLOW)


def _shown(value: Any) -> str:
    """A value as it is written: its fields that differ from their defaults, ``sizes`` first
    and by position."""
    shown = []
    for field in dataclasses.fields(value):
        current = getattr(value, field.name)
        if current == field.default:
            continue
        shown.append(repr(list(current)) if field.name == "sizes" else f"{field.name}={current!r}")
    return f"{type(value).__name__}({', '.join(shown)})"


@dataclass(frozen=True, kw_only=True, repr=False)
class _Limited:
    """The fields of `Static` and `Exact`: how many graphs per mode, and what comes past."""

    max_graphs: int = 8
    overflow: Literal["eager", "raise"] = "eager"

    def __post_init__(self) -> None:
        _check_limits(self.max_graphs, self.overflow)

    __repr__ = _shown


@dataclass(frozen=True, kw_only=True, repr=False)
class Static(_Limited):
    """One graph per mode (the default, also written ``shapes="static"``): a call of other
    input shapes raises an ``InputMismatchError``.

    ``max_graphs`` and ``overflow`` bound the graphs of the arguments declared ``static=``
    (one per value, per mode).

    Args:
        max_graphs: The most values of the ``static=`` arguments with a graph, per mode.
        overflow: What a call past ``max_graphs`` gets: ``"eager"`` (the function, run
            eagerly, after one ``GraphLimitWarning``) or ``"raise"`` (a ``RuntimeError``).

    Raises:
        ValueError: A field has no valid value.

    Examples:
        >>> from cudagraph_td import CudaGraphModule, Static
        >>> def update(x, update_actor):
        ...     return x * 2 if update_actor else x
        >>> graphed = CudaGraphModule(
        ...     update, static=("update_actor",), shapes=Static(max_graphs=2), backend="emulate"
        ... )
        >>> graphed
        CudaGraphModule(
            ...
            shapes=Static(max_graphs=2),
            state=warming up: 0 of 1 warm-up calls done
        )
    """


@dataclass(frozen=True, kw_only=True, repr=False)
class Exact(_Limited):
    """A graph per input shapes (also written ``shapes="exact"``), each captured on first
    sight after warm-up calls of its own.

    For any function: training steps, calls in grad mode, shapes beyond the batch (a short
    last minibatch gets its own graph). Only shapes vary: another dtype, device, structure
    or constant still raises.

    Args:
        max_graphs: The most graphs per mode, one per input shapes; also the most values of
            the ``static=`` arguments with graphs, per mode.
        overflow: What a call past ``max_graphs`` gets: ``"eager"`` (the function, run
            eagerly, after one ``GraphLimitWarning``) or ``"raise"`` (a ``RuntimeError``).

    Raises:
        ValueError: A field has no valid value.

    Examples:
        >>> import torch
        >>> from cudagraph_td import CudaGraphModule, Exact
        >>> graphed = CudaGraphModule(torch.tanh, shapes=Exact(max_graphs=4), backend="emulate")
        >>> for n in (8, 8, 8, 5, 5, 5):
        ...     out = graphed(torch.randn(n))
        >>> [(info.key, info.replays) for info in graphed.graphs()]
        [(((8,),), 1), (((5,),), 1)]
    """


@dataclass(frozen=True, repr=False)
class Buckets:
    """Batch dims padded to the next bucket size, whose graph replays; outputs sliced back
    (also written ``shapes="buckets"``).

    For functions whose output rows depend on their own input row only (policies,
    inference). The first time a bucket pads a call, the function is checked for it (see
    "Several shapes" in the docs' Sharp edges page); padding is refused in grad mode and
    for training steps unless ``row_independent=True``.

    Args:
        sizes: The bucket sizes, kept sorted as a tuple; the first capture captures them
            all, largest first, so that the smaller graphs reuse the largest one's memory.
            ``None`` (the default): powers of two, each captured on first sight.
        batch_dims: The number of leading dims of every input that are padded.
        overflow: What a call above the largest size or past ``max_graphs`` gets:
            ``"eager"`` (the function, run eagerly; past ``max_graphs``, after one
            ``GraphLimitWarning``) or ``"raise"`` (a ``RuntimeError``).
        row_independent: Declares that each output row depends only on its input row and
            that the function computes no loss over the batch: calls in grad mode and
            training steps are then padded too, and the padding is not checked.
        max_graphs: The most graphs captured on first sight, per mode: powers of two
            (without ``sizes``), or the combinations of sizes of several batch dims. The
            ``sizes`` of one batch dim are captured together, all of them, whatever their
            number. Also the most values of the ``static=`` arguments with graphs, per mode.

    Raises:
        ValueError: A field has no valid value.

    Examples:
        >>> import torch
        >>> from cudagraph_td import Buckets, CudaGraphModule
        >>> Buckets([64, 8, 16], overflow="raise")
        Buckets([8, 16, 64], overflow='raise')
        >>> graphed = CudaGraphModule(torch.tanh, shapes=Buckets([8, 16]), backend="emulate")
        >>> x = torch.randn(11, 3)
        >>> with torch.no_grad():  # grad mode pads only with row_independent=True
        ...     for _ in range(3):
        ...         out = graphed(x)  # padded to 16 rows, sliced back to 11
        >>> torch.testing.assert_close(out, x.tanh())
        >>> [info.key for info in graphed.graphs()]
        [(16,), (8,)]
    """

    sizes: Sequence[int] | None = None
    _: KW_ONLY
    batch_dims: int = 1
    overflow: Literal["eager", "raise"] = "eager"
    row_independent: bool = False
    max_graphs: int = 8

    def __post_init__(self) -> None:
        _check_limits(self.max_graphs, self.overflow)
        if _not_positive(self.batch_dims):
            raise _errors.invalid_option("batch_dims", self.batch_dims, "an integer greater than 0")
        if not isinstance(self.row_independent, bool):
            raise _errors.invalid_option("row_independent", self.row_independent, "True or False")
        if self.sizes is not None:
            sizes = list(self.sizes) if isinstance(self.sizes, list | tuple) else [None]
            if not sizes or any(_not_positive(size) for size in sizes):
                raise _errors.invalid_option("sizes", self.sizes, "a list of positive integers")
            # Sorted and hashable: equal lists give equal values, whatever their order.
            object.__setattr__(self, "sizes", tuple(sorted(set(sizes))))

    __repr__ = _shown


Shapes = Static | Exact | Buckets
"""The values of ``shapes=``."""

_SHORTHANDS: dict[str, type[Shapes]] = {"static": Static, "exact": Exact, "buckets": Buckets}

Static.__module__ = Exact.__module__ = Buckets.__module__ = "cudagraph_td"  # users import them


class DeprecatedOptions(TypedDict, total=False):
    """The keywords of a wrapper that ``shapes=`` values replace (deprecated)."""

    buckets: Sequence[int] | None  # Buckets.sizes
    max_graphs: int
    batch_dims: int
    overflow: Literal["eager", "raise"]
    row_independent: bool


_DEPRECATED = DeprecatedOptions.__optional_keys__


def resolve(name: str, shapes: Any, deprecated: Mapping[str, Any]) -> Shapes:
    """The ``shapes=`` value of a wrapper ``name`` (the deprecated keywords folded in). Warns (``FutureWarning``) at the wrapper's caller for such keywords.

    Raises:
        TypeError: A keyword that the wrapper does not take, or deprecated keywords beside a
            ``shapes=`` value.
        ValueError: ``shapes=`` or a deprecated keyword has no valid value.
    """
    for keyword in deprecated:
        if keyword not in _DEPRECATED:  # as Python would say, had the keywords not been kept
            raise TypeError(f"{name}.__init__() got an unexpected keyword argument {keyword!r}")
    if isinstance(shapes, Static | Exact | Buckets):
        if deprecated:
            merged = _merged(shapes, deprecated)
            raise _errors_shapes.keywords_beside_value(name, shapes, list(deprecated), merged)
        value = shapes
    elif isinstance(shapes, str) and shapes in _SHORTHANDS:
        value = _folded(name, shapes, deprecated) if deprecated else _SHORTHANDS[shapes]()
    else:
        raise _errors.invalid_option(
            "shapes",
            shapes,
            "Static(...), Exact(...) or Buckets(...) (from cudagraph_td), or one of "
            "'static', 'exact', 'buckets'",
        )
    return value


def _folded(name: str, shorthand: str, deprecated: Mapping[str, Any]) -> Shapes:
    """``shapes=shorthand`` and the deprecated keywords as one value, after a warning."""
    options = dict(deprecated)
    sizes = options.pop("buckets", None)
    if sizes is not None and shorthand != "buckets":
        raise _errors_shapes.buckets_without_mode(shorthand, sizes)
    kind = _SHORTHANDS[shorthand]
    fields = {field.name for field in dataclasses.fields(kind)}
    # Without buckets, batch_dims= and row_independent= had no effect; still checked.
    dropped = {keyword: value for keyword, value in options.items() if keyword not in fields}
    if dropped:
        Buckets(**dropped)
    kept = {keyword: value for keyword, value in options.items() if keyword in fields}
    value = Buckets(sizes, **kept) if kind is Buckets else kind(**kept)
    # Warned at the line that made the wrapper: here, `resolve`, the wrapper's `__init__`.
    message = _errors_shapes.deprecated_keywords(name, list(deprecated), value, list(dropped))
    warnings.warn(message, FutureWarning, stacklevel=4)
    return value


def _merged(value: Shapes, deprecated: Mapping[str, Any]) -> Shapes | None:
    """``value`` with the deprecated keywords' options, if they are fields of it and valid."""
    changes = {"sizes" if key == "buckets" else key: option for key, option in deprecated.items()}
    try:
        return dataclasses.replace(value, **changes)
    except (TypeError, ValueError):  # not a field of it, or not a valid value
        return None
