"""The package's layout: subpackages by concern, small private modules, and imports that
never go in a circle."""

from __future__ import annotations

import ast
import pathlib
import pydoc
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

import cudagraph_td

from .conftest import Backend, regression_step

PACKAGE = pathlib.Path(__file__).parent.parent / "src" / "cudagraph_td"
# The package's top level: its public surface, its version, the one place for private
# upstream APIs, and a subpackage per concern (see docs/architecture.md).
TOP_LEVEL = {"__init__.py", "_version.py", "_compat.py", "py.typed"}
SUBPACKAGES = {"_call", "_values", "_capture", "_emulation", "_shapes", "_state", "_errors"}


def _name(path: pathlib.Path) -> str:
    """A module's dotted name inside the package: ``_call.replay``, ``_compat``, ``_call``
    for a subpackage's ``__init__.py``, ``""`` for the package's own."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, is_package: bool, level: int, module: str | None) -> str:
    """The dotted name inside the package that a relative import of ``level`` dots and
    ``module`` names, from the module ``name``."""
    parts = name.split(".") if name else []
    package = parts if is_package else parts[:-1]
    assert level - 1 <= len(package), (name, level)  # the import stays inside the package
    base = package[: len(package) - level + 1]
    return ".".join([*base, *([module] if module else [])])


def _package_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports at run time (not under TYPE_CHECKING), by
    their dotted names inside the package."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    name, is_package = _name(path), path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        where = _resolve(name, is_package, node.level, node.module)
        for alias in node.names:
            # from .._values import tree as _tree: a module; from .replay import MISS: a name
            submodule = f"{where}.{alias.name}" if where else alias.name
            found.add(submodule if submodule in modules else where)
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_name(p) for p in paths}
    return {_name(p): _package_imports(p, modules) for p in paths}


def test_the_import_walk_resolves_relative_imports() -> None:
    graph = _graph()
    assert {"_call.table", "_capture.sharing", "_compat"} <= graph["_call.module"]
    assert "_values.tree" in graph["_values.routes"]  # from . import tree as _tree
    assert "_compat" in graph["_capture.backend"]  # from .. import _compat
    assert "_call.module" in graph[""]  # from ._call.module import CudaGraphModule
    assert graph["_call"] == set()  # a subpackage's __init__.py imports nothing


def test_no_import_cycle() -> None:
    graph = _graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for module in graph.get(start, ()):
            if module == goal or (module not in seen and reaches(module, goal, seen | {module})):
                return True
        return False

    cycles = sorted(module for module in graph if reaches(module, module, set()))
    assert cycles == []


# The subpackages from the top down (docs/architecture.md): each imports only those below
# it: the call path, the graphs of several shapes, capture and backends, what a graph holds
# and reads, then the messages, the private upstream APIs and the version. Those of one
# rank import none of each other. The package's own `__init__.py` may import any.
LAYERS = [
    {"_call"},
    {"_shapes"},
    {"_capture"},
    {"_emulation", "_state", "_values"},
    {"_errors", "_compat", "_version"},
]


def _layer(module: str) -> int:
    """The rank of a module's subpackage (0: the top)."""
    top = module.split(".")[0]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_the_layers_cover_the_package() -> None:
    assert set().union(*LAYERS) == SUBPACKAGES | {"_compat", "_version"}


def test_subpackages_import_only_those_below_them() -> None:
    # A subpackage is a unit: a module may import its own subpackage's modules (without a
    # cycle, above) and those of a subpackage below its own, never one above or beside it.
    upward = sorted(
        f"{module} imports {imported} ({imported.split('.')[0]} is not below {module.split('.')[0]})"
        for module, imports in _graph().items()
        if module != ""  # the package's __init__.py
        for imported in imports
        if imported.split(".")[0] != module.split(".")[0] and _layer(imported) <= _layer(module)
    )
    assert upward == []


def test_the_top_level_holds_the_subpackages() -> None:
    # The layout shows the architecture: a new module goes into the subpackage of its
    # concern (docs/architecture.md), not beside them.
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == TOP_LEVEL | SUBPACKAGES
    for subpackage in SUBPACKAGES:
        init = PACKAGE / subpackage / "__init__.py"
        tree = ast.parse(init.read_text())
        # A docstring that says the concern, and nothing imported: importing a module of a
        # subpackage runs only that module's own imports.
        assert ast.get_docstring(tree), subpackage
        assert not any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(tree))
        nested = [p for p in (PACKAGE / subpackage).iterdir() if p.is_dir()]
        assert [p.name for p in nested if p.name != "__pycache__"] == []


