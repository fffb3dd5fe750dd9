"""No import cycles between Horovod's modules, read from the source (AST).

Every import counts, at module level or inside a function (a function-level import that closes a
cycle only hides it), except those under ``if TYPE_CHECKING:``. ``from package import name``
counts as an import of ``package.name`` when that is a module. A package's implicit import of
its parent is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests._ci_record import once_under_ci  # noqa: F401 - the fixture, used by pytestmark

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("once_under_ci")]


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "horovod"

# No cycle is allowed: a cycle found fails the test.
ALLOWED: set[frozenset[str]] = set()


def _module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the Horovod modules it imports."""
    modules = {_module_name(p, root.parent): p for p in root.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                deps.update(filter(None, (known(a.name) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found = full if full in modules else known(base)
                    if found:
                        deps.add(found)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & component))}" for m in sorted(component))


def test_no_import_cycles_between_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    new = [c for c in found if c not in ALLOWED]
    assert not new, "import cycles:\n" + "\n\n".join(_describe(c, graph) for c in new)
    gone = [sorted(c) for c in ALLOWED if c not in found]
    assert not gone, f"allowed cycles that no longer exist (remove them from ALLOWED): {gone}"


def test_the_cycle_finder_sees_function_level_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "horovod"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from horovod.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from horovod.sub import a\n")
    (pkg / "sub" / "d.py").write_text("import horovod.sub.c\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [frozenset({"horovod.sub.a", "horovod.sub.b"})], graph
