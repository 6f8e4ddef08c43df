"""The mode of a call, read two ways: ``mode_reader`` (the slow path, the table's general
key) and ``mode_lookup`` (the replay path's lookup where the mode is the whole key). The two
must read the same mode in every mode, or a call would miss its graph, or find another's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from tensordict.nn import InteractionType, set_interaction_type

from cudagraph_td._call.modes import mode_lookup, mode_reader


@contextlib.contextmanager
def _mode(grad: bool, training: bool, interaction: str, autocast: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        if interaction != "unset":
            stack.enter_context(set_interaction_type(InteractionType[interaction]))
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        yield


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("interaction", ["unset", "RANDOM", "DETERMINISTIC"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_the_lookup_reads_the_mode_as_the_reader_does(
    grad: bool, training: bool, interaction: str, autocast: bool
) -> None:
    module = torch.nn.Linear(2, 2).train(training)
    table: dict[object, object] = {}
    read, find = mode_reader(module), mode_lookup(module, table)[1]
    with _mode(grad, training, interaction, autocast):
        mode = read()
        table[mode] = "found"
        assert find((), {}) == "found"
    table.clear()
    table[mode] = "found"
    with _mode(not grad, training, interaction, autocast):
        assert find((), {}) == ()  # another mode: another key
