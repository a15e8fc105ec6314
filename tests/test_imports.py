"""The import rules of swarm/, peers/, testbed/ and scripts/, checked on the source with ``ast`` (nothing is
imported).

Every import counts: at module level, inside a function, and under ``if TYPE_CHECKING:`` (a cycle that
only the type checker walks is still two modules that each need the other). ``from pkg import name``,
where ``pkg`` exports ``name`` lazily (its ``_EXPORTS`` table, PEP 562), also counts as an import of the
module that table names.

1. No cycles between modules.
2. No imports of another package's private modules or names. A module path is private below the first
   component with a leading underscore (``swarm.membership._record`` is private to ``swarm.membership``,
   ``peers.local._helper`` to ``peers.local``); only modules inside the owner may import it. Everyone else
   imports the package, or a public module of it, and the package exports what they need.
3. ``swarm/`` (the library) imports none of the others; ``peers/`` (the programs) never imports
   ``scripts/`` or ``testbed/``; ``testbed/`` (the emulated internet that tests, benchmarks and users share)
   imports neither ``peers/`` nor ``scripts/``. ``scripts/`` (benchmarks and tools, run as
   ``python -m scripts.<name>`` from the repository root) may import all three, public modules only.
4. In ``scripts/``, one entry per benchmark or tool: an entry imports the shared modules (``_``-prefixed:
   the runner, its rows, the report's plans) and its own parts (``bench_report_doc`` and
   ``bench_report_targets`` of ``bench_report``: named after it), never another entry; a part may
   import another part of its entry.
5. The floor of ``swarm/``: its subpackages and top-level modules stand in layers (:data:`SWARM_LAYERS`),
   and a module imports only its own subpackage or a lower layer, never one beside or above it.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peers", "testbed", "scripts")

FORBIDDEN = {
    "swarm": ("peers", "scripts", "testbed"),
    "peers": ("scripts", "testbed"),
    "testbed": ("peers", "scripts"),
}
"""Rule 3: the packages each package must not import."""

SWARM_LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: errors, atomic files, devices, protocol ids, lazy exports, timers, tokenizers
    (
        "swarm._atomic",
        "swarm._device",
        "swarm._errors",
        "swarm._lazy",
        "swarm._periodic",
        "swarm._protocol",
        "swarm._tokenizer",
    ),
    # the root package (__version__ and its lazy table), codecs, the config schema, P2P streams and
    # their auth, the monitor's view of the swarm
    ("swarm", "swarm.compression", "swarm.config", "swarm.p2p", "swarm.metrics"),
    # addresses and reachability over P2P; models, data and the inner and outer optimizers
    ("swarm.network", "swarm.learning"),
    # the signed records of who is in the swarm; the model exchange between two peers
    ("swarm.membership", "swarm.gossip"),
    # a node: its DHT presence and record
    ("swarm._node",),
    # checkpoints, and the state a joiner downloads from members
    ("swarm.state",),
    # the trainer; the export of the swarm's model
    ("swarm.trainer", "swarm.export"),
    # pipeline stages, built on the trainer
    ("swarm.pipeline",),
)
"""Rule 5, lowest first: each unit (a subpackage or top-level module of ``swarm``) imports only units of
lower layers. A new unit takes its place here."""


@dataclass(frozen=True)
class Import:
    """One imported module of the project; ``name`` is what was taken from it when that is not a module
    of its own (``from swarm.config import RunConfig``)."""

    importer: str
    target: str
    line: int
    type_checking: bool = False
    name: str = ""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_checking: bool = False):
    """Yields (import node, under TYPE_CHECKING) for every import in the tree."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, type_checking
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), type_checking)
        else:
            yield from _walk(child, type_checking)


def _base_of(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = importer.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def imports_of(importer: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node, type_checking in _walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, "") for alias in node.names]
        else:
            base = _base_of(node, importer, is_package)
            full = [(f"{base}.{alias.name}", alias.name) for alias in node.names]
            pairs = [(name, "") if name in modules else (base, alias) for name, alias in full]
        found += [Import(importer, t, node.lineno, type_checking, n) for t, n in pairs if t in modules]
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    modules = project_modules()
    return tuple(imp for name, path in modules.items() for imp in imports_of(name, path, modules))


