"""ray_app's modules import each other one way: no circle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ray_app"


def imports_of(path: Path) -> set[str]:
    """The ray_app modules ``path`` imports anywhere in its body (``from ray_app import x`` counts as
    ``ray_app.x`` where x is a module)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ray_app.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ray_app":
                found |= {f"ray_app.{a.name}" for a in node.names if a.name in modules}
            elif node.module.startswith("ray_app."):
                found.add(node.module)
    me = f"ray_app.{path.stem}"
    return {m for m in found if m != me and m != "ray_app.__init__"}


def import_graph() -> dict[str, set[str]]:
    return {f"ray_app.{p.stem}": imports_of(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_two_modules_of_ray_app_import_each_other():
    graph = import_graph()
    assert len(graph) > 10 and graph["ray_app.cli"], "the walk found ray_app's modules and their imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
