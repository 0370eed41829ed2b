"""The packages of `ft` import each other without cycles (the house is acyclic)."""

from __future__ import annotations

import ast
from pathlib import Path

import ft

ROOT = Path(ft.__file__).parent


def unit_of(module: str) -> str:
    """The unit a module belongs to: its package under `ft` (`ft.core`), or itself (`ft.params`)."""
    parts = module.split(".")
    if len(parts) > 2 or (ROOT / parts[-1]).is_dir():
        return ".".join(parts[:2])
    return module


def import_graph() -> dict[str, set[str]]:
    """Unit -> the other units it imports (at run time or lazily; `TYPE_CHECKING` included)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("ft", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        src = unit_of(module)
        edges = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("ft.") and unit_of(name) != src:
                    edges.add(unit_of(name))
    graph.pop("ft", None)  # the package's lazy public API re-exports everything
    for edges in graph.values():
        edges.discard("ft")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_packages_import_each_other_without_cycles() -> None:
    """No chain of imports between `ft`'s packages and modules leads back to where it began."""
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or ())


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a two-unit loop is reported as a path."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
