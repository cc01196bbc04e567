"""apex_amp's modules import each other in one direction only, at the top of each file.

The graph is read from the source with ``ast``: every ``import`` and ``from ...
import`` of an apex_amp module, wherever it stands, is an edge. A package's
``__init__`` re-exports its submodules, so importing ``apex_amp.ops`` from
inside ``apex_amp.amp`` is an edge to ``apex_amp.ops`` itself, not to the
``apex_amp`` package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "apex_amp"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(importer: str, node: ast.AST) -> list[str]:
    """The apex_amp modules an import statement of ``importer`` loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    if node.level:
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        submodule = f"{target}.{alias.name}"
        if submodule in MODULES:
            found.append(submodule)  # `from . import sessions`: the submodule itself
        elif target in MODULES:
            found.append(target)
    return found


def import_edges() -> dict[str, dict[str, list[int]]]:
    """importer -> {imported: [line, ...]}; also the lines of imports not at module level."""
    edges: dict[str, dict[str, list[int]]] = {name: {} for name in MODULES}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(name, node):
                    if target != name:
                        edges[name].setdefault(target, []).append(node.lineno)
    return edges


def find_cycle(edges: dict[str, dict[str, list[int]]]) -> list[str]:
    # Package __init__ files re-export their submodules: edges into them from inside are not cycles.
    def follows(source: str, target: str) -> bool:
        return not (is_package(source) and target.startswith(source + "."))

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in edges[node]:
            if not follows(node, target):
                continue
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_module_import_graph_has_no_cycle():
    cycle = find_cycle(import_edges())
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    edges = {"apex_amp.amp.session": {"apex_amp.amp.gradients": [1]}, "apex_amp.amp.gradients": {"apex_amp.amp.session": [2]}}
    assert find_cycle(edges) == ["apex_amp.amp.gradients", "apex_amp.amp.session", "apex_amp.amp.gradients"]


def test_no_apex_amp_module_is_imported_inside_a_function_or_a_type_checking_block():
    # A deferred import of our own modules is how a cycle hides; optional third-party packages
    # (matplotlib for plots) may still be imported where they are used.
    deferred = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level and resolve(name, node):
                deferred.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not deferred


@pytest.mark.parametrize("module", ["apex_amp.amp", "apex_amp.ops", "apex_amp.optimizers", "apex_amp.__main__"])
def test_each_public_module_imports_on_its_own(module):
    # A fresh interpreter per entry point: an import order that only works after another module
    # was loaded would fail here.
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
