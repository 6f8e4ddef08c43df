"""Trees: optree flattening in the library's namespace, TensorDict nodes, readable paths."""

from __future__ import annotations

import textwrap
from collections import namedtuple

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, tensorclass

from cudagraph_td._values import tree as _tree

from .conftest import Backend, early

Pair = namedtuple("Pair", "first second")


@tensorclass
class Sample:
    obs: torch.Tensor
    tag: str


def _call_tree() -> tuple[tuple[object, ...], dict[str, object]]:
    td = TensorDict(
        obs=torch.zeros(3),
        next=TensorDict(observation=torch.ones(3, 2), batch_size=[3]),
        note=NonTensorData("hi", batch_size=[3]),
        batch_size=[3],
    )
    lazy = LazyStackedTensorDict(
        TensorDict(a=torch.zeros(2)), TensorDict(a=torch.ones(2)), stack_dim=0
    )
    sample = Sample(obs=torch.zeros(2), tag="t", batch_size=[2])
    return (td, [1, None, Pair(torch.zeros(1), 2.0)], sample, lazy), {
        "x": torch.zeros(1),
        "mode": "eval",
    }


def test_leaf_paths_read_like_python() -> None:
    assert _tree.leaf_paths(_call_tree()) == [
        'args[0]["next", "observation"]',  # a TensorDict's keys in sorted order, as a dict's
        'args[0]["note"]',
        'args[0]["obs"]',
        "args[1][0]",
        "args[1][2].first",
        "args[1][2].second",
        "args[2].obs",
        "args[2].tag",
        'args[3][0]["a"]',
        'args[3][1]["a"]',
        'kwargs["mode"]',
        'kwargs["x"]',
    ]


def test_output_paths_start_at_the_output() -> None:
    out = {"loss": torch.zeros(()), "td": TensorDict(a=torch.zeros(1))}
    assert _tree.leaf_paths(out, root="output") == ['output["loss"]', 'output["td"]["a"]']


def test_flatten_and_unflatten_round_trip() -> None:
    tree = _call_tree()
    leaves, spec = _tree.flatten(tree)
    assert len(leaves) == 12
    (td, seq, sample, lazy), kwargs = _tree.unflatten(spec, leaves)
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([3])
    assert td["next", "observation"].shape == (3, 2) and td["note"] == "hi"
    assert seq[0] == 1 and seq[1] is None and isinstance(seq[2], Pair)
    assert isinstance(sample, Sample) and sample.tag == "t"
    assert isinstance(lazy, LazyStackedTensorDict) and lazy.stack_dim == 0
    assert kwargs["mode"] == "eval"


@pytest.mark.parametrize(
    "change",
    ["batch_size", "key", "nested_key"],
)
def test_tensordict_structure_is_part_of_the_treespec(change: str) -> None:
    td = TensorDict(
        a=torch.zeros(3), b=TensorDict(c=torch.zeros(3), batch_size=[3]), batch_size=[3]
    )
    other = td.clone()
    if change == "batch_size":
        other.batch_size = []
    elif change == "key":
        other["d"] = torch.zeros(3)
    else:
        other["b", "e"] = torch.zeros(3)
    assert _tree.flatten(td)[1] != _tree.flatten(other)[1]
    assert _tree.flatten(td)[1] == _tree.flatten(td.clone())[1]


# Each in a fresh interpreter, as the registries are the process's.
REGISTRY_RUN = early(
    "registry",
    "-c",
    textwrap.dedent(
        """
        import torch, tensordict, optree
        import torch.utils._pytree as pytree
        # tensordict registers its own types (tensorclasses too, when they are defined).
        from tests.test_tree import _call_tree
        before = dict(pytree.SUPPORTED_NODES)
        before_optree = optree.register_pytree_node.get(namespace="")
        from cudagraph_td import CudaGraphModule
        from cudagraph_td._values import tree as _tree
        _tree.flatten(_call_tree())
        graphed = CudaGraphModule(lambda td: td["obs"] * 2, warmup=1, backend="emulate")
        td = tensordict.TensorDict(obs=torch.zeros(3), batch_size=[3])
        graphed(td); graphed(td)
        assert dict(pytree.SUPPORTED_NODES) == before, "torch's pytree registry changed"
        assert optree.register_pytree_node.get(namespace="") == before_optree, "optree's global namespace changed"
        print("untouched")
        """
    ),
)
LAZY_FIRST_RUN = early(
    "lazy first",
    "-c",
    textwrap.dedent(
        """
        import torch
        from tensordict import LazyStackedTensorDict, TensorDict
        from tensordict.nn import TensorDictModule
        from cudagraph_td import CudaGraphModule
        from cudagraph_td._values import tree as _tree
        def lazy():
            return LazyStackedTensorDict(
                TensorDict(x=torch.zeros(2)), TensorDict(x=torch.ones(2)), stack_dim=0
            )
        print(_tree.leaf_paths(((lazy(),), {})))
        module = TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["y"])
        graphed = CudaGraphModule(module, warmup=2, backend="emulate")
        for _ in range(3):
            print(graphed(lazy())["y"].tolist())
        """
    ),
)


@pytest.mark.early("registry")
def test_torch_global_pytree_registry_is_untouched() -> None:
    # In a fresh interpreter: what torch's registry holds before cudagraph_td is imported
    # must be exactly what it holds after it flattened every kind of tree it supports.
    result = REGISTRY_RUN.result()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "untouched"


@pytest.mark.early("lazy first")
def test_a_lazy_stack_in_the_first_call_of_a_process() -> None:
    # Types are registered at first sight. A lazy stack met before any TensorDict shows
    # TensorDicts once registered: they are registered too (their entries were taken for
    # constants, and a wrapper's first call with a lazy stack refused). A fresh interpreter,
    # as the registry is the process's.
    result = LAZY_FIRST_RUN.result()
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "['args[0][0][\"x\"]', 'args[0][1][\"x\"]']",
        *["[[1.0, 1.0], [2.0, 2.0]]"] * 3,
    ]


def _weighted(td: TensorDict) -> torch.Tensor:
    """Entries weighted by their place in the key order (nested TensorDicts too)."""
    parts = []
    for i, key in enumerate(td.keys()):
        value = td[key]
        if isinstance(value, TensorDict):
            value = torch.cat([value[k] * (j + 1) for j, k in enumerate(value.keys())], -1)
        parts.append(value * (i + 1))
    return torch.cat(parts, -1)


def test_a_graph_keeps_the_key_order_of_the_tensordict_it_was_captured_with(
    backend: Backend,
) -> None:
    # A function that iterates over a TensorDict's keys computes in their order: the graph
    # sees the order in which the caller set them, not the sorted one of the flattening.
    graphed = backend.wrap(_weighted, warmup=2)
    for _ in range(4):
        inner = TensorDict(b=backend.randn(3, 1), a=backend.randn(3, 1), batch_size=[3])
        td = TensorDict(zeta=backend.randn(3, 1), alpha=backend.randn(3, 2), batch_size=[3])
        td["inner"], td["mid"] = inner, backend.randn(3, 1)
        torch.testing.assert_close(graphed(td), _weighted(td))
