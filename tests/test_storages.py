"""Tensor subclasses as inputs: a wrapper subclass whose own storage holds no memory (as
tensordict's ``UnbatchedTensor`` can be, and mujoco-torch's ``Data`` entries are) replays as
eager mode runs it; one that gives no memory at all is refused with its path."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tensordict import TensorDict, UnbatchedTensor
from torch.utils._pytree import tree_map

from cudagraph_td._values import storages

from .conftest import Backend


class Wrapped(torch.Tensor):
    """A wrapper subclass around a payload, which its own ``untyped_storage`` gives."""

    payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor) -> Wrapped:
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            payload.shape,
            strides=payload.stride(),
            dtype=payload.dtype,
            device=payload.device,
        )
        t.payload = payload
        return t  # type: ignore[no-any-return]

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        def unwrap(x: Any) -> Any:
            return x.payload if isinstance(x, Wrapped) else x

        def wrap(x: Any) -> Any:
            return cls(x) if isinstance(x, torch.Tensor) and not isinstance(x, Wrapped) else x

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return self.payload.untyped_storage()


class Memoryless(Wrapped):
    """The same, but whose ``untyped_storage`` gives its own storage, with no memory."""

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return torch.Tensor.untyped_storage(self)


def _step(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return x * 2 + n


def test_the_memory_of_a_wrapper_subclass_is_its_payloads() -> None:
    payload = torch.arange(3.0)
    wrapped = Wrapped(payload)
    with pytest.raises(RuntimeError, match="invalid python storage"):
        torch.UntypedStorage.data_ptr(torch.Tensor.untyped_storage(wrapped))  # what broke
    assert storages.address(wrapped) == payload.untyped_storage().data_ptr()
    assert storages.addresses([payload, wrapped]) == [payload.data_ptr()] * 2
    assert not storages.readable(Memoryless(payload))


def test_a_wrapper_subclass_input_replays_as_eager_mode_runs_it(backend: Backend) -> None:
    graphed = backend.wrap(_step, warmup=2)
    for i in range(5):  # a warm-up, the capture, three replays
        x = backend.randn(3)
        n = Wrapped(torch.full((), float(i), device=backend.device))
        out = graphed(x, n)
        assert type(out) is Wrapped
        torch.testing.assert_close(out.payload, x * 2 + i)
    assert [info.replays for info in graphed.graphs()] == [3]


def test_a_tensor_without_memory_is_refused_with_its_path(backend: Backend) -> None:
    graphed = backend.wrap(_step, warmup=2)
    n = Memoryless(torch.zeros((), device=backend.device))
    message = (
        f"CudaGraphModule cannot read the memory of args[1], a {Memoryless.__module__}."
        "Memoryless: a tensor subclass whose storage holds no memory"
    )
    with pytest.raises(TypeError, match=re.escape(message)):
        graphed(backend.randn(3), n)


def test_unbatched_entries_of_a_tensordict_replay_as_eager(backend: Backend) -> None:
    def act(td: TensorDict) -> torch.Tensor:
        return td["obs"] @ td["table"] + 1

    graphed = backend.wrap(act, warmup=2)
    for _ in range(5):
        table = UnbatchedTensor(backend.randn(3, 2))
        td = TensorDict(obs=backend.randn(5, 3), table=table, batch_size=[5])
        torch.testing.assert_close(graphed(td), act(td))