@functools.cache
def lazy_exports() -> dict[str, dict[str, str]]:
    """Per package, the ``_EXPORTS`` table of its ``__init__`` (name -> module), where it has one."""
    tables = {}
    for name, path in project_modules().items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                tables[name] = ast.literal_eval(node.value)
    return tables


def graph_of(imports: Iterable[Import], lazy: dict[str, dict[str, str]]) -> dict[str, dict[str, Import]]:
    """importer -> {target: the first import that makes the edge}, lazy exports resolved."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges = graph.setdefault(imp.importer, {})
        edges.setdefault(imp.target, imp)
        lazy_module = lazy.get(imp.target, {}).get(imp.name)
        if lazy_module is not None:
            edges.setdefault(lazy_module, imp)
    return graph


def find_cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import), each as a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, component) for component in components]


def _one_cycle(graph: dict[str, dict[str, Import]], component: list[str]) -> list[str]:
    """A concrete path start -> ... -> start inside a strongly connected component, for the message."""
    members = set(component)
    start = component[0]
    parents = {start: start}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(set(graph.get(node, ())) & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return component


def describe_cycle(graph: dict[str, dict[str, Import]], cycle: list[str]) -> str:
    """``a:line -> b:line -> ... -> a``, each module with the line of its import of the next."""
    steps = [
        f"{a}:{graph[a][b].line}{' (TYPE_CHECKING)' * graph[a][b].type_checking}"
        for a, b in itertools.pairwise(cycle)
    ]
    return " -> ".join([*steps, cycle[-1]])


def private_owner(module: str) -> str | None:
    """The package (or module) a dotted path is private to, or None for a public one."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_violations(imports: Sequence[Import]) -> list[str]:
    bad = []
    for imp in imports:
        path = f"{imp.target}.{imp.name}" if imp.name else imp.target
        owner = private_owner(path)
        if owner is not None and not (imp.importer == owner or imp.importer.startswith(owner + ".")):
            bad.append(
                f"{imp.importer}:{imp.line} imports {path}, private to {owner}: "
                f"make it public in {owner.replace('.', '/')} and import it from there"
            )
    return bad


def swarm_unit(module: str) -> str:
    """The layer unit of a module of swarm: ``swarm.gossip._offer`` -> ``swarm.gossip``."""
    return ".".join(module.split(".")[:2])


def layer_violations(graph: dict[str, dict[str, Import]], layers: Sequence[Sequence[str]]) -> list[str]:
    """Every edge from a unit of swarm to a unit beside or above it, with the importing line."""
    rank = {unit: i for i, units in enumerate(layers) for unit in units}
    bad = []
    for importer, edges in sorted(graph.items()):
        for target, imp in sorted(edges.items()):
            if not (importer.startswith("swarm") and target.startswith("swarm")):
                continue
            unit, used = swarm_unit(importer), swarm_unit(target)
            if unit != used and rank[used] >= rank[unit]:
                how = " (TYPE_CHECKING)" * imp.type_checking + (f" (for {imp.name})" if imp.name else "")
                bad.append(
                    f"{importer}:{imp.line} imports {target}{how}: layer {rank[unit]} ({unit}) may only "
                    f"import layers below it, {used} is layer {rank[used]}"
                )
    return bad


def _graph() -> dict[str, dict[str, Import]]:
    return graph_of(all_imports(), lazy_exports())


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = _graph()
    cycles = [cycle for cycle in find_cycles(graph) if cycle[0].split(".")[0] == package]
    assert not cycles, f"import cycles in {package}/ (every import counts; each step with its line):\n" + (
        "\n".join(describe_cycle(graph, cycle) for cycle in cycles)
    )


