"""The graph table: the entries of a wrapper's graphs, by the key of the calls they answered.

A call's key is a graph key (`_capture.entry.GraphKey`) read before its tensors are: its
mode (tensordict's interaction type, grad mode, the module's training mode, the autocast
state: see `_call.modes`), no device (each entry checks it), the values of its static
arguments (see `_call.static`) and, where the wrapper keeps several graphs per mode
(``shapes="exact"`` and ``"buckets"``), the shapes of its arguments (a TensorDict's is its
batch size). Where the mode alone picks the graph (no shapes, no static arguments), the key
is the bare mode. The table maps each key to the entries (`_capture.entry.GraphEntry`) of the
graphs that answered calls of that key on the slow path, most recent first: usually one;
two when calls that the key does not tell apart (another device, a TensorDict's entries of
other shapes) take other graphs. A call whose key is in the table replays at once; any
other takes the wrapper's slow path, which answers it and adds the entry that answered under
its key (``add``).

Nothing in a key is checked here: each entry checks the call in full (structure, shapes,
dtypes, devices, the state it reads) and answers ``MISS`` for a call it cannot replay (one
that is warming up, or emptied for a new capture, misses every call), which the slow path
then answers and explains. An entry stays its graph's for the graph's whole life, so the
table never holds one that another replaced.
"""

from __future__ import annotations

from typing import Any

from .._capture.entry import GraphEntry, GraphKey
from .modes import Mode, mode_lookup
from .static import StaticArgs

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


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
        # Where the mode alone picks the graph (no shapes, no static arguments), a call's key
        # is the bare mode, which hashes faster than a key that nests it.
        self._mode_only = not by_shapes and static is None
        self._entries: dict[GraphKey | Mode, tuple[GraphEntry, ...]] = {}
        # The call's mode, read at every call; and without static arguments, `find` reads
        # the call's key and looks it up in one closure: a closure over the table's dict, not
        # a method bound to the table, which would make a reference cycle that only the
        # garbage collector frees.
        self._mode, find = mode_lookup(module, self._entries, by_shapes)
        if static is None:
            self.find = find  # type: ignore[method-assign, assignment]

    def key(self, args: Args, kwargs: Kwargs, mode: Mode | None = None) -> GraphKey | Mode:
        """The key of a call now (``mode``: the call's, if known already): the bare mode
        where it alone picks the graph, else a plain tuple of a `GraphKey`'s fields, which
        hashes and compares as one, made faster."""
        mode = self._mode() if mode is None else mode
        if self._mode_only:
            return mode
        values = () if self._static is None else self._static.values(args, kwargs)
        shapes = None
        if self._by_shapes:
            # The shapes of its arguments, by position then by keyword (None for one without).
            listed = [getattr(a, "shape", None) for a in args]
            if kwargs:
                listed.extend((name, getattr(v, "shape", None)) for name, v in kwargs.items())
            shapes = tuple(listed)
        return (mode, None, values, shapes)  # type: ignore[return-value]

    def find(self, args: Args, kwargs: Kwargs) -> tuple[GraphEntry, ...]:
        """The entries for a call like this one (none for a key never seen)."""
        try:
            return self._entries[self.key(args, kwargs)]
        except (KeyError, TypeError):  # a key never seen, or a static value not hashable
            return ()

    def add(self, key: GraphKey | Mode, entry: GraphEntry) -> None:
        """Give calls of ``key`` the entry ``entry`` first."""
        known = self._entries.get(key, ())
        if known and known[0] is entry:
            return
        rest = tuple(e for e in known if e is not entry)
        self._entries[key] = (entry, *rest)[:ENTRIES_PER_KEY]

    def clear(self) -> None:
        self._entries.clear()

    def entries(self) -> list[GraphEntry]:
        """Every entry in the table, once each (for introspection and tests)."""
        return list({id(e): e for entries in self._entries.values() for e in entries}.values())