@pytest.mark.parametrize("name", sorted(set(cudagraph_td.__all__) - {"__version__"}))
def test_public_docstrings_read_as_plain_text(name: str) -> None:
    # `help()` shows docstrings as they are: no Sphinx roles, no Markdown links (the docs'
    # pages are named in words), and examples in an `Examples:` section, which the API page
    # renders as code blocks.
    text = pydoc.render_doc(getattr(cudagraph_td, name), renderer=pydoc.plaintext)
    assert (
        re.findall(r":(?:class|func|meth|attr|data|mod|exc):`|\]\[[\w.-]*\]|\]\([\w.#-]+\)", text)
        == []
    )
    assert "Example:\n" not in text


_UPSTREAM = ("torch", "tensordict")
# Python's own underscored API: named tuples' methods, `sys._getframe`.
_PYTHON_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_getframe"}
_ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr", "attrgetter", "methodcaller"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(paths: list[pathlib.Path]) -> tuple[set[str], set[str]]:
    """The package's own private attribute names (assigned to ``self`` or ``cls``, defined
    in a class), and its own modules (by the names its relative imports give them, such as
    ``_tree`` for ``from .._values import tree as _tree``) and classes, whose private names
    it may use."""
    attributes, owners = set(), {p.stem for p in paths}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module is None:
                owners.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.ClassDef):
                owners.add(node.name)
                for stmt in node.body:
                    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                        attributes.add(stmt.name)
                    for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                        if isinstance(target, ast.Name):
                            attributes.add(target.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                attributes.add(node.attr)
    return attributes, owners


def private_uses(source: str, attributes: set[str], owners: set[str]) -> list[str]:
    """The private torch or tensordict names that ``source`` uses, as ``line: code``.

    A private name is one that starts with ``_`` (not a dunder): imported from torch or
    tensordict (or a module of theirs that is private), or read as an attribute of anything
    but the package's own objects (``self`` or ``cls`` for an attribute the package defines,
    one of its modules or classes), also through ``getattr`` or ``operator.attrgetter``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in _UPSTREAM]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in _UPSTREAM:
                names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            receiver = node.value.id if isinstance(node.value, ast.Name) else None
            own = (receiver in ("self", "cls") and node.attr in attributes) or receiver in owners
            if not own and node.attr not in _PYTHON_PRIVATE:
                names = [node.attr]
        elif isinstance(node, ast.Call):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else None
            function = node.func.id if isinstance(node.func, ast.Name) else function
            if function in _ATTRIBUTE_CALLS:
                names = [
                    arg.value
                    for arg in node.args
                    if isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value not in attributes
                ]
        if any(_private(part) for name in names for part in name.split(".")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_upstream_names_are_used_in_compat_only() -> None:
    # Every private torch or tensordict API is an entry of `_compat.py`, which says the
    # versions it was checked against, and which `tests/test_compat.py` pins.
    paths = sorted(PACKAGE.rglob("*.py"))
    attributes, owners = _own_names([p for p in paths if p.name != "_compat.py"])
    uses = {
        str(path.relative_to(PACKAGE)): found
        for path in paths
        if path.name != "_compat.py"
        and (found := private_uses(path.read_text(), attributes, owners))
    }
    assert uses == {}
    assert private_uses((PACKAGE / "_compat.py").read_text(), attributes, owners)  # it sees them


@pytest.mark.parametrize(
    "code",
    [
        "import torch._dynamo",
        "from torch.utils._pytree import tree_map",
        "from torch.overrides import _get_current_function_mode_stack",
        "from tensordict._td import TensorDict",
        "torch._C._set_grad_enabled(False)",
        "torch.ops.aten._local_scalar_dense.default",
        "module._parameters",
        "td._tensordict",
        "self._forward_hooks",
        "getattr(module, '_buffers', None)",
        "operator.attrgetter('_version')",
    ],
)
def test_the_private_use_scan_sees(code: str) -> None:
    assert private_uses(code, {"_graphs"}, {"_compat"})


@pytest.mark.parametrize(
    "code",
    [
        "self._graphs",
        "_compat.td_entries",
        "_compat._aten",
        "options._replace(device=None)",
        "sys._getframe(1)",
        "from torch.overrides import TorchFunctionMode",
        "x.__dict__",
    ],
)
def test_the_private_use_scan_leaves(code: str) -> None:
    assert private_uses(code, {"_graphs"}, {"_compat"}) == []


# What a capture gives the layer below it to run: the function under capture (wrapped in
# `run_static`, `Capture._run_forward` or a lambda) and its saved-tensors hook (`keep`), which
# the recorder calls as torch's capture calls the function. Not a path of the library.
_CAPTURED = {"run_static", "_run_forward", "<lambda>", "keep"}


def _calls_upward(run: Callable[[], Any]) -> list[str]:
    """The calls that ``run()`` makes from a module of the package to one of a layer above
    it (each call from its nearest caller in the package: tensordict's dispatch between them
    is seen through)."""
    package = "cudagraph_td."
    upward: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(package):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith(package):
            caller = caller.f_back
        if caller is None:
            return
        outer = caller.f_globals["__name__"][len(package) :]
        inner = callee[len(package) :]
        if frame.f_code.co_name in _CAPTURED and inner in ("_capture.graph", "_capture.autograd"):
            return  # the function under capture, which the recorder runs (see `_CAPTURED`)
        if outer and inner and _layer(inner) < _layer(outer):
            upward.add(f"{outer}.{caller.f_code.co_name} -> {inner}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(upward)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _function_calls() -> None:
    graphed = cudagraph_td.CudaGraphModule(_net(), warmup=2, backend="emulate")
    for grad in (False, True):  # a plain graph, then forward and backward in one node
        with torch.set_grad_enabled(grad):
            for _ in range(4):
                graphed(torch.randn(3, 4))
            graphed._table.clear()  # a replay on the slow path too
            graphed(torch.randn(3, 4))


def _module_calls() -> None:
    policy = TensorDictModule(_net(), in_keys=["obs"], out_keys=["action"])
    graphed = cudagraph_td.CudaGraphModule(policy, warmup=2, backend="emulate")
    with torch.no_grad():
        for _ in range(4):
            graphed(TensorDict(obs=torch.randn(3, 4), batch_size=[3]))
            graphed(obs=torch.randn(3, 4))
        graphed._table.clear()
        graphed(TensorDict(obs=torch.randn(3, 4), batch_size=[3]))


def _shaped_calls() -> None:
    for shapes in (cudagraph_td.Exact(), cudagraph_td.Buckets([4, 8])):
        graphed = cudagraph_td.CudaGraphModule(_net(), warmup=2, backend="emulate", shapes=shapes)
        with torch.no_grad():
            for batch in (3, 5, 3, 5, 3, 5):
                graphed(torch.randn(batch, 4))
            graphed._table.clear()
            graphed(torch.randn(3, 4))


def _training_steps() -> None:
    update, _ = regression_step(Backend("emulate"), _net())
    graphed = cudagraph_td.CudaGraphModule(update, warmup=2, backend="emulate")

    def batch() -> TensorDict:
        return TensorDict(obs=torch.randn(3, 4), target=torch.randn(3, 2), batch_size=[3])

    for _ in range(4):
        graphed(batch())
    graphed._table.clear()
    graphed(batch())


@pytest.mark.parametrize(
    "run",
    [_function_calls, _module_calls, _shaped_calls, _training_steps],
    ids=["function", "tensordict-module", "exact-and-buckets", "training-step"],
)
def test_the_capture_and_replay_paths_go_one_way_down(run: Callable[[], None]) -> None:
    # Every call inside the package, from the first warm-up to the replays (on the table's
    # path and on the slow path), goes to a module of its own layer or of one below it.
    assert _calls_upward(run) == []


# One unit per graph, one key, one copy (docs/architecture.md): what the redesign of the
# middle floor removed stays removed.


def _classes() -> dict[str, list[str]]:
    """The package's classes by name, with the modules that define them."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(_name(path))
    return found


def test_one_key_type_decides_where_a_call_goes() -> None:
    # The graph table and the graphs of every mode, device and static values are keyed by
    # one named key; no other key class, and no graph key spelt as a bare alias.
    classes = _classes()
    keys = sorted(name for name in classes if name.endswith("Key") and not name.startswith("_"))
    assert keys == ["GraphKey"] and classes["GraphKey"] == ["_capture.entry"]
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert re.findall(r"\b(CallKey|GraphsKey)\b", source) == []


def test_a_graph_is_one_entry_for_its_whole_life() -> None:
    # No runner beside the entry, no liveness by identity between objects, no counts kept
    # apart from the entries.
    classes = _classes()
    assert [name for name in classes if name.endswith("Runner")] == []
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert re.findall(r"\.alive\(\)|\bsource is\b|\._counts\b|_forget_replaced", source) == []


def test_static_inputs_are_copied_in_one_place() -> None:
    # Every launch copies a call's tensors into its graph's static inputs through
    # `_capture.captured.copy_inputs`, or its one-tensor form beside it.
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).endswith("foreach_copy_")
                and re.search(r"static_inputs|^static$", ast.unparse(node.args[0]))
            ):
                copies.append(_name(path))
    assert copies == ["_capture.captured", "_capture.captured"]


