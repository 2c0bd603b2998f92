"""The collectives package is layered: every module imports only modules of its own or a
lower layer, the import graph has no cycle, and no module imports another one of the
package inside a function (the usual way to hide a cycle). Imports are read from the
source with ``ast`` (module-level and function-level alike), so a cycle hidden by a lazy
import is found even though the package imports fine.

``LAYERS`` is the intended order, lowest first; a new module must be placed in it.
Modules outside the table (``distlaunch.errors``, ``distlaunch.env``...) are not checked
yet: a later step extends the table to the whole package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (layer, modules), lowest layer first. A module may import modules of its own layer
# (as long as there is no cycle) and of the layers before it.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "base: errors, wire format, reduce ops, buffers, stores, transport interface",
        [
            "distlaunch.collectives.errors",
            "distlaunch.collectives.wire",
            "distlaunch.collectives.ops",
            "distlaunch.collectives.buffers",
            "distlaunch.collectives.filestore",
            "distlaunch.collectives.transport",
        ],
    ),
    (
        "operation context and Work handles (no group)",
        ["distlaunch.collectives.context", "distlaunch.collectives.work"],
    ),
    (
        "transports: TCP and the shared-memory channel",
        ["distlaunch.collectives.tcp", "distlaunch.collectives.shm"],
    ),
    (
        "algorithms over each transport",
        ["distlaunch.collectives.algorithms", "distlaunch.collectives.shm_algorithms"],
    ),
    (
        "backends: TCP, shared memory, hierarchical",
        ["distlaunch.collectives.backend", "distlaunch.collectives.hierarchy"],
    ),
    ("process groups", ["distlaunch.collectives.group"]),
    ("runtime: init, new_group, destroy", ["distlaunch.collectives.runtime"]),
    ("public API", ["distlaunch.collectives.api", "distlaunch.collectives.objects"]),
    ("package and tools", ["distlaunch.collectives", "distlaunch.collectives.bench"]),
]

PACKAGES = ["distlaunch.collectives"]  # the packages whose every module must be in LAYERS


def layer_of() -> dict[str, int]:
    return {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def module_files(package: str) -> dict[str, str]:
    """Qualified module name -> file, for every .py file of ``package`` (not recursive)."""
    d = os.path.join(ROOT, *package.split("."))
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".py"):
            name = package if f == "__init__.py" else f"{package}.{f[:-3]}"
            out[name] = os.path.join(d, f)
    return out


class Import:
    def __init__(self, target: str, line: int, in_function: bool):
        self.target, self.line, self.in_function = target, line, in_function


def imports_of(module: str, path: str, known: set[str]) -> list[Import]:
    """Every import of a module in ``known`` by ``module`` (relative imports resolved;
    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module).
    Importing a submodule also runs its package's __init__; that implicit edge is not
    counted (else every submodule would depend on the package that imports it)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = os.path.basename(path) == "__init__.py"
    base_parts = module.split(".") if is_pkg else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = base_parts[: len(base_parts) - child.level + 1]
                    src = ".".join(parts + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                # ``from pkg import sub`` imports the module pkg.sub; other names come from src
                subs = [f"{src}.{a.name}" for a in child.names]
                targets = [t for t in subs if t in known]
                if len(targets) < len(subs):
                    targets.append(src)
            for t in targets:
                if t in known and t != module:
                    found.append(Import(t, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def import_graph() -> dict[str, list[Import]]:
    files = {m: p for pkg in PACKAGES for m, p in module_files(pkg).items()}
    known = set(files) | set(layer_of())
    return {m: imports_of(m, p, known) for m, p in files.items()}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in graph.get(u, []):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state:
                cyc = dfs(v)
                if cyc:
                    return cyc
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            cyc = dfs(u)
            if cyc:
                return cyc
    return None


def test_every_module_has_a_layer():
    layers = layer_of()
    missing = [m for pkg in PACKAGES for m in module_files(pkg) if m not in layers]
    assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"
    stale = [m for m in layers if m not in {m for pkg in PACKAGES for m in module_files(pkg)}]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_upward_import():
    layers = layer_of()
    bad = [
        f"{m} (layer {layers[m]}: {LAYERS[layers[m]][0]}) imports {i.target} (layer {layers[i.target]}: "
        f"{LAYERS[layers[i.target]][0]}) on line {i.line}"
        for m, imps in import_graph().items()
        for i in imps
        if layers[i.target] > layers[m]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {m: sorted({i.target for i in imps}) for m, imps in import_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_level_import_inside_the_package():
    bad = [
        f"{m} line {i.line}: imports {i.target} inside a function"
        for m, imps in import_graph().items()
        for i in imps
        if i.in_function
    ]
    assert not bad, "\n".join(bad)


def test_checker_finds_cycles_and_upward_imports(tmp_path):
    """The checks themselves: a hidden (function-level) cycle and an upward import."""
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None
    src = tmp_path / "m.py"
    src.write_text("from . import low\n\ndef f():\n    from .high import x\n")
    imps = imports_of("p.m", str(src), {"p.low", "p.high", "p.m"})
    assert [(i.target, i.in_function) for i in imps] == [("p.low", False), ("p.high", True)]


@pytest.mark.parametrize("module", sorted(layer_of()))
def test_module_imports_alone_in_a_fresh_interpreter(module):
    """Each module imports first in its interpreter (no import-order dependence)."""
    p = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert p.returncode == 0, p.stderr[-3000:]
