"""The metrics tables of README.md and docs/metrics.md are the exporter's
contract, ray_app/worker/metrics.py's METRICS (name -> type, help) and METRIC_LABELS,
checked the way test_config.py checks the README's config table: every row
of the table is read (a malformed one fails, none is skipped), no metric has
two rows, none is missing or extra, and the rows follow the code's order."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from ray_app.worker.metrics import METRIC_LABELS, METRICS

REPO = Path(__file__).resolve().parents[2]
README_HEADER = "| metric | type | labels | meaning |"
DOCS_HEADER = "| name | type | meaning |"


def readme_row(name: str) -> str:
    """The README row the code implies for a metric."""
    kind, help_text = METRICS[name]
    labels = ", ".join(METRIC_LABELS.get(name, ())) or "-"
    return f"| `{name}` | {kind} | {labels} | {help_text} |"


def table_lines(path: Path, heading: str, header: str) -> list[str]:
    """Every line of the table that starts with ``header`` under ``heading``."""
    text = path.read_text()
    assert f"\n{heading}\n" in text, f"{path.name}: no {heading!r} section"
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    assert header in lines, f"{path.name} {heading}: no table with the header {header!r}"
    start = lines.index(header)
    assert set(lines[start + 1].replace(" ", "")) <= set("|-"), f"{path.name}: the line after {header!r} is not |---|"
    return list(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:]))


def parse_rows(path: Path, lines: list[str], pattern: str, what: str) -> dict[str, tuple[str, ...]]:
    """{metric: the row's other cells}, in the table's order; a row that does not match fails."""
    rows: dict[str, tuple[str, ...]] = {}
    for line in lines:
        m = re.fullmatch(pattern, line)
        assert m, f"{path.name} metrics table: {line!r} is not a {what} row"
        assert m.group(1) not in rows, f"{path.name} metrics table: {m.group(1)} has two rows"
        rows[m.group(1)] = m.groups()[1:]
    return rows


def readme_rows(path: Path = REPO / "README.md") -> dict[str, tuple[str, ...]]:
    """{metric: (type, labels, meaning)} of the README's "## Metrics" table."""
    lines = table_lines(path, "## Metrics", README_HEADER)
    return parse_rows(path, lines, r"\| `(ray_app_\w+)` \| (\w+) \| ([^|]+?) \| (.+) \|", "`metric` | type | labels | meaning")


def docs_rows(path: Path = REPO / "docs" / "metrics.md") -> dict[str, tuple[str, ...]]:
    """{metric: (type, labels, meaning)} of docs/metrics.md's table, which writes ``name{label,...}``."""
    lines = table_lines(path, "## Metrics", DOCS_HEADER)
    rows = parse_rows(path, lines, r"\| `(ray_app_\w+)(?:\{([\w,]+)\})?` \| (\w+) \| (.+) \|", "`name{labels}` | type | meaning")
    return {name: (kind, labels or "", meaning) for name, (labels, kind, meaning) in rows.items()}


def check_against_the_code(documented: dict[str, tuple[str, str]], where: str, fix: str) -> None:
    """``documented``: {metric: (type, labels as written)}; labels compared as the tuple METRIC_LABELS gives."""
    missing = [name for name in METRICS if name not in documented]
    assert sorted(documented.keys() - METRICS.keys()) == [], f"{where} lists metrics ray_app/worker/metrics.py does not have"
    assert missing == [], f"{where} lacks metrics of ray_app/worker/metrics.py: {missing}; {fix}"
    for name, (kind, labels) in documented.items():
        assert kind == METRICS[name][0], f"{where}: {name} is a {METRICS[name][0]} in the code, not a {kind}"
        written = tuple(x.strip() for x in labels.split(",")) if labels not in ("", "-") else ()
        assert written == METRIC_LABELS.get(name, ()), f"{where}: {name}'s labels are {METRIC_LABELS.get(name, ())} in the code"
    assert list(documented) == list(METRICS), f"{where}: rows out of the order of ray_app/worker/metrics.py's METRICS"


def test_readme_metrics_table_is_the_contract():
    """Row by row: type, labels and the help text the exporter serves, word for word."""
    rows = readme_rows()
    fix = "add these rows:\n" + "\n".join(readme_row(n) for n in METRICS if n not in rows)
    check_against_the_code({name: (kind, labels) for name, (kind, labels, _) in rows.items()}, "README.md", fix)
    for name, (_, _, meaning) in rows.items():
        assert meaning == METRICS[name][1], f"README.md: {name}'s meaning differs from its help text; the row: {readme_row(name)}"


def test_docs_metrics_table_names_every_metric_with_its_type_and_labels():
    """docs/metrics.md explains more than the help text, so only a meaning is required of it."""
    rows = docs_rows()
    fix = "add a row `name{labels}` | type | meaning for each"
    check_against_the_code({name: (kind, labels) for name, (kind, labels, _) in rows.items()}, "docs/metrics.md", fix)
    assert all(meaning.strip() for _, _, meaning in rows.values())


@pytest.mark.parametrize("broken, message", [
    ("| ray_app_epoch | gauge | - | Current epoch (0-based). |", "is not a"),  # no backticks: not skipped
    ("| `ray_app_epoch` | gauge | - | Current epoch (0-based). |\n| `ray_app_epoch` | gauge | - | x |", "has two rows"),
])
def test_a_malformed_or_doubled_row_fails(tmp_path, broken, message):
    text = (REPO / "README.md").read_text()
    row = readme_row("ray_app_epoch")
    assert row in text
    readme = tmp_path / "README.md"
    readme.write_text(text.replace(row, broken))
    with pytest.raises(AssertionError, match=message):
        readme_rows(readme)
