"""The README's "Where things are" map names every top-level folder and every module of ray_app/, and
every path it names exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def map_paths(readme: str) -> set[str]:
    """The paths in the first column of the map; a bare name (`tasks.py`) is in the folder of the first
    path of its cell (`ray_app/shared/plugins.py`, `tasks.py` -> ray_app/shared/tasks.py)."""
    section = readme.split("\n## Where things are\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "README: no rows in the 'Where things are' table"
    paths = set()
    for row in rows:
        names = re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])
        folder = names[0].rsplit("/", 1)[0] if "/" in names[0].rstrip("/") else ""
        for name in names:
            paths.add(name.rstrip("/") if "/" in name.rstrip("/") or not folder else f"{folder}/{name}")
    return paths


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_every_top_level_folder_and_ray_app_module_is_on_the_map():
    paths = map_paths((REPO / "README.md").read_text())
    files = tracked()
    folders = sorted({f.split("/", 1)[0] for f in files if "/" in f})
    named_folders = {p.split("/", 1)[0] for p in paths}
    assert [f for f in folders if f not in named_folders] == [], "README 'Where things are' lacks these folders"
    modules = sorted(f for f in files if re.fullmatch(r"ray_app/[^/]+\.py", f))
    assert [m for m in modules if m not in paths] == [], "README 'Where things are' lacks these ray_app modules"


def test_every_path_on_the_map_exists():
    missing = sorted(p for p in map_paths((REPO / "README.md").read_text()) if not (REPO / p).exists())
    assert missing == [], f"README 'Where things are' names paths that do not exist: {missing}"


def test_bare_names_resolve_in_the_folder_of_their_cell():
    table = "\n## Where things are\n\n| path | what |\n| --- | --- |\n| `a/b.py`, `c.py` | x |\n| `d/` | y |\n\n## Next\n"
    assert map_paths(table) == {"a/b.py", "a/c.py", "d"}
