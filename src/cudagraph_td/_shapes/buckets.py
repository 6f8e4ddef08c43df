"""``shapes="buckets"``: calls padded to a few batch sizes, each with a graph of its own.

A call of ``n`` rows is padded to the next bucket size ``b`` (see `_shapes.padding`), and its result
sliced back to ``n`` rows. Once the graph of ``b`` is captured, calls of ``n`` rows replay it
through views of the first ``n`` rows of its buffers (``GraphCall.rows``): no padded copy,
the replay path of any graph, and the padded rows keep rows of earlier calls (real values, as
a padding must hold). With a list of buckets (or ``precapture``), the first capture captures
them all, largest first, so that the smaller graphs reuse the largest one's memory.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .._capture.entry import GraphEntry, GraphKey
from .._capture.graph import GraphCall, capture_turn
from .._errors import shapes as _errors_shapes
from .._values import tree as _tree
from .._values.outputs import Outputs
from .._values.signature import Signature
from .._values.tree import Call
from . import padding as _padding
from .graphs import Answer, Graphs, exact_key
from .options import Buckets
from .row_check import check_rows


class BucketGraphs(Graphs):
    """The graphs of one mode, one per bucket size, chosen by the call's batch dims. Each
    bucket's entry holds, as its ``rows``, the entries of its graph replayed on fewer rows."""

    options: Buckets

    _lead: GraphEntry | None = None  # the largest listed bucket's, while it warms up
    # The buckets whose padding was checked (see `_shapes.row_check`), learned at the first call
    # that each one pads.
    _checked: frozenset[tuple[int, ...]] = frozenset()

    def run(self, call: Call) -> Answer:
        options = self.options
        batch = _padding.batch_of(self.name, call, options.batch_dims)
        size = _padding.bucket_for(batch, options.sizes)
        own = size
        if self.agreement is not None:  # every rank of a DDP step: the same graph
            size = self.agreement.largest(size)
        if size is None:  # above every bucket: this call's batch, or another rank's
            return Answer(self._overflow(call, batch, elsewhere=own is not None))
        if torch.is_grad_enabled() and not options.row_independent:
            raise _errors_shapes.padding_refused(self.name, "calls in grad mode")
        self._check(size, batch, call)
        key = self.key._replace(shapes=size)
        entry = self.entries.get(key)
        if entry is not None:
            view = self._rows(entry, size, batch, call)
            if view is not None and view.holds():
                return Answer(view.replay_in_full(call), view, replayed=True)
        else:
            group = self._group(size)
            if len(group) > 1:
                return self._capture_group(group, size, batch, call)
            if len(self.entries) >= options.max_graphs:
                return Answer(self._overflow(call, None))
            entry = self.entries[key] = self.new_entry(size)
        padded = _tree.flatten_call(*_padding.resize(call, size))  # another call: its own
        out, replayed = entry.run(padded, rows=0 if batch == size else _numel(batch))
        self._refuse(key, entry)
        result = _padding.rows(self.name, out, size, batch)
        # Once a bucket's graph is captured, calls like this one take its rows' entry.
        view = self._rows(entry, size, batch, call)
        if view is None:
            captured = entry if entry.captured is not None else None
            return Answer(result, captured, replayed, for_table=False)
        return Answer(result, view, replayed)

    def new_entry(self, shapes: Hashable) -> GraphEntry:
        entry = super().new_entry(shapes)
        size = _numel(shapes)  # type: ignore[arg-type]
        entry.batch = (size, size)
        return entry

    def _check(self, size: tuple[int, ...], batch: tuple[int, ...], call: Call) -> None:
        """The first time the bucket ``size`` pads a call, check that the function's rows
        are independent of each other (see `_shapes.row_check`); not if the user says they are."""
        options = self.options
        if batch == size or size in self._checked or options.row_independent:
            return
        if self.agreement is None:  # a DDP step is a training step: refused anyway
            with capture_turn(self._lock):  # the function runs only under it
                check_rows(self.name, self._fn, call, size, batch)
        self._checked = self._checked | {size}

    def _group(self, size: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The buckets captured together with ``size``, largest first (so that the smaller
        graphs reuse its memory): every listed one not seen yet (or, for ``precapture``,
        every power of two up to ``size``); just ``size`` for more than one batch dim."""
        if len(size) != 1 or not (self.options.sizes or self.precapturing):
            return [size]
        sizes = self.options.sizes or [1 << k for k in range(size[0].bit_length())]
        seen = {key.shapes for key in self.entries}
        return [(s,) for s in sorted(sizes, reverse=True) if (s,) not in seen]

    def _capture_group(
        self,
        group: list[tuple[int, ...]],
        size: tuple[int, ...],
        batch: tuple[int, ...],
        call: Call,
    ) -> Answer:
        """Warm up the largest graph of ``group`` on this call (padded); at its capture,
        capture every graph of the group, largest first, and answer with this call's."""
        self._check(group[0], batch, call)  # its warm-ups pad the call to it
        lead = self._lead = self._lead or self.new_entry(group[0])
        if lead.counter < lead.warmup - 1:
            out, _ = lead.run(_tree.flatten_call(*_padding.resize(call, group[0])))
            return Answer(_padding.rows(self.name, out, group[0], batch))
        self._lead = None
        self.entries[self.key._replace(shapes=group[0])] = lead
        answer = Answer(None)
        for each in group:
            key = self.key._replace(shapes=each)
            entry = self.entries.get(key) or self.entries.setdefault(key, self.new_entry(each))
            entry.skip_warmup()  # the largest's warm-ups did the lazy initialisations
            out, _ = entry.run(_tree.flatten_call(*_padding.resize(call, each)))
            self._refuse(key, entry)
            if each == size:
                result = _padding.rows(self.name, out, size, batch)
                view = self._rows(entry, size, batch, call)
                answer = Answer(result, view, for_table=view is not None)
        return answer

    def _refuse(self, key: GraphKey, entry: GraphEntry) -> None:
        """Drop a graph just captured, and raise, if it is a training step (unless declared
        row-independent), or if it returns an input or a view of one (see
        `_values.input_views`): padded calls and a bucket's rows would return copies."""
        captured = entry.captured
        if captured is None:
            return
        if captured.training_step and not self.options.row_independent:
            del self.entries[key]
            raise _errors_shapes.padding_refused(self.name, "a training step")
        if captured.input_views is not None:
            del self.entries[key]
            output, input_path = captured.input_views.first()
            raise _errors_shapes.input_returned_padded(self.name, output, input_path)

    def _rows(
        self,
        entry: GraphEntry,
        size: tuple[int, ...],
        batch: tuple[int, ...],
        call: Call,
    ) -> GraphEntry | None:
        """The entry of the bucket ``size``'s captured graph (``entry``'s) replayed on ``batch``
        rows of its buffers, for calls like this one: one of ``entry.rows``; None if it is not
        captured, or captured for autograd, or if the call differs from the capture in more
        than its batch dims (the padded call's full check then names the leaf)."""
        captured = entry.captured
        if not isinstance(captured, GraphCall):
            return None
        # By the call's structure too: a TensorDict and keyword tensors read other rows.
        where = (batch, exact_key(call))
        known = entry.rows.get(where)
        if known is not None and known.captured is not None:
            return known
        signature = captured.signature
        if signature.diagnose(call, shapes=False) is not None:
            return None
        dims = len(size)
        index = tuple(slice(0, n) for n in batch)
        heads = [t[index] for t in signature.static_inputs]
        tensors = signature.tensors(call)
        for t, static in zip(tensors, signature.static_inputs, strict=True):
            if t.shape[dims:] != static.shape[dims:]:
                return None
        device = signature.static_inputs[0].device if heads else torch.device("cpu")
        rows_signature = Signature(self.name, call, device, static_inputs=heads)
        outputs = captured.outputs
        result = _padding.rows(self.name, outputs.rebuild(outputs.static), size, batch)
        # The rows' outputs lent under the bucket graph's lease, with outputs="borrowed".
        rows_outputs = Outputs(self.name, result, outputs.device, lent=outputs.lent)
        view = captured.rows(rows_signature, rows_outputs)
        return entry.fill_rows(where, view, (_numel(batch), _numel(size)))


def _numel(batch: tuple[int, ...]) -> int:
    n = 1
    for d in batch:
        n *= d
    return n
