"""Static arguments: declared non-tensor arguments whose value picks a graph (``static=``).

A graph replays the Python values of its capture, so a bool that selects a branch (torchrl's
TD3 passes ``update(batch, update_actor)``) needs one graph per value. ``StaticArgs`` reads the
declared arguments of a call, by position or by name, into the part of the wrapper's graph
key that holds them; each value's graph then warms up and is captured on first sight. Only
the slow path reads them: the replay path compares a call's constants with its graph's and
takes the slow path for another value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from .._errors import inputs as _errors


class StaticArgs:
    """The declared static arguments of a wrapped function: ``static`` holds positions
    (``int``) and parameter names (``str``); a name is also found at its position when the
    function's signature has it there."""

    def __init__(self, name: str, fn: Callable[..., Any], static: Any):
        entries = (static,) if isinstance(static, int | str) else static
        if not isinstance(entries, tuple | list) or not all(
            isinstance(e, str) or (isinstance(e, int) and not isinstance(e, bool) and e >= 0)
            for e in entries
        ):
            raise _errors.invalid_option(
                "static", static, "a tuple of argument positions (int) and names (str)"
            )
        self.name = name
        names, takes_any_keyword = _parameters(fn)
        self.entries: list[tuple[int | None, str | None]] = []
        for entry in dict.fromkeys(entries):
            if isinstance(entry, int):
                self.entries.append((entry, None))
            elif entry in names or takes_any_keyword:
                self.entries.append((names.get(entry), entry))
            else:
                raise ValueError(
                    f"{name}(static=...): the function has no argument named {entry!r} (its "
                    f"arguments: {', '.join(names) or 'none'})."
                )

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, ...]:
        """The call's values of the declared arguments, each with its type (``1`` and
        ``True`` are different graphs), or None for one the call leaves to its default.

        Raises:
            TypeError: A declared argument is a tensor, or a value that cannot be hashed.
        """
        for where, value in self._found(args, kwargs):
            path = f'kwargs["{where}"]' if isinstance(where, str) else f"args[{where}]"
            if isinstance(value, torch.Tensor | TensorDictBase):
                raise TypeError(
                    f"{self.name}: the static argument {path} is a {type(value).__name__}: "
                    "static arguments are Python values (bools, numbers, strings, enums) "
                    "that pick a graph. Pass tensors as ordinary arguments."
                )
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{self.name}: the static argument {path} = {value!r} cannot be hashed, "
                    "so it cannot pick a graph. Pass a bool, number, string, enum or tuple."
                ) from None
        return self.values(args, kwargs)

    def values(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, ...]:
        """``key`` unchecked, for the graph table (see `_call.table`): the slow path's ``key``
        raises the errors of a value that cannot pick a graph."""
        return tuple(
            None if where is None else (type(value), value)
            for where, value in self._found(args, kwargs)
        )

    def _found(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Iterator[tuple[str | int | None, Any]]:
        """Where each declared argument was found in the call (its keyword, or its position),
        and its value; ``(None, None)`` for one left to its default."""
        for position, keyword in self.entries:
            if keyword is not None and keyword in kwargs:
                yield keyword, kwargs[keyword]
            elif position is not None and position < len(args):
                yield position, args[position]
            else:
                yield None, None

    def shown(self, key: tuple[Hashable, ...]) -> str:
        """The values of a graph's static arguments, as ``graphs()`` and ``repr`` show them."""
        parts = []
        for (position, keyword), item in zip(self.entries, key, strict=True):
            label = keyword if keyword is not None else f"args[{position}]"
            value = "<default>" if item is None else repr(item[1])  # type: ignore[index]
            parts.append(f"{label}={value}")
        return ", ".join(parts)


def _parameters(fn: Callable[..., Any]) -> tuple[dict[str, int | None], bool]:
    """The function's parameters: each name's position (None for keyword-only), and whether
    it takes any keyword (``**kwargs``, or a signature that cannot be read)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return {}, True
    names: dict[str, int | None] = {}
    # Positional parameters come first in a signature: their index is their position.
    for position, parameter in enumerate(parameters):
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names[parameter.name] = position
        elif parameter.kind is parameter.KEYWORD_ONLY:
            names[parameter.name] = None
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)