# The functions of `_values.tree` that flatten the tree they are given.
_FLATTENING = {"flatten", "leaves_with_paths", "leaf_paths"}


def _frames(run: Callable[[], Any]) -> list[str]:
    """The functions of the call path (`_call`, `_shapes`, `_capture`, `_values`) that
    ``run()`` enters, in order, as ``module.qualname``: not the backends', the emulation's
    or the state's own. A function of `_values.tree` that flattens a call's arguments (a
    tree ``(args, kwargs)``, the call's or its graph's) is marked ``(a call)``."""
    package = "cudagraph_td."
    path = ("_call.", "_shapes.", "_capture.entry", "_capture.captured", "_capture.graph")
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith(package):
            inside = module[len(package) :]
            if inside.startswith((*path, "_values.")):
                code = frame.f_code
                name = f"{inside}.{getattr(code, 'co_qualname', code.co_name)}"
                tree = frame.f_locals.get("tree")
                flattens = code.co_name in _FLATTENING and inside == "_values.tree"
                if flattens and type(tree) is tuple and len(tree) == 2 and type(tree[1]) is dict:
                    name += " (a call)"
                seen.append(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


_LOOKUP = [
    "_call.module.CudaGraphModule.__call__",
    "_call.modes.mode_lookup.<locals>.find",  # one graph per mode: the mode is the key
    "_capture.entry.GraphEntry.replay",
]


def test_the_frames_of_a_replay() -> None:
    # A replay reads top to bottom: the table's lookup, the entry's replay, its route's
    # reader (or the fused one-key TensorDict route), the launch, nothing else.
    graphed = cudagraph_td.CudaGraphModule(_net(), backend="emulate")
    policy = cudagraph_td.CudaGraphModule(
        TensorDictModule(_net(), in_keys=["obs"], out_keys=["action"]), backend="emulate"
    )
    x, td = torch.randn(3, 4), TensorDict(obs=torch.randn(3, 4), batch_size=[3])
    with torch.no_grad():
        for _ in range(3):
            graphed(x)
            policy(td)
        assert _frames(lambda: graphed(x)) == [
            *_LOOKUP,
            "_values.routes.Positional.read",
            "_capture.captured.launch_one",
        ]
        assert _frames(lambda: policy(td)) == [
            *_LOOKUP,
            "_values.routes.OneKeyTensorDict.replay",
            "_capture.captured.launch_one",
        ]


@pytest.mark.parametrize("stage", ["warm-up", "capture", "checked replay"])
def test_the_frames_of_a_first_call_flatten_it_once(stage: str) -> None:
    # The slow path flattens a call once, and hands the flattened call down: to the device,
    # the graph's key, the warm-up's checks, the capture's signature, the full check.
    graphed = cudagraph_td.CudaGraphModule(
        _net(), backend="emulate", shapes=cudagraph_td.Exact(), warmup=2
    )
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(["warm-up", "capture", "checked replay"].index(stage)):
            graphed(x)
        graphed._table.clear()  # a captured graph's call on the slow path too
        frames = _frames(lambda: graphed(x))
    assert [f for f in frames if f.endswith("(a call)")] == ["_values.tree.flatten (a call)"]
    assert frames.count("_values.tree.flatten_call") == 1
    assert "_call.module.CudaGraphModule._call" in frames
    # Whether the state its graph reads holds is asked once, by the entry that replays it.
    assert frames.count("_capture.entry.GraphEntry.holds") == (stage == "checked replay")
