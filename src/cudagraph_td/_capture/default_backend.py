"""The backend that ``backend="auto"`` picks, for the whole process (the one switch).

In order: the value of `set_default_backend`, else the ``CUDAGRAPH_TD_BACKEND`` environment
variable, else CUDA where it is available and eager calls elsewhere. An explicit
``backend=`` argument is never overridden.

Both are read at each construction of a wrapper and at each ``make_graphed_callables``, never
at import: a test may set the variable (``monkeypatch.setenv``) after the package is imported,
and a construction is no hot path.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Literal, NamedTuple

import torch

from .._errors import inputs as _errors

ENV_VAR = "CUDAGRAPH_TD_BACKEND"

# What the switch may pick: the values of `backend=` but "auto", which the switch resolves.
DEFAULTS = ("cuda", "emulate", "eager")

# The value of `set_default_backend`; None: the environment variable decides.
_default: str | None = None


class Choice(NamedTuple):
    """The backend that a wrapper runs on, and what chose it (for messages)."""

    backend: str  # "cuda", "emulate" or "eager"
    # `set_default_backend(...)`, `CUDAGRAPH_TD_BACKEND=...`, or None: the `backend=`
    # argument, or "auto" by whether CUDA is available.
    switch: str | None


# Lower case: called as a function, as `torch.set_grad_enabled` is (also a class).
class set_default_backend:
    """Set the backend that ``backend="auto"`` picks, for the whole process.

    Every ``CudaGraphModule`` and every ``make_graphed_callables`` built afterwards with the
    default ``backend="auto"`` runs on ``backend``: ``"emulate"`` runs a whole program (a
    training script, or a library that builds wrappers inside it) on the CPU emulation of
    CUDA graphs, with its input checks and capture errors, without editing its constructors.
    An explicit ``backend=`` argument still wins; wrappers built before are left as they are.

    The ``CUDAGRAPH_TD_BACKEND`` environment variable (``cuda``, ``emulate`` or ``eager``)
    does the same from outside the program (``CUDAGRAPH_TD_BACKEND=emulate python
    train.py``); a value set here takes precedence over it. Both are read when a wrapper is
    built.

    Called as a function, the setting lasts until the next call; used as a context manager,
    it lasts until the ``with`` block ends, and the previous setting comes back (in a pytest
    fixture, the way to run a test module's wrappers on the emulation: see the docs' Sharp
    edges page, "One switch for a whole program"). The setting is the process's, as
    ``torch.set_default_dtype``'s is: not per thread.

    Args:
        backend: ``"emulate"`` for the CPU emulation of CUDA graphs (see the docs' Sharp
            edges page); ``"eager"`` for plain calls of the function, with no graph and no
            input checks (what ``"auto"`` picks without CUDA, here with no warning);
            ``"cuda"`` for CUDA graphs (a wrapper built on a machine without CUDA then
            raises). ``None``: the environment variable decides again, else whether CUDA is
            available.

    Raises:
        ValueError: ``backend`` is none of these values. A wrapper built with
            ``backend="auto"`` raises it too when ``CUDAGRAPH_TD_BACKEND`` holds another
            value than ``cuda``, ``emulate``, ``eager`` (or ``auto``, or nothing).

    Examples:
        >>> import torch
        >>> from cudagraph_td import CudaGraphModule, set_default_backend
        >>> with set_default_backend("emulate"):
        ...     graphed = CudaGraphModule(torch.nn.Linear(3, 2))  # no backend= argument
        >>> with torch.no_grad():
        ...     for _ in range(3):  # a warm-up call, the capture, a replay
        ...         y = graphed(torch.randn(8, 3))
        ...     graphed(torch.randn(4, 3))  # checked as on a GPU
        Traceback (most recent call last):
        ...
        cudagraph_td.InputMismatchError: CudaGraphModule was captured with args[0] of shape (8, 3), but received shape (4, 3). ...
        >>> set_default_backend("emulat")
        Traceback (most recent call last):
        ...
        ValueError: `set_default_backend(...)` must be one of 'cuda', 'emulate', 'eager', None, got 'emulat'.
    """

    def __init__(self, backend: Literal["cuda", "emulate", "eager"] | None) -> None:
        global _default
        if backend is not None and backend not in DEFAULTS:
            raise _errors.invalid_option("set_default_backend(...)", backend, (*DEFAULTS, None))
        self._previous = _default
        _default = backend

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _default
        _default = self._previous


def resolve(name: str, backend: str) -> Choice:
    """The backend of a wrapper ``name`` built with ``backend=``, ``"auto"`` resolved.

    Raises a ``ValueError`` for an invalid environment variable, and a ``RuntimeError`` where
    CUDA is asked for (by the argument or by the switch) on a machine without it.
    """
    switch = None
    if backend == "auto":
        backend, switch = _switched()
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "eager"
    elif backend == "cuda" and not torch.cuda.is_available():
        raise _errors.no_cuda(name, switch)
    return Choice(backend, switch)


def _switched() -> tuple[str, str | None]:
    """What the switch picks (``"auto"``: nothing set), and how it was set."""
    if _default is not None:
        return _default, f"set_default_backend({_default!r})"
    value = os.environ.get(ENV_VAR, "").strip()
    if value in ("", "auto"):
        return "auto", None
    if value not in DEFAULTS:
        raise _errors.invalid_environment_backend(ENV_VAR, value, DEFAULTS)
    return value, f"{ENV_VAR}={value}"
