"""The graph table: the entries of a wrapper's graphs, by the key of the calls they answered.

A call's key (``CallKey``) is what picks its graph before its inputs are read: its mode
(tensordict's interaction type, grad mode, the module's training mode, the autocast state:
see `_call.modes`) and, where the wrapper keeps several graphs per mode, the shapes of its
arguments (``shapes="exact"`` and ``"buckets"``: a TensorDict's is its batch size) and the
values of its static arguments (see `_call.static`). The table maps each key to the entries
(`_capture.entry.GraphEntry`) of the graphs that answered calls of that key on the slow path,
most recent first: usually one; two when calls that the key does not tell apart (another
device, a TensorDict's entries of other shapes) take other graphs. A call whose key is in
the table replays at once; any other takes the wrapper's slow path, which answers it and
adds the entry that answered under its key (``add``).

Nothing in a key is checked here: each entry checks the call in full (structure, shapes,
dtypes, devices, the state it reads) and answers ``MISS`` for a call it cannot replay, which
the slow path then answers and explains.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .._capture.entry import GraphEntry
from .modes import Mode, mode_reader
from .static import StaticArgs

Args = tuple[Any, ...]
Kwargs = dict[str, Any]

CallKey = Hashable
"""A call's key: its mode; with several shapes, ``(mode, shapes)``; with static arguments,
``(that, static values)``. Plain tuples: one is made at every call."""

# The most entries kept per key (calls of one key that take other graphs).
ENTRIES_PER_KEY = 4


class GraphTable:
    """The entries of a wrapper's graphs, by the key of the calls they answered.

    ``module``: the wrapped function or module (its ``training`` flag is part of the
    mode); ``by_shapes``: whether a mode has a graph per shape (``"exact"``, ``"buckets"``);
    ``static``: the static arguments, if any (their values pick graphs too).
    """

    def __init__(self, module: Any, by_shapes: bool, static: StaticArgs | None):
        self._by_shapes = by_shapes
        self._static = static
        self._mode = mode_reader(module)  # the call's mode, read at every call
        self._entries: dict[CallKey, tuple[GraphEntry, ...]] = {}

    def key(self, args: Args, kwargs: Kwargs, mode: Mode | None = None) -> CallKey:
        """The key of a call now (``mode``: the call's, if known already)."""
        key: CallKey = self._mode() if mode is None else mode
        if self._by_shapes:
            # The shapes of its arguments, by position then by keyword (None for one without).
            shapes = [getattr(a, "shape", None) for a in args]
            if kwargs:
                shapes.extend((name, getattr(v, "shape", None)) for name, v in kwargs.items())
            key = (key, tuple(shapes))
        if self._static is not None:
            key = (key, self._static.values(args, kwargs))
        return key

    def find(self, args: Args, kwargs: Kwargs) -> tuple[GraphEntry, ...]:
        """The entries for a call like this one (none for a key never seen)."""
        try:
            return self._entries[self.key(args, kwargs)]
        except (KeyError, TypeError):  # a key never seen, or a static value not hashable
            return ()

    def add(self, key: CallKey, entry: GraphEntry) -> None:
        """Give calls of ``key`` the entry ``entry`` first. An entry whose graph was captured
        again (a replaced parameter) leaves every key: it would keep the old graph and its
        buffers alive."""
        known = self._entries.get(key, ())
        if known and known[0] is entry:
            return
        if any(not e.alive() for entries in self._entries.values() for e in entries):
            self._entries = {
                k: live
                for k, entries in self._entries.items()
                if (live := tuple(e for e in entries if e.alive()))
            }
            known = self._entries.get(key, ())
        rest = tuple(e for e in known if e is not entry)
        self._entries[key] = (entry, *rest)[:ENTRIES_PER_KEY]

    def clear(self) -> None:
        self._entries.clear()

    def entries(self) -> list[GraphEntry]:
        """Every entry in the table, once each (for introspection and tests)."""
        return list({id(e): e for entries in self._entries.values() for e in entries}.values())
