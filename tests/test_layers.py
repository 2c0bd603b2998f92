"""distlaunch is layered: every module imports only modules of its own or a lower layer,
and the import graph has no cycle. Imports are read from the source with ``ast``
(module-level and function-level alike), so a cycle or an upward dependency hidden by a
lazy import is found even though the package imports fine. Function-level imports are
allowed for start-up speed (paramiko only when SSH is used, the store server only where
one is hosted) but count like any other.

Two stricter rules: the collectives (the workers' runtime) import nothing of the
launcher, only ``errors``, ``env``, ``secret``, ``progress`` and ``store``; and inside the collectives
no module imports another one inside a function.

``LAYERS`` is the intended order, lowest first; a new module must be placed in it.
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
        "leaves: errors, the round vocabulary and its pure records, pure rank arithmetic, the "
        "package root, the reporter, the start-up's collector pause",
        ["distlaunch.errors", "distlaunch.rounds", "distlaunch.report", "distlaunch.topology", "distlaunch"]
        + ["distlaunch.progress", "distlaunch.startup", "distlaunch.workerenv", "distlaunch.cpus"],
    ),
    (
        "pure decisions: the restart policies and the agent's phases",
        ["distlaunch.policy", "distlaunch.agent.phases"],
    ),
    (
        "standard-library helpers: environment contract, secrets, config, hosts, store framing, "
        "the remote command line and Slurm's agent step, GPUs and NUMA",
        [
            "distlaunch.env",
            "distlaunch.devices",
            "distlaunch.numa",
            "distlaunch.secret",
            "distlaunch.config",
            "distlaunch.run_options",
            "distlaunch.hosts",
            "distlaunch.hostlist",
            "distlaunch.store.protocol",
            "distlaunch.store.core",
            "distlaunch.store.torch_protocol",
            "distlaunch.remote",
            "distlaunch.remote.command",
            "distlaunch.remote.srun",
        ],
    ),
    (
        "one node's worker supervision (agent/): process records, output sinks, worker processes, "
        "signals, the orphan guard, round 0's light spawn, one attempt's worker group",
        [
            "distlaunch.agent",
            "distlaunch.agent.kill",
            "distlaunch.agent.output",
            "distlaunch.agent.process",
            "distlaunch.agent.signals",
            "distlaunch.agent.guard",
            "distlaunch.agent.lane",
            "distlaunch.agent.group",
        ],
    ),
    (
        "the store, SSH connections",
        [
            "distlaunch.store.client",
            "distlaunch.store.session",
            "distlaunch.store.server",
            "distlaunch.store",
            "distlaunch.remote.ssh",
            "distlaunch.remote.preflight",
        ],
    ),
    ("rendezvous: the round protocol's store I/O", ["distlaunch.rendezvous"]),
    (
        "collectives base: errors, op table, wire format, reduce ops, buffers, stores, transport interface",
        [
            "distlaunch.collectives.errors",
            "distlaunch.collectives.optable",
            "distlaunch.collectives.wire",
            "distlaunch.collectives.ops",
            "distlaunch.collectives.buffers",
            "distlaunch.collectives.filestore",
            "distlaunch.collectives.transport",
        ],
    ),
    (
        "collectives: operation context and Work handles (no group)",
        ["distlaunch.collectives.context", "distlaunch.collectives.work"],
    ),
    (
        "collectives transports: TCP and the shared-memory channel",
        [
            "distlaunch.collectives.transport.tcp",
            "distlaunch.collectives.transport.shm",
            "distlaunch.collectives.transport.shm_p2p",
        ],
    ),
    (
        "collectives algorithms over each transport",
        [
            "distlaunch.collectives.algorithms",
            "distlaunch.collectives.algorithms.tcp",
            "distlaunch.collectives.algorithms.shm",
        ],
    ),
    (
        "collectives backends: TCP, shared memory, hierarchical",
        ["distlaunch.collectives.algorithms.backend", "distlaunch.collectives.algorithms.hierarchy"],
    ),
    ("collectives process groups", ["distlaunch.collectives.group"]),
    ("collectives runtime: init, new_group, destroy", ["distlaunch.collectives.runtime"]),
    ("collectives public API", ["distlaunch.collectives.api", "distlaunch.collectives.objects"]),
    ("collectives package and tools", ["distlaunch.collectives", "distlaunch.collectives.bench"]),
    (
        "MPI-style API: errors, datatypes, ops",
        ["distlaunch.mpi.errors", "distlaunch.mpi.datatypes", "distlaunch.mpi.ops"],
    ),
    ("MPI-style API: point to point, communicators", ["distlaunch.mpi.p2p", "distlaunch.mpi.comm"]),
    (
        "MPI-style API: collectives, environment, package",
        ["distlaunch.mpi.plans", "distlaunch.mpi.intracomm", "distlaunch.mpi.environment", "distlaunch.mpi"],
    ),
    (
        "torch.distributed backend on the collectives: errors, Work, tensors, bootstrap",
        [
            "distlaunch.torch.errors",
            "distlaunch.torch.work",
            "distlaunch.torch.tensors",
            "distlaunch.torch.bootstrap",
        ],
    ),
    (
        "torch.distributed backend: its ProcessGroup, the package (registration)",
        ["distlaunch.torch.group", "distlaunch.torch"],
    ),
    ("round lines and events.jsonl", ["distlaunch.events"]),
    (
        "observing a running job: stacks through py-spy, their grouping, per-rank records over "
        "the store, their table, merged output lines (beside the agent; nothing below imports it)",
        [
            "distlaunch.observe",
            "distlaunch.observe.stacks",
            "distlaunch.observe.group",
            "distlaunch.observe.records",
            "distlaunch.observe.table",
            "distlaunch.observe.dedup",
            "distlaunch.observe.registry",
            "distlaunch.observe.viewer",
        ],
    ),
    (
        "the executors of the round decisions: the node agent, the head's controller; the engine "
        "interface and output relay",
        [
            "distlaunch.agent.watch",
            "distlaunch.agent.observer",
            "distlaunch.agent.merged",
            "distlaunch.agent.specs",
            "distlaunch.agent.node",
            "distlaunch.head_controller",
            "distlaunch.engine",
            "distlaunch.engine.relay",
        ],
    ),
    (
        "the agent's entry point, the engines (SSH, Slurm, pods, SkyPilot)",
        [
            "distlaunch.agent.jobspec",
            "distlaunch.agent.entry",
            "distlaunch.engine.ssh",
            "distlaunch.engine.slurm",
            "distlaunch.engine.pods",
            "distlaunch.engine.skypilot",
        ],
    ),
    ("launch modes", ["distlaunch.modes"]),
    ("one node's launcher and its fast lane", ["distlaunch.launcher", "distlaunch.quick"]),
    ("head mode", ["distlaunch.head"]),
    (
        "command line: what a parsed `run` does, the narrow pre-parser, click's CLI",
        ["distlaunch.command", "distlaunch.preparse", "distlaunch.cli"],
    ),
    ("entry points and the Python launch API", ["distlaunch.__main__", "distlaunch.launch_api"]),
]

# the packages whose every module must be in LAYERS
PACKAGES = [
    "distlaunch",
    "distlaunch.agent",
    "distlaunch.engine",
    "distlaunch.remote",
    "distlaunch.store",
    "distlaunch.collectives",
    "distlaunch.collectives.transport",
    "distlaunch.collectives.algorithms",
    "distlaunch.mpi",
    "distlaunch.observe",
    "distlaunch.torch",
]

# Deliberate exceptions: the package root offers `distlaunch.launch` lazily (importing it
# must stay light for workers).
ALLOWED_UPWARD = {("distlaunch", "distlaunch.launch_api")}

# What the workers' runtime may import from outside its package (and their packages).
COLLECTIVES_MAY_USE = {
    "distlaunch",
    "distlaunch.errors",
    "distlaunch.progress",
    "distlaunch.env",
    "distlaunch.hostlist",
    "distlaunch.secret",
    "distlaunch.store",
    "distlaunch.store.client",
    "distlaunch.store.server",
    "distlaunch.store.protocol",
}


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
            if isinstance(child, ast.If) and ast.unparse(child.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                continue  # read by type checkers only: no run-time dependency
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
        if layers[i.target] > layers[m] and (m, i.target) not in ALLOWED_UPWARD
    ]
    assert not bad, "\n".join(bad)


def collectives_imports() -> list[tuple[str, Import]]:
    """(module, import) for every import made by a collectives module."""
    return [
        (m, i) for m, imps in import_graph().items() if m.startswith("distlaunch.collectives") for i in imps
    ]


def test_collectives_import_nothing_of_the_launcher():
    bad = [
        f"{m} line {i.line}: imports {i.target}"
        for m, i in collectives_imports()
        if not i.target.startswith("distlaunch.collectives") and i.target not in COLLECTIVES_MAY_USE
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {m: sorted({i.target for i in imps}) for m, imps in import_graph().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_level_import_inside_the_collectives():
    bad = [
        f"{m} line {i.line}: imports {i.target} inside a function"
        for m, i in collectives_imports()
        if i.in_function and i.target.startswith("distlaunch.collectives")
    ]
    assert not bad, "\n".join(bad)


def test_checker_finds_cycles_and_upward_imports(tmp_path):
    """The checks themselves: a hidden (function-level) cycle and an upward import."""
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nfrom . import low\n\n"
        "if TYPE_CHECKING:\n    from .high import T\n\n"
        "def f():\n    from .high import x\n"
    )
    imps = imports_of("p.m", str(src), {"p.low", "p.high", "p.m"})
    assert [(i.target, i.in_function) for i in imps] == [("p.low", False), ("p.high", True)]


# One bare interpreter forks a child per module, which imports it first, as a fresh
# interpreter would, without paying for the interpreter's start again (~100 interpreters
# were ~80 s of the suite). Nothing is imported before the fork: numpy and torch load many
# standard modules (importlib.util, dataclasses, ...) whose missing import they would hide.
FORKER = """import json, os, sys, traceback
for line in sys.stdin:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(line.strip())
            err = ""
        except BaseException:
            err = traceback.format_exc()
        os.write(w, err.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    print(json.dumps(err or ("" if status == 0 else f"the child ended with status {status}")), flush=True)
"""


@pytest.fixture(scope="module")
def fresh_import():
    """``fresh_import(module)``: the traceback of importing ``module`` first, "" if it
    imports; an import that takes over 60 s fails the test."""
    import json
    import select

    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )

    def run(module: str) -> str:
        proc.stdin.write(module + "\n")
        proc.stdin.flush()
        assert select.select([proc.stdout], [], [], 60)[0], f"importing {module} took over 60 s"
        line = proc.stdout.readline()
        assert line, f"the importing interpreter ended (code {proc.wait()})"
        return json.loads(line)

    yield run
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("module", sorted(m for m in layer_of() if m != "distlaunch.__main__"))
def test_module_imports_alone_in_a_fresh_interpreter(module, fresh_import):
    """Each module imports first of distlaunch's in its interpreter (no import-order
    dependence)."""
    err = fresh_import(module)
    assert err == "", err[-3000:]