def test_no_imports_of_another_packages_private_modules_or_names() -> None:
    bad = private_violations(all_imports())
    assert not bad, "imports of another package's private modules or names:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_never_imports_what_sits_above_it(package: str) -> None:
    bad = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        for imp in all_imports()
        if imp.importer.split(".")[0] == package and imp.target.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, f"{package}/ must not import {', '.join(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_every_unit_of_swarm_has_a_layer() -> None:
    units = {swarm_unit(module) for module in project_modules() if module.split(".")[0] == "swarm"}
    placed = [unit for layer in SWARM_LAYERS for unit in layer]
    assert len(placed) == len(set(placed)), "a unit stands in two layers"
    assert units == set(placed), f"give these a layer in SWARM_LAYERS: {sorted(units - set(placed))}"


def test_swarm_imports_only_lower_layers() -> None:
    bad = layer_violations(_graph(), SWARM_LAYERS)
    assert not bad, "imports of a layer beside or above (tests/test_imports.py, SWARM_LAYERS):\n" + "\n".join(
        bad
    )


def _entry_of(name: str, names: set[str]) -> str:
    """The entry a module of scripts/ is part of: the shortest module whose name, followed by ``_``,
    starts its name (``bench_report`` for ``bench_report_doc``); itself when there is none."""
    owners = [entry for entry in names if name.startswith(f"{entry}_")]
    return min(owners, key=len, default=name)


def test_scripts_entries_import_shared_modules_never_each_other() -> None:
    pairs = {
        (imp.importer.removeprefix("scripts."), imp.target.removeprefix("scripts."))
        for imp in all_imports()
        if imp.importer.startswith("scripts.") and imp.target.startswith("scripts.")
    }
    names = {p.stem for p in (ROOT / "scripts").glob("*.py")} - {"__init__"}
    assert ("bench_lag", "_runner") in pairs  # the checker sees the imports it judges
    bad = [
        f"scripts/{importer}.py imports scripts/{target}.py"
        for importer, target in sorted(pairs)
        if not target.startswith("_") and not target.startswith(_entry_of(importer, names))
    ]
    assert not bad, "an entry of scripts/ imports another (share it in a _ module):\n" + "\n".join(bad)


def test_the_checker_sees_violations() -> None:
    """The rules above can fail: cycles (one only the type checker walks, one through a lazy export), a
    private import, and an import of a layer above, all in made-up graphs."""
    made_up = [
        Import("swarm.a._x", "swarm.b", 1),
        Import("swarm.b", "swarm.a._x", 2),
        Import("swarm.c", "swarm.d", 3, type_checking=True),
        Import("swarm.d", "swarm.c", 4),
        Import("peers.e", "peers.f", 5, name="_helper"),
        Import("swarm.g", "swarm.h", 6, name="Thing"),
        Import("swarm.h._impl", "swarm.g", 7),
    ]
    graph = graph_of(made_up, {"swarm.h": {"Thing": "swarm.h._impl"}})
    assert find_cycles(graph) == [
        ["swarm.a._x", "swarm.b", "swarm.a._x"],
        ["swarm.c", "swarm.d", "swarm.c"],
        ["swarm.g", "swarm.h._impl", "swarm.g"],
    ]
    assert describe_cycle(graph, ["swarm.c", "swarm.d", "swarm.c"]) == (
        "swarm.c:3 (TYPE_CHECKING) -> swarm.d:4 -> swarm.c"
    )
    assert [v.split(":")[0] for v in private_violations(made_up)] == ["swarm.b", "peers.e"]
    assert private_owner("swarm.membership._record") == "swarm.membership"
    assert private_owner("swarm.membership") is None and private_owner("swarm.__version__") is None
    layered = [
        Import("swarm.b._x", "swarm.a", 1),  # down: fine
        Import("swarm.b", "swarm.b._x", 2),  # inside its own unit: fine
        Import("swarm.a", "swarm.b", 3, type_checking=True),  # up
        Import("swarm.a._y", "swarm.b._x", 4),  # up
        Import("swarm.c", "swarm.a", 5),  # beside
    ]
    upward = layer_violations(graph_of(layered, {}), [("swarm.a", "swarm.c"), ("swarm.b",)])
    assert [v.split(" imports ")[0] for v in upward] == ["swarm.a:3", "swarm.a._y:4", "swarm.c:5"]
