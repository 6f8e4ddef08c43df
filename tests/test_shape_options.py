"""``shapes=`` values: ``Static``, ``Exact`` and ``Buckets``, their checks, and the keywords
that they replace (deprecated, still accepted with a ``FutureWarning``)."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import tensordict.nn
import torch

import cudagraph_td
from cudagraph_td import Buckets, CudaGraphModule, Exact, Static

from .conftest import Backend

VALUES = [
    pytest.param(Static(), "Static()", id="static"),
    pytest.param(
        Static(max_graphs=2, overflow="raise"),
        "Static(max_graphs=2, overflow='raise')",
        id="static-limits",
    ),
    pytest.param(Exact(), "Exact()", id="exact"),
    pytest.param(Exact(max_graphs=16), "Exact(max_graphs=16)", id="exact-max-graphs"),
    pytest.param(Buckets(), "Buckets()", id="buckets"),
    pytest.param(Buckets([64, 8, 16, 8]), "Buckets([8, 16, 64])", id="buckets-sizes"),
    pytest.param(Buckets(batch_dims=2), "Buckets(batch_dims=2)", id="buckets-batch-dims"),
    pytest.param(
        Buckets((8,), batch_dims=2, overflow="raise", row_independent=True, max_graphs=4),
        "Buckets([8], batch_dims=2, overflow='raise', row_independent=True, max_graphs=4)",
        id="buckets-all",
    ),
]


@pytest.mark.parametrize(("value", "shown"), VALUES)
def test_a_value_reads_as_it_is_written(value: Any, shown: str) -> None:
    assert repr(value) == shown
    assert eval(shown, vars(cudagraph_td)) == value  # the repr makes the same value


@pytest.mark.parametrize(("value", "shown"), VALUES)
def test_a_value_is_immutable_hashable_and_pickles(value: Any, shown: str) -> None:
    field = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, 1)
    assert {value: 1}[copy.deepcopy(value)] == 1
    assert pickle.loads(pickle.dumps(value)) == value
    assert type(pickle.loads(pickle.dumps(value))).__module__ == "cudagraph_td"


def test_buckets_sizes_are_kept_sorted_as_a_tuple() -> None:
    assert Buckets([16, 8, 16]).sizes == (8, 16)
    assert Buckets([16, 8]) == Buckets((8, 16)) and Buckets([8]) != Buckets()
    assert Exact() != Static() and Exact(max_graphs=8) == Exact()


def test_fields_past_sizes_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Exact(4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Static(4)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Buckets([8], 2)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Static(max_graphs=0),
            "`max_graphs` must be an integer greater than 0, got 0.",
        ),
        (
            lambda: Exact(max_graphs=True),
            "`max_graphs` must be an integer greater than 0, got True.",
        ),
        (
            lambda: Exact(overflow="drop"),
            "`overflow` must be one of 'eager', 'raise', got 'drop'.",
        ),
        (
            lambda: Buckets([0, 4]),
            "`sizes` must be a list of positive integers, got [0, 4].",
        ),
        (lambda: Buckets([]), "`sizes` must be a list of positive integers, got []."),
        (lambda: Buckets(8), "`sizes` must be a list of positive integers, got 8."),
        (
            lambda: Buckets(batch_dims=0),
            "`batch_dims` must be an integer greater than 0, got 0.",
        ),
        (
            lambda: Buckets(row_independent=1),
            "`row_independent` must be True or False, got 1.",
        ),
        (
            lambda: Buckets(max_graphs=-1),
            "`max_graphs` must be an integer greater than 0, got -1.",
        ),
        (
            lambda: Buckets(overflow="drop"),
            "`overflow` must be one of 'eager', 'raise', got 'drop'.",
        ),
    ],
    ids=[
        "static-max-graphs",
        "exact-max-graphs-bool",
        "exact-overflow",
        "buckets-sizes",
        "buckets-no-sizes",
        "buckets-not-a-list",
        "buckets-batch-dims",
        "buckets-row-independent",
        "buckets-max-graphs",
        "buckets-overflow",
    ],
)
def test_invalid_fields_raise_where_the_value_is_made(
    make: Callable[[], Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_the_constructor_takes_tensordicts_positional_arguments_and_few_keywords() -> None:
    ours = inspect.signature(CudaGraphModule.__init__).parameters.values()
    theirs = inspect.signature(tensordict.nn.CudaGraphModule.__init__).parameters.values()
    positional = [p.name for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [p.name for p in theirs if p.kind is p.POSITIONAL_OR_KEYWORD]
    keywords = [p.name for p in ours if p.kind is p.KEYWORD_ONLY]
    assert keywords == [
        "pool",
        "capture_error_mode",
        "backend",
        "verify",
        "shapes",
        "static",
        "outputs",
    ]


@pytest.mark.parametrize(
    ("shorthand", "value"),
    [("static", Static()), ("exact", Exact()), ("buckets", Buckets())],
)
def test_a_string_is_the_shorthand_of_the_default_value(shorthand: str, value: Any) -> None:
    # No warning: warnings are errors in the tests.
    graphed = CudaGraphModule(torch.tanh, shapes=shorthand, backend="emulate")  # type: ignore[arg-type]
    assert graphed._shapes == CudaGraphModule(torch.tanh, shapes=value, backend="emulate")._shapes


@pytest.mark.parametrize("shapes", ["dynamic", 8, Buckets], ids=["string", "int", "class"])
def test_other_shapes_are_refused(shapes: Any) -> None:
    message = (
        "`shapes` must be Static(...), Exact(...) or Buckets(...) (from cudagraph_td), or one "
        f"of 'static', 'exact', 'buckets', got {shapes!r}."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        CudaGraphModule(torch.tanh, shapes=shapes, backend="emulate")


@torch.no_grad()
def test_the_wrappers_repr_shows_the_value_unless_it_is_the_default(backend: Backend) -> None:
    graphed = backend.wrap(torch.tanh, warmup=1, shapes=Buckets([4, 8], overflow="raise"))
    graphed(backend.randn(3))
    assert "shapes=Buckets([4, 8], overflow='raise'),\n" in repr(graphed)
    assert "shapes=Static(max_graphs=3)" in repr(
        backend.wrap(torch.tanh, shapes=Static(max_graphs=3))
    )
    assert "shapes=" not in repr(backend.wrap(torch.tanh, shapes="static"))


# The deprecated keywords --------------------------------------------------------------------

DEPRECATED = [
    pytest.param(
        {"shapes": "buckets", "buckets": [8, 4], "overflow": "raise"},
        Buckets([4, 8], overflow="raise"),
        id="buckets",
    ),
    pytest.param(
        {"shapes": "buckets", "batch_dims": 2, "row_independent": True, "max_graphs": 3},
        Buckets(batch_dims=2, row_independent=True, max_graphs=3),
        id="buckets-fields",
    ),
    pytest.param({"shapes": "exact", "max_graphs": 2}, Exact(max_graphs=2), id="exact"),
    pytest.param(
        {"max_graphs": 1, "overflow": "raise"}, Static(max_graphs=1, overflow="raise"), id="static"
    ),
]


def _deprecated(fn: Any = torch.tanh, **options: Any) -> tuple[CudaGraphModule, list[Any]]:
    options.setdefault("backend", "emulate")
    with pytest.warns(FutureWarning) as record:
        graphed = CudaGraphModule(fn, warmup=1, **options)
    return graphed, list(record)


@pytest.mark.parametrize(("options", "value"), DEPRECATED)
def test_the_old_keywords_warn_with_the_new_spelling(options: dict[str, Any], value: Any) -> None:
    graphed, record = _deprecated(**options)
    keywords = ", ".join(f"{k}=" for k in options if k != "shapes")
    assert [str(w.message) for w in record] == [
        f"CudaGraphModule({keywords}) is deprecated and will be removed in the next release: "
        f"the shape options are one value now. Pass `shapes={value!r}` instead (from "
        "cudagraph_td)."
    ]
    assert record[0].filename == __file__  # at the line that made the wrapper
    assert graphed._shapes == value
    assert graphed._shapes == CudaGraphModule(torch.tanh, shapes=value, backend="emulate")._shapes


@torch.no_grad()
def test_the_old_keywords_behave_as_the_new_value(backend: Backend) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    old, _ = _deprecated(
        fn, shapes="buckets", buckets=[4, 8], overflow="raise", backend=backend.name
    )
    new = backend.wrap(fn, warmup=1, shapes=Buckets([4, 8], overflow="raise"))
    for graphed in (old, new):
        for n in (3, 3, 6, 6, 2):
            x = backend.randn(n, 2)
            torch.testing.assert_close(graphed(x), x * 2)
        with pytest.raises(RuntimeError, match=re.escape("above its largest bucket 8")):
            graphed(backend.randn(9, 2))
    assert old.graphs() == new.graphs()
    assert repr(old) == repr(new)


def test_old_keywords_that_had_no_effect_are_left_out_with_a_note() -> None:
    graphed, record = _deprecated(shapes="exact", batch_dims=2, row_independent=True)
    assert graphed._shapes == Exact()
    message = str(record[0].message)
    assert "Pass `shapes=Exact()` instead" in message
    assert "(batch_dims=, row_independent= had no effect without buckets: left out)" in message
    with pytest.raises(ValueError, match=re.escape("`batch_dims` must be an integer")):
        CudaGraphModule(torch.tanh, shapes="exact", batch_dims=0, backend="emulate")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_graphs": 0}, "`max_graphs` must be an integer greater than 0, got 0."),
        ({"overflow": "drop"}, "`overflow` must be one of 'eager', 'raise', got 'drop'."),
        (
            {"shapes": "buckets", "buckets": [0, 4]},
            "`sizes` must be a list of positive integers, got [0, 4].",
        ),
        (
            {"buckets": [4]},
            "`buckets=` is the list of batch sizes of shapes='buckets', but shapes='static'. "
            "Pass `shapes=Buckets([4])` (from cudagraph_td) instead of both.",
        ),
    ],
    ids=["max_graphs", "overflow", "buckets", "buckets-without-mode"],
)
def test_old_keywords_of_no_valid_value_raise(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        CudaGraphModule(torch.tanh, backend="emulate", **options)


@pytest.mark.parametrize(
    ("shapes", "options", "fix"),
    [
        (Exact(), {"max_graphs": 4}, "Pass `shapes=Exact(max_graphs=4)` alone."),
        (
            Buckets([4]),
            {"buckets": [8, 16], "overflow": "raise"},
            "Pass `shapes=Buckets([8, 16], overflow='raise')` alone.",
        ),
        (
            Static(),
            {"batch_dims": 2},
            "`Static` takes max_graphs, overflow: pass them as its fields.",
        ),
    ],
    ids=["exact", "buckets", "not-a-field"],
)
def test_old_keywords_beside_a_value_are_refused(
    shapes: Any, options: dict[str, Any], fix: str
) -> None:
    shown = ", ".join(f"`{k}=`" for k in options)
    message = (
        f"CudaGraphModule got `shapes={shapes!r}` beside the deprecated keyword(s) {shown}: "
        f"the shape options are the fields of the shapes= value now. {fix}"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        CudaGraphModule(torch.tanh, shapes=shapes, backend="emulate", **options)


def test_an_unknown_keyword_is_a_type_error_as_python_raises() -> None:
    message = "CudaGraphModule.__init__() got an unexpected keyword argument 'max_graph'"
    with pytest.raises(TypeError, match=re.escape(message)):
        CudaGraphModule(torch.tanh, backend="emulate", max_graph=4)  # type: ignore[call-arg]
