"""The signature of a captured call: what its inputs must look like at every replay.

:class:`Signature` is built once, at capture. It validates the capture's inputs, clones
their tensors into the graph's static buffers, and keeps what the replay compares: the
treespec, the indices of the tensor leaves and each one's ``(shape, dtype, device,
requires_grad)``, and the non-tensor constants. The replay compares these in a few list
operations; only when they differ does :meth:`Signature.diagnose` walk the trees to find
the offending leaf and build the error that names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import optree
import torch
from tensordict import TensorDict, TensorDictBase

from . import _errors, _tree

# (shape, dtype, device, requires_grad): what the replay checks of a tensor leaf.
TensorMeta = tuple[torch.Size, torch.dtype, torch.device, bool]


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return (t.shape, t.dtype, t.device, t.requires_grad)


def quick_meta(t: torch.Tensor) -> tuple[type, torch.Size, torch.dtype, torch.device, bool]:
    """What the replay's fast paths compare of a tensor they read without flattening.

    :func:`tensor_meta` and the type, which tells a tensor from a TensorDict or a
    subclass. (``get_device()`` reads a little faster than ``device`` but gives ``-1`` for
    every device that is not CUDA, so that a meta tensor would pass for a CPU one.) The
    replay paths inline this expression: keep them the same.
    """
    return (type(t), t.shape, t.dtype, t.device, t.requires_grad)


def _comparable(value: Any) -> bool:
    try:
        return isinstance(value == value, bool)
    except Exception:
        return False


def validate(
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    *,
    allow_grad: bool = False,
) -> None:
    """Check that a call can be warmed up or captured on ``device``, before running it.

    ``allow_grad`` accepts inputs that require grad, for a graph captured for autograd.
    """
    for path, leaf in _tree.walk_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                where = _tree.format_path(path)
                raise _errors.wrong_device_at_capture(name, where, device, leaf.device)
            if leaf.requires_grad and not allow_grad:
                raise _errors.requires_grad(name, _tree.format_path(path))
        elif not _comparable(leaf):
            raise _errors.uncomparable_constant(name, _tree.format_path(path), leaf)


class Signature:
    """The inputs of a captured call, and the static buffers that the graph reads."""

    def __init__(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: torch.device,
        *,
        allow_grad: bool = False,
    ):
        validate(name, args, kwargs, device, allow_grad=allow_grad)
        self.name = name
        leaves, self.spec = _tree.flatten((args, kwargs))
        self.tensor_index = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.const_index = [
            i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)
        ]
        self.expected = [tensor_meta(leaves[i]) for i in self.tensor_index]
        self.consts = [leaves[i] for i in self.const_index]
        self.const_types = [type(c) for c in self.consts]
        self.all_tensors = not self.const_index
        self.input_tensors = [leaves[i] for i in self.tensor_index]
        # The graph's own copies of the tensor inputs: replays copy new inputs into them.
        # They are leaves that require grad where the inputs do (a graph captured for
        # autograd differentiates with respect to them), and never inference tensors, so
        # that a graph captured under inference_mode can be fed outside it.
        with torch.no_grad(), torch.inference_mode(False):
            self.static_inputs = [
                t.detach().clone().requires_grad_(t.requires_grad) for t in self.input_tensors
            ]
        del self.input_tensors  # the capture's inputs are the caller's: keep no reference
        self._static_leaves = list(leaves)
        for i, static in zip(self.tensor_index, self.static_inputs, strict=True):
            self._static_leaves[i] = static
        # The captured inputs as the user passed them, kept for error messages; the function
        # gets trees of its own (see static_tree), which it may change (write TensorDict keys).
        self.static_args, self.static_kwargs = self.static_tree()
        # A call of positional tensors only, the commonest, is checked without flattening:
        # the arguments are the tensor leaves. The type is compared too, so that a
        # TensorDict passed where the capture had a tensor goes to the full check.
        positional = bool(args) and not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        self.positional_types = [quick_meta(t) for t in args] if positional else None
        # A call of one TensorDict of tensors (a batch), the other common call, is read by key.
        self.tensordict_arg = TensorDictArg.of(args, kwargs)
        # What `quick_read` compares, for either call.
        self.quick_expected = (
            self.tensordict_arg.expected
            if self.tensordict_arg is not None
            else self.positional_types
        )

    def static_tree(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """New containers (tuples, dicts, TensorDicts) around the graph's static input tensors."""
        return _tree.unflatten(self.spec, self._static_leaves)  # type: ignore[no-any-return]

    def quick_read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The tensor leaves of one of the commonest calls, read without flattening, or None.

        Positional tensors, or one TensorDict of tensors, of the captured metadata (see
        :func:`quick_meta`); any other call, or any difference, returns None for
        :meth:`match` to check (and explain).
        """
        expected = self.quick_expected
        if kwargs or expected is None:
            return None
        tensors: Sequence[Any] | None
        if self.tensordict_arg is not None:
            tensors = self.tensordict_arg.read(args[0]) if len(args) == 1 else None
            if tensors is None:
                return None
        elif len(args) == len(expected):
            tensors = args
        else:
            return None
        try:
            metas = [(type(t), t.shape, t.dtype, t.device, t.requires_grad) for t in tensors]
        except AttributeError:  # a non-tensor where the capture had a tensor
            return None
        return tensors if metas == expected else None

    def match(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor leaves of a call, checked against the capture (the replay's check).

        Raises:
            ValueError, KeyError, RuntimeError: The call differs from the capture; the error
                names the leaf (see :meth:`diagnose`).
        """
        tree: Any = (args, kwargs)
        leaves, spec = optree.tree_flatten(tree, namespace=_tree.NAMESPACE)
        if spec != self.spec:
            raise self.diagnose(args, kwargs)
        tensors = leaves if self.all_tensors else [leaves[i] for i in self.tensor_index]
        try:
            same = [(t.shape, t.dtype, t.device, t.requires_grad) for t in tensors] == self.expected
        except AttributeError:  # a non-tensor where the capture had a tensor
            same = False
        if not same or not (self.all_tensors or self.consts_match(leaves)):
            raise self.diagnose(args, kwargs)
        return tensors

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor leaves of a call of the captured structure, unchecked."""
        leaves, _ = _tree.flatten((args, kwargs))
        return [leaves[i] for i in self.tensor_index]

    def tensor_paths(self) -> list[str]:
        """Readable paths of the tensor inputs, in the order of ``static_inputs`` (for errors)."""
        return [
            _tree.format_path(path)
            for path, leaf in _tree.walk_leaves((self.static_args, self.static_kwargs))
            if isinstance(leaf, torch.Tensor)
        ]

    def consts_match(self, leaves: list[Any]) -> bool:
        """Whether the non-tensor leaves of a call are those of the capture (by type and value)."""
        received = [leaves[i] for i in self.const_index]
        try:
            return [type(c) for c in received] == self.const_types and received == self.consts
        except Exception:
            return False

    def diagnose(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Exception:
        """The error that explains how a call's inputs differ from the captured ones."""
        captured = (self.static_args, self.static_kwargs)
        missing: list[str] = []
        extra: list[str] = []
        other: list[str] = []
        missing_td_keys: list[str] = []
        error = self._compare((), captured, (args, kwargs), missing, extra, other, missing_td_keys)
        if error is not None:
            return error
        if missing_td_keys and not extra and not other and missing == missing_td_keys:
            return _errors.missing_keys(self.name, missing_td_keys)
        if missing or extra or other:
            return _errors.structure_mismatch(self.name, missing, extra, other)
        # Nothing differs leaf by leaf: the structure must differ in a way the walk does not
        # name (e.g. a node's metadata that is neither a key nor a batch size).
        received = optree.tree_structure(cast(Any, (args, kwargs)), namespace=_tree.NAMESPACE)
        return _errors.structure_mismatch(
            self.name, [], [], [f"captured: {self.spec}", f"received: {received}"]
        )

    def _compare(
        self,
        path: _tree.Path,
        old: Any,
        new: Any,
        missing: list[str],
        extra: list[str],
        other: list[str],
        missing_td_keys: list[str],
    ) -> Exception | None:
        where = _tree.format_path(path)
        old_leaf, new_leaf = _tree.is_leaf(old), _tree.is_leaf(new)
        if old_leaf and new_leaf:
            return self._compare_leaves(where, old, new)
        if old_leaf != new_leaf or type(old) is not type(new):
            return _errors.leaf_kind_mismatch(self.name, where, old, new)
        if isinstance(old, TensorDictBase) and old.batch_size != new.batch_size:
            return _errors.batch_size_mismatch(self.name, where, old.batch_size, new.batch_size)
        old_node, new_node = _tree.one_level(old), _tree.one_level(new)
        old_children = dict(zip(old_node.entries, old_node.children, strict=True))
        new_children = dict(zip(new_node.entries, new_node.children, strict=True))

        def child_path(entry: Any) -> _tree.Path:
            return (*path, (old_node.entry_type, entry))

        for entry in old_children.keys() - new_children.keys():
            missing.append(_tree.format_path(child_path(entry)))
            if isinstance(old, TensorDictBase):
                missing_td_keys.append(missing[-1])
        for entry in new_children.keys() - old_children.keys():
            extra.append(_tree.format_path(child_path(entry)))
        for entry in old_node.entries:
            if entry in new_children:
                error = self._compare(
                    child_path(entry),
                    old_children[entry],
                    new_children[entry],
                    missing,
                    extra,
                    other,
                    missing_td_keys,
                )
                if error is not None:
                    return error
        if not missing and not extra and old_node.metadata != new_node.metadata:
            other.append(f"{where}: {old_node.metadata!r} at capture, {new_node.metadata!r} now")
        return None

    def _compare_leaves(self, where: str, old: Any, new: Any) -> Exception | None:
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
        if new.shape != old.shape:
            return _errors.shape_mismatch(self.name, where, old.shape, new.shape)
        if new.requires_grad and not old.requires_grad:
            return _errors.requires_grad(self.name, where)
        if old.requires_grad and not new.requires_grad:
            return _errors.no_longer_requires_grad(self.name, where)
        return None


