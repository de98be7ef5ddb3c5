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


PRIVATE_RAY = ("ray._private", "ray.experimental")
SEAM = "ray_app.ray_seam"


def private_ray_imports(path: Path) -> list[str]:
    """Each import of Ray's private code in ``path`` (anywhere in its body): ``ray._private``,
    ``ray.experimental``, any ``ray.*._internal`` module, or an ``_``-named attribute imported from Ray."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        for name in names:
            if name.split(".")[0] == "ray" and (name.startswith(PRIVATE_RAY) or "._" in name):
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_the_walk_finds_private_ray_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import ray\nfrom ray.train import Checkpoint\n"
                     "def f():\n    from ray.train.v2._internal.execution import callback\n"
                     "    from ray.experimental import internal_kv\n"
                     "    from ray.train.v2.api.exceptions import _private_thing\n")
    assert [f.split(" ")[1] for f in private_ray_imports(probe)] == [
        "ray.train.v2._internal.execution", "ray.experimental", "ray.train.v2.api.exceptions._private_thing"]


def test_rays_private_code_is_imported_only_in_the_seam():
    """Every import of Ray's private modules lives in ray_app/ray_seam.py, so an upgrade of Ray shows
    there (``make check-ray``) what broke."""
    outside = [f for p in sorted(PACKAGE.rglob("*.py")) if f"ray_app.{p.stem}" != SEAM
               for f in private_ray_imports(p)]
    assert outside == [], f"private Ray imports outside {SEAM}: {outside}"
    assert private_ray_imports(PACKAGE / "ray_seam.py"), "the walk sees the seam's own imports"


def rooms() -> dict[str, set[str]]:
    """The README map's rooms (its bold rows) -> the ray_app modules listed under each."""
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    room = None
    for line in section.splitlines():
        if line.startswith("| **"):
            room = line.split("**")[1]
            out[room] = set()
        elif line.startswith("| `ray_app/") and room is not None:
            names = [n for n in line.split(" | ", 1)[0].split("`") if n.endswith(".py")]
            out[room] |= {f"ray_app.{n.rsplit('/', 1)[-1][:-3]}" for n in names}
    return out


def test_the_rooms_by_where_code_runs_hold():
    """Every module is in one room of the README map (the driver, Ray Train's controller, the workers, shared);
    nothing in the controller's or the workers' rooms imports a module of the driver's."""
    found = rooms()
    assert len(found) == 4 and "driver" in list(found)[0], list(found)  # the driver's room first
    every = [m for mods in found.values() for m in mods]
    modules = sorted(f"ray_app.{p.stem}" for p in PACKAGE.glob("*.py"))
    assert sorted(every) == modules, "each module of ray_app in exactly one room of the README map"
    driver = found[list(found)[0]]
    graph = import_graph()
    for name, mods in list(found.items())[1:]:
        for module in mods:
            assert not graph.get(module, set()) & driver, f"{module} ({name}) imports the driver's {graph[module] & driver}"


def test_the_loop_reads_in_one_sitting_and_the_worker_entry_point_on_one_screen():
    """The house's size limits: ``loop.py`` (the loop the README's practices point into) at most 300 lines,
    ``worker_main`` (what every worker runs) at most 25; what grows moves into a part of its own."""
    assert len((PACKAGE / "loop.py").read_text().splitlines()) <= 300
    tree = ast.parse((PACKAGE / "worker.py").read_text())
    entry = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "worker_main")
    assert entry.end_lineno - entry.lineno + 1 <= 25
