"""The package's layers, drawn from its imports (docs/architecture.md draws the same picture).

Every ``import`` and ``from ... import`` of a ``sharedarrays`` module counts, at module level
or inside a function, under ``TYPE_CHECKING`` or not. Three rules:

- no import circles between modules;
- a module imports only modules of its own layer or of layers below it;
- interpreter and standard-library internals (``sys.getrefcount``, ``sys._getframe``, frame
  attributes, multiprocessing's spawning record and private names) are used only in the one
  adapter, ``sharedarrays/_cpython.py``, which has a test for each (tests/test_cpython.py).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sharedarrays"

# bottom to top; a module belongs to the layer of the longest prefix that names it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "sharedarrays._cpython",
            "sharedarrays.errors",
            "sharedarrays.settings",
            "sharedarrays.process",
            "sharedarrays.sections",
            "sharedarrays.node",
        ),
    ),
    ("protocol", ("sharedarrays.protocol",)),
    ("backends", ("sharedarrays.backends",)),
    ("memory", ("sharedarrays.memory",)),
    ("transport", ("sharedarrays.transport", "sharedarrays.keeper")),
    ("importing", ("sharedarrays.importing",)),
    ("api", ("sharedarrays.api",)),
    ("package", ("sharedarrays",)),
    ("tools", ("sharedarrays.cli", "sharedarrays.__main__")),
]


@functools.cache
def modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


@functools.cache
def imports() -> dict[str, set[str]]:
    """Module -> the ``sharedarrays`` modules it imports."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for name, (path, is_package) in known.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    # ``from pkg import mod`` imports pkg.mod; ``from mod import name`` imports mod
                    full = f"{module}.{alias.name}"
                    targets.append(full if full in known else module)
            for target in targets:
                if not target.startswith("sharedarrays"):
                    continue
                resolved = resolve(target)
                if resolved and resolved != name:
                    edges[name].add(resolved)
    return edges


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")
    return max(matches)[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_imports_inside_functions() -> None:
    edges = imports()
    # the CLI imports the node-wide map inside its subcommands' functions only
    assert "sharedarrays.api.nodemap" in edges["sharedarrays.cli"]


def test_no_import_circles() -> None:
    assert cycles(imports()) == []


def test_cycle_finder_finds_a_circle() -> None:
    circle = {"sharedarrays.errors": {"sharedarrays.settings"}}
    circle["sharedarrays.settings"] = {"sharedarrays.errors"}
    assert cycles(circle) == [["sharedarrays.errors", "sharedarrays.settings"]]


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_point_down_the_layers(module: str) -> None:
    mine = layer_of(module)
    upward = sorted(
        f"{target} ({LAYERS[layer_of(target)][0]})"
        for target in imports().get(module, ())
        if layer_of(target) > mine
    )
    assert not upward, f"{module} ({LAYERS[mine][0]}) imports upwards: {', '.join(upward)}"


ADAPTER = PACKAGE / "_cpython.py"
"""The one module that may use interpreter and standard-library internals."""

INTERNALS = re.compile(
    r"getrefcount|_getframe|currentframe|\bf_(back|globals|locals|code)\b"
    r"|[gs]et_spawning_popen|_args_from_interpreter_flags"
)
"""What only the adapter names (comments and docstrings included, as a grep would find)."""


def _private_multiprocessing(tree: ast.AST) -> list[str]:
    """``from multiprocessing... import _name`` and ``<multiprocessing module>._name``."""
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "multiprocessing":
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("multiprocessing"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def internals_used(path: Path) -> list[str]:
    text = path.read_text()
    found = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if INTERNALS.search(line)
    ]
    return found + _private_multiprocessing(ast.parse(text, str(path)))


def test_the_internals_checker_finds_each_kind() -> None:
    tree = ast.parse(
        "import multiprocessing.util\nfrom multiprocessing import context as c\n"
        "from multiprocessing.context import _default_context\n"
        "c._tls\nmultiprocessing.util._afterfork_registry\nc.get_context\n"
    )
    assert len(_private_multiprocessing(tree)) == 3
    assert all(INTERNALS.search(s) for s in ("sys.getrefcount(x)", "frame.f_globals"))
    assert not INTERNALS.search("frame_function(caller_frame())")


@pytest.mark.parametrize(
    "path",
    sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p != ADAPTER and "bench" not in p.relative_to(PACKAGE).parts[:1]
    ),
)
def test_internals_only_in_the_adapter(path: str) -> None:
    found = internals_used(PACKAGE / path)
    assert not found, (
        f"sharedarrays/{path} uses interpreter or standard-library internals itself; "
        "call sharedarrays/_cpython.py (add a named function there, with a test in "
        "tests/test_cpython.py): " + "; ".join(found)
    )