class TensorDictArg:
    """The layout of a call of one plain TensorDict of tensors, read without flattening.

    :meth:`read` returns the entries of a TensorDict of the captured layout (type, batch
    size, device, keys, no names) in the order of the graph's static inputs; ``expected``
    is the quick metadata (see :func:`quick_meta`) that :meth:`Signature.quick_read` then
    compares. Anything else takes the full check.
    """

    def __init__(self, td: TensorDict):
        self.keys = tuple(sorted(td.keys()))  # the flattening order (see `_tree`)
        self.batch_size = td.batch_size
        self.device = td.device
        self.expected = [quick_meta(td._get_str(key, None)) for key in self.keys]

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TensorDictArg | None:
        if kwargs or len(args) != 1 or type(args[0]) is not TensorDict:
            return None
        td = args[0]
        if td._has_names() or not all(isinstance(v, torch.Tensor) for v in td.values()):
            return None
        return cls(td)

    def read(self, td: Any) -> list[torch.Tensor] | None:
        """The entries of ``td`` in the static inputs' order, if it has the captured layout."""
        if type(td) is not TensorDict or td.batch_size != self.batch_size:
            return None
        entries = td._tensordict
        if len(entries) != len(self.keys) or td.device != self.device or td._has_names():
            return None
        try:
            return [entries[key] for key in self.keys]
        except KeyError:
            return None
