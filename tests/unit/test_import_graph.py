"""ray_app's modules import each other one way (no circle, counting imports inside functions too) and
never across the walls of the rooms by where code runs."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ray_app"


ROOMS = ("driver", "controller", "worker", "shared")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``ray_app/worker/loop.py`` -> ``ray_app.worker.loop``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> list[Path]:
    return sorted(package.rglob("*.py"))


def imports_of(path: Path, known: set[str], package: Path = PACKAGE) -> set[str]:
    """The ray_app modules ``path`` imports anywhere in its body (``from ray_app.worker import loop`` counts
    as ``ray_app.worker.loop`` where that is a module of ``known``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ray_app.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ray_app" or node.module.startswith("ray_app."):
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                found |= subs or {node.module}
    me = module_name(path, package)
    return {m for m in found if m != me and m != "ray_app"}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of ray_app (packages' ``__init__`` as the package) -> the ray_app modules it imports."""
    paths = modules(package)
    known = {module_name(p, package) for p in paths}
    return {module_name(p, package): imports_of(p, known, package) for p in paths
            if module_name(p, package) != "ray_app"}


def room_of(module: str) -> str | None:
    """``ray_app.worker.loop`` -> ``worker``; None for the package's own top level (``ray_app.__main__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def cross_room_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that crosses a wall: a worker or controller module importing a driver one, a shared
    module importing one of the three other rooms."""
    bad = []
    for module, deps in sorted(graph.items()):
        room = room_of(module)
        forbidden = {"worker": {"driver"}, "controller": {"driver"},
                     "shared": {"driver", "controller", "worker"}}.get(room, set())
        bad += [f"{module} ({room}) imports {dep}" for dep in sorted(deps) if room_of(dep) in forbidden]
    return bad


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
    assert len(graph) > 10 and graph["ray_app.driver.cli"], "the walk found ray_app's modules and their imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


PRIVATE_RAY = ("ray._private", "ray.experimental")
SEAM = "ray_app.shared.ray_seam"


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
    """Every import of Ray's private modules lives in ray_app/shared/ray_seam.py, so an upgrade of Ray shows
    there (``make check-ray``) what broke."""
    outside = [f for p in modules() if module_name(p) != SEAM for f in private_ray_imports(p)]
    assert outside == [], f"private Ray imports outside {SEAM}: {outside}"
    assert private_ray_imports(PACKAGE / "shared" / "ray_seam.py"), "the walk sees the seam's own imports"


def test_every_module_lives_in_a_room_and_no_import_crosses_a_wall():
    """The folders are the rooms by where code runs: a worker or controller module never imports a driver
    one, a shared one imports none of the three; only the package's own files sit outside the rooms."""
    graph = import_graph()
    outside = sorted(m for m in graph if room_of(m) is None)
    assert outside == ["ray_app.__main__"], outside
    for room in ROOMS:
        assert any(room_of(m) == room for m in graph), f"the room {room} holds modules"
    assert cross_room_imports(graph) == []


def test_a_planted_cross_room_import_is_found(tmp_path):
    """The wall check fails on a copy of the tree where one shared module imports a worker one inside a
    function, and where a worker module imports a driver one."""
    import shutil

    copy = tmp_path / "ray_app"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "shared" / "config.py", "a") as f:
        f.write("\n\ndef _planted():\n    from ray_app.worker import loop\n    return loop\n")
    with open(copy / "worker" / "pace.py", "a") as f:
        f.write("\n\nfrom ray_app.driver.launcher import launch  # noqa\n")
    assert cross_room_imports(import_graph(copy)) == [
        "ray_app.shared.config (shared) imports ray_app.worker.loop",
        "ray_app.worker.pace (worker) imports ray_app.driver.launcher"]


def test_the_readme_map_is_the_tree():
    """The README's map lists each room as its folder, and every module of ray_app under its own room."""
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    for room in ROOMS:
        assert f"`ray_app/{room}/`" in section, f"the map names the room ray_app/{room}/"
    for path in modules():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            continue
        cell = [line for line in section.splitlines() if line.startswith("| `")
                and (f"`{rel}`" in line.split(" | ", 1)[0] or (f"`{path.name}`" in line.split(" | ", 1)[0]
                                                             and f"`{path.parent.relative_to(PACKAGE.parent).as_posix()}/" in line))]
        assert cell, f"the map names {rel} in its room"


def test_the_loop_reads_in_one_sitting_and_the_worker_entry_point_on_one_screen():
    """The house's size limits: ``loop.py`` (the loop the README's practices point into) at most 300 lines,
    ``worker_main`` (what every worker runs) at most 25; what grows moves into a part of its own."""
    assert len((PACKAGE / "worker" / "loop.py").read_text().splitlines()) <= 300
    tree = ast.parse((PACKAGE / "worker" / "entry.py").read_text())
    entry = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "worker_main")
    assert entry.end_lineno - entry.lineno + 1 <= 25
