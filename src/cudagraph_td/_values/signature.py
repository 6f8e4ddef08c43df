"""The signature of a captured call: what its inputs must look like at every replay.

``Signature`` is built once, at capture. It validates the capture's inputs, clones
their tensors into the graph's static buffers, and keeps what a replay compares: the
treespec, the indices of the tensor leaves and each one's ``metadata``, and the
non-tensor constants. ``Signature.read`` is the general reader of the replay path (see
`_capture.entry`); ``Signature.match`` is the slow path's full check, whose
``Signature.diagnose`` walks the trees to find the offending leaf and build the error
that names it.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from typing import Any, cast

import optree
import torch
from tensordict import TensorDictBase

from .._errors import inputs as _errors
from . import tree as _tree
from .storages import readable
from .tree import Call

metadata = operator.attrgetter("__class__", "shape", "dtype", "device", "requires_grad")
"""What a replay checks of each input tensor, as one tuple: type, shape, dtype, device and
``requires_grad``. The type tells a tensor from a TensorDict or a subclass; ``device``, not
``get_device()``, which is ``-1`` for every device that is not CUDA (a meta tensor would
pass for a CPU one). One C call: faster than the same tuple written out in Python."""


def _comparable(value: Any) -> bool:
    try:
        return isinstance(value == value, bool)
    except Exception:
        return False


def validate(name: str, call: Call, device: torch.device, *, allow_grad: bool = False) -> None:
    """Check that a call can be warmed up or captured on ``device``, before running it.

    ``allow_grad`` accepts inputs that require grad, for a graph captured for autograd.
    """
    for i, leaf in enumerate(call.leaves):
        if isinstance(leaf, torch.Tensor):
            if not readable(leaf):
                raise _errors.memoryless_input(name, call.paths()[i], leaf)
            if leaf.device != device:
                path = call.paths()[i]
                raise _errors.wrong_device_at_capture(name, path, device, leaf.device)
            if leaf.requires_grad and not allow_grad:
                raise _errors.requires_grad(name, call.paths()[i])
        elif not _comparable(leaf):
            raise _errors.uncomparable_constant(name, call.paths()[i], leaf)


class Signature:
    """The inputs of a captured call, and the static buffers that the graph reads."""

    def __init__(
        self,
        name: str,
        call: Call,
        device: torch.device,
        *,
        allow_grad: bool = False,
        static_inputs: list[torch.Tensor] | None = None,
        function: Any = None,
    ):
        validate(name, call, device, allow_grad=allow_grad)
        self.name = name
        # The Python signature of the captured function, for the advice of a call that it
        # could not take (a required argument missing): None where it has none to read.
        self.python_signature = _python_signature(function)
        leaves, self.spec = call.leaves, call.spec
        is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self.tensor_index = [i for i, tensor in enumerate(is_tensor) if tensor]
        self.const_index = [i for i, tensor in enumerate(is_tensor) if not tensor]
        self.expected = [metadata(leaves[i]) for i in self.tensor_index]
        # The constants, each with its type: a call's must have the same types and values.
        self.consts = [(type(leaves[i]), leaves[i]) for i in self.const_index]
        # The graph's own copies of the tensor inputs: replays copy new inputs into them.
        # They are leaves that require grad where the inputs do (a graph captured for
        # autograd differentiates with respect to them), and never inference tensors, so
        # that a graph captured under inference_mode can be fed outside it. No reference to
        # the caller's tensors is kept. Given, they are views of a larger graph's buffers (a
        # bucket's graph replayed on fewer rows).
        if static_inputs is None:
            with torch.no_grad(), torch.inference_mode(False):
                static_inputs = [
                    leaves[i].detach().clone().requires_grad_(leaves[i].requires_grad)
                    for i in self.tensor_index
                ]
        self.static_inputs = static_inputs
        # The captured call's TensorDicts' key orders, which rebuilt trees keep.
        self._orders = _tree.key_orders((call.args, call.kwargs))
        self._static_leaves = list(leaves)
        for i, static in zip(self.tensor_index, self.static_inputs, strict=True):
            self._static_leaves[i] = static
        # The captured inputs as the user passed them, kept for error messages and to choose
        # a reader; the function gets trees of its own (see static_tree), which it may change
        # (write TensorDict keys).
        self.static_args, self.static_kwargs = self.static_tree()

    def static_tree(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """New containers (tuples, dicts, TensorDicts) around the graph's static input tensors,
        the TensorDicts' keys in the captured call's order."""
        tree = _tree.unflatten(self.spec, self._static_leaves)
        if self._orders is not None:
            tree = _tree.in_key_orders(tree, self._orders)
        return tree  # type: ignore[no-any-return]

    def read(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], flat: _tree.Flat | None = None
    ) -> list[Any] | None:
        """The tensor leaves of a call of the captured structure and constants, else None.

        The general reader of the replay path: it flattens the call (unless the slow path
        gives it ``flat``, the call flattened already). The tensors' metadata is left to the
        replay's check.
        """
        if flat is None:
            flat = optree.tree_flatten(cast(Any, (args, kwargs)), namespace=_tree.NAMESPACE)
        leaves, spec = flat
        if spec != self.spec:
            return None
        if not self.const_index:  # every leaf is a tensor
            return leaves
        try:
            if [(type(leaves[i]), leaves[i]) for i in self.const_index] != self.consts:
                return None
        except Exception:  # a constant whose comparison raises: not the captured one
            return None
        return [leaves[i] for i in self.tensor_index]

    def match(self, call: Call, *, requires_grad: bool = True) -> list[Any]:
        """The tensor leaves of a call, checked in full against the capture (the slow path).

        Without ``requires_grad``, the tensors' ``requires_grad`` is not compared.

        Raises:
            ValueError, KeyError, RuntimeError: The call differs from the capture; the error
                names the leaf (see ``diagnose``).
        """
        tensors = self.read(call.args, call.kwargs, (call.leaves, call.spec))
        # A leaf that is not a tensor, where the capture had one, raises in `metadata`.
        with contextlib.suppress(Exception):
            if tensors is not None:
                received = list(map(metadata, tensors))
                # Without `requires_grad`, the last item of each tensor's metadata.
                if received == self.expected or (
                    not requires_grad and _gradless(received) == _gradless(self.expected)
                ):
                    return tensors
        error = self.diagnose(call, requires_grad=requires_grad)
        if error is not None:
            raise error
        # Only tensor types differ, and only by a subclass (a Parameter for a tensor): the
        # graph reads their data as well.
        assert tensors is not None
        return tensors

    def tensors(self, call: Call) -> list[torch.Tensor]:
        """The tensor leaves of a call of the captured structure, unchecked."""
        return [call.leaves[i] for i in self.tensor_index]

    def tensor_paths(self) -> list[str]:
        """Readable paths of the tensor inputs, in the order of ``static_inputs`` (for errors)."""
        paths = _tree.spec_paths(self.spec)
        return [paths[i] for i in self.tensor_index]

    def diagnose(
        self,
        call: Call,
        *,
        shapes: bool = True,
        requires_grad: bool = True,
    ) -> Exception | None:
        """The error that explains how a call's inputs differ from the captured ones.

        None when they differ only by the subclass of a tensor, which is not an error, or,
        with ``shapes=False``, by shapes, batch sizes and ``requires_grad`` (a call for
        another graph of a wrapper with ``shapes="exact"``), or, with
        ``requires_grad=False``, by ``requires_grad`` (`make_graphed_callables`, as torch's).
        """
        walk = _Walk(self.name, shapes=shapes, requires_grad=requires_grad)
        error = walk.trees((), (self.static_args, self.static_kwargs), (call.args, call.kwargs))
        if error is not None:
            return error
        missing, extra, other = walk.missing, walk.extra, walk.other
        if missing and not extra and not other and missing == walk.missing_td_keys:
            return _errors.missing_keys(self.name, missing)
        if missing or extra or other:
            unbound = self._unbound(call)
            return _errors.structure_mismatch(self.name, missing, extra, other, unbound)
        # Nothing differs leaf by leaf: the structure differs in a way the walk does not name
        # (e.g. a node's metadata that is neither a key nor a batch size), or nothing does.
        received = call.spec
        if received == self.spec or not shapes:
            return None
        return _errors.structure_mismatch(
            self.name, [], [], [f"captured: {self.spec}", f"received: {received}"]
        )

    def _unbound(self, call: Call) -> str | None:
        """Why the function could not take this call, as Python says it (``missing a required
        argument: 'scale'``); None where it could, or where its signature does not tell (one
        that the captured call does not bind to either)."""
        if self.python_signature is None:
            return None
        try:
            self.python_signature.bind(*self.static_args, **self.static_kwargs)
        except TypeError:
            return None
        try:
            self.python_signature.bind(*call.args, **call.kwargs)
        except TypeError as err:
            return str(err)
        return None

    def diagnose_tensor(self, where: str, captured: Any, received: Any) -> Exception | None:
        """The error that explains how one input tensor differs from the captured one
        (device, dtype, shape, ``requires_grad``), for an input passed otherwise than in the
        captured tree and named ``where`` as the user passed it (a TensorDict module's keyword
        tensor)."""
        return _Walk(self.name).leaves(where, captured, received)


def _python_signature(function: Any) -> inspect.Signature | None:
    """The signature that calls of ``function`` bind to (a module's ``forward``'s), or None."""
    if function is None:
        return None
    if isinstance(function, torch.nn.Module):
        function = function.forward
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):  # a builtin, or no callable: nothing to tell
        return None


class _Walk:
    """The captured inputs and a call's, walked side by side (see `Signature.diagnose`): the
    first difference that has an error of its own, and the paths of structure differences.

    Without ``shapes``, shapes, batch sizes and ``requires_grad`` are not compared; without
    ``requires_grad``, ``requires_grad`` is not.
    """

    def __init__(self, name: str, *, shapes: bool = True, requires_grad: bool = True):
        self.name = name
        self.shapes = shapes
        self.requires_grad = shapes and requires_grad
        self.missing: list[str] = []  # entries of the capture that the call lacks
        self.extra: list[str] = []  # entries of the call that the capture lacked
        self.other: list[str] = []  # nodes whose metadata differs
        self.missing_td_keys: list[str] = []  # those of `missing` that are TensorDict keys

    def trees(self, path: tuple[optree.PyTreeEntry, ...], old: Any, new: Any) -> Exception | None:
        where = _tree.format_path(path)
        old_leaf, new_leaf = _tree.is_leaf(old), _tree.is_leaf(new)
        if old_leaf and new_leaf:
            return self.leaves(where, old, new)
        if old_leaf != new_leaf or type(old) is not type(new):
            return _errors.leaf_kind_mismatch(self.name, where, old, new)
        tensordict = isinstance(old, TensorDictBase)
        if self.shapes and tensordict and old.batch_size != new.batch_size:
            return _errors.batch_size_mismatch(self.name, where, old.batch_size, new.batch_size)
        old_children, old_metadata = _tree.one_level(old)
        new_children, new_metadata = _tree.one_level(new)
        for key in old_children.keys() - new_children.keys():
            self.missing.append(_tree.format_path((*path, old_children[key][0])))
            if tensordict:
                self.missing_td_keys.append(self.missing[-1])
        for key in new_children.keys() - old_children.keys():
            self.extra.append(_tree.format_path((*path, new_children[key][0])))
        for key, (entry, old_child) in old_children.items():
            if key in new_children:
                error = self.trees((*path, entry), old_child, new_children[key][1])
                if error is not None:
                    return error
        if (
            not self.missing
            and not self.extra
            and _meta(old_metadata, self.shapes) != _meta(new_metadata, self.shapes)
        ):
            self.other.append(f"{where}: {old_metadata!r} at capture, {new_metadata!r} now")
        return None

    def leaves(self, where: str, old: Any, new: Any) -> Exception | None:
        old_tensor, new_tensor = isinstance(old, torch.Tensor), isinstance(new, torch.Tensor)
        if old_tensor != new_tensor:
            return _errors.leaf_kind_mismatch(self.name, where, old, new)
        if not old_tensor:
            try:
                same = type(old) is type(new) and bool(old == new)
            except Exception:
                same = False
            return None if same else _errors.constant_mismatch(self.name, where, old, new)
        if new.device != old.device:
            return _errors.device_mismatch(self.name, where, old.device, new.device)
        if new.dtype != old.dtype:
            return _errors.dtype_mismatch(self.name, where, old.dtype, new.dtype)
        if self.shapes and new.shape != old.shape:
            return _errors.shape_mismatch(self.name, where, old.shape, new.shape)
        if not self.requires_grad or new.requires_grad == old.requires_grad:
            return None
        if new.requires_grad:
            return _errors.requires_grad(self.name, where)
        return _errors.no_longer_requires_grad(self.name, where)


def _gradless(metadata: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Tensors' ``metadata`` without their ``requires_grad`` (the last item)."""
    return [meta[:-1] for meta in metadata]


def _meta(metadata: Any, shapes: bool) -> Any:
    """A node's metadata, without its batch size when shapes are not compared."""
    if shapes or not hasattr(metadata, "batch_size"):
        return metadata
    return metadata._replace(batch_size=None)
