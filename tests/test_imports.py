"""The import rules of swarm/, peers/ and testbed/, checked on the source with ``ast`` (nothing is imported).

1. No cycles between modules. Every import counts, at module level or inside a function; only imports
   under ``if TYPE_CHECKING:`` are left out, since they never run.
2. No imports of another package's private modules. A module path is private below the first component
   with a leading underscore (``swarm.membership._record`` is private to ``swarm.membership``); only
   modules inside that package (its own modules and its subpackages') may import it. Everyone else
   imports the package, or a public module of it, and the package's ``__init__`` exports what they
   need.
3. ``swarm/`` never imports ``peers/``.
4. ``testbed/`` (the emulated internet that tests, benchmarks and users share) is no part of the
   library: ``swarm/`` and ``peers/`` never import it, and it never imports ``peers/``.
5. In ``scripts/``, one entry per benchmark or tool: an entry imports the shared modules (``_``-prefixed:
   the runner, its rows, the report's plans) and its own parts (``bench_report_doc`` and
   ``bench_report_targets`` of ``bench_report``: named after it), never another entry; a part may
   import another part of its entry.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peers", "testbed")


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module of the project."""

    importer: str
    target: str
    line: int
    type_checking: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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
            targets = [alias.name for alias in node.names]
        else:
            base = _base_of(node, importer, is_package)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for target in targets:
            if target in modules:
                found.append(Import(importer, target, node.lineno, type_checking))
    return found


@functools.cache
def all_imports() -> tuple[Import, ...]:
    modules = project_modules()
    return tuple(imp for name, path in modules.items() for imp in imports_of(name, path, modules))


def private_owner(module: str) -> str | None:
    """The package a module is private to, or None for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return None


def private_violations(imports: Sequence[Import]) -> list[str]:
    bad = []
    for imp in imports:
        owner = private_owner(imp.target)
        if owner is not None and not (imp.importer == owner or imp.importer.startswith(owner + ".")):
            bad.append(
                f"{imp.importer}:{imp.line} imports {imp.target}, private to {owner}: "
                f"export the name from {owner.replace('.', '/')}/__init__.py and import it from there"
            )
    return bad


def find_cycles(imports: Sequence[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import), each as a cycle."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_checking:
            graph.setdefault(imp.importer, set()).add(imp.target)
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


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete path start -> ... -> start inside a strongly connected component, for the message."""
    members = set(component)
    start = component[0]
    parents = {start: start}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, ()) & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                queue.append(nxt)
    return component


def test_no_import_cycles():
    cycles = find_cycles(all_imports())
    assert not cycles, "import cycles (function-level imports count too):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_no_imports_of_another_packages_private_modules():
    bad = private_violations(all_imports())
    assert not bad, "imports of another package's private modules:\n" + "\n".join(bad)


def test_swarm_never_imports_peers():
    bad = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        for imp in all_imports()
        if imp.importer.startswith("swarm") and imp.target.split(".")[0] == "peers"
    ]
    assert not bad, "swarm/ must not import peers/:\n" + "\n".join(bad)


def test_the_testbed_stays_outside_the_library_and_programs():
    bad = [
        f"{imp.importer}:{imp.line} imports {imp.target}"
        for imp in all_imports()
        if (imp.importer.split(".")[0], imp.target.split(".")[0])
        in {("swarm", "testbed"), ("peers", "testbed"), ("testbed", "peers")}
    ]
    assert not bad, "swarm/ and peers/ must not import testbed/, nor testbed/ peers/:\n" + "\n".join(bad)


def scripts_imports() -> list[tuple[str, str]]:
    """(importer, target) for every import of one module of scripts/ by another."""
    names = {p.stem for p in (ROOT / "scripts").glob("*.py")} - {"__init__"}
    found = []
    for name in sorted(names):
        tree = ast.parse((ROOT / "scripts" / f"{name}.py").read_text())
        for node, _ in _walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "scripts":
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [(node.module or "").removeprefix("scripts.")]
            else:
                targets = [alias.name.removeprefix("scripts.") for alias in node.names]
            found += [(name, target) for target in targets if target in names]
    return found


def _entry_of(name: str, names: set[str]) -> str:
    """The entry a module of scripts/ is part of: the shortest module whose name, followed by ``_``,
    starts its name (``bench_report`` for ``bench_report_doc``); itself when there is none."""
    owners = [entry for entry in names if name.startswith(f"{entry}_")]
    return min(owners, key=len, default=name)


def test_scripts_entries_import_shared_modules_never_each_other():
    imports = scripts_imports()
    names = {p.stem for p in (ROOT / "scripts").glob("*.py")} - {"__init__"}
    assert ("bench_lag", "_runner") in imports  # the checker sees the imports it judges
    bad = [
        f"scripts/{importer}.py imports scripts/{target}.py"
        for importer, target in imports
        if not target.startswith("_") and not target.startswith(_entry_of(importer, names))
    ]
    assert not bad, "an entry of scripts/ imports another (share it in a _ module):\n" + "\n".join(bad)


def test_the_checker_sees_violations():
    """The rules above can fail: a cycle and a private import are found in a made-up graph."""
    made_up = [
        Import("swarm.a._x", "swarm.b", 1, False),
        Import("swarm.b", "swarm.a._x", 2, False),
        Import("swarm.c", "swarm.d", 3, True),
        Import("swarm.d", "swarm.c", 4, False),
    ]
    assert find_cycles(made_up) == [["swarm.a._x", "swarm.b", "swarm.a._x"]]
    assert [v.split(":")[0] for v in private_violations(made_up)] == ["swarm.b"]
    assert private_owner("swarm.membership._record") == "swarm.membership"
    assert private_owner("swarm.membership") is None
