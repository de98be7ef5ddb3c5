"""CI's set-up scripts: installing Debian packages starts none of their services."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NO_STARTS = REPO / "docker" / "no-service-starts.sh"


def run_without_starts(policy: Path, command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, POLICY_RC_D=str(policy))
    return subprocess.run(["bash", str(NO_STARTS), "sh", "-c", command], env=env, capture_output=True, text=True,
                          timeout=30)


def test_service_starts_are_refused_during_the_command_and_allowed_after(tmp_path):
    policy = tmp_path / "policy-rc.d"
    # what invoke-rc.d does before a package's postinst starts its service: ask policy-rc.d
    out = run_without_starts(policy, f'"{policy}" prometheus start; echo "policy says $?"')
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "policy says 101"  # 101: action forbidden
    assert not policy.exists()


def test_a_policy_that_was_there_is_put_back_also_when_the_command_fails(tmp_path):
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 0\n")
    policy.chmod(0o755)
    out = run_without_starts(policy, f'"{policy}" prometheus start; echo "policy says $?"; exit 3')
    assert out.returncode == 3 and out.stdout.strip() == "policy says 101"
    assert policy.read_text() == "#!/bin/sh\nexit 0\n" and os.access(policy, os.X_OK)



def test_make_test_runs_every_tier_once_longest_first_and_fails_when_any_unit_fails(tmp_path):
    """`make test` (tests/streams.py): its units together name each tier folder and each integration module
    exactly once (a new module is found, not listed by hand), they start longest first within the slots,
    and the run's exit code is a failing unit's (a unit that collected nothing under -k is not a failure)."""
    from tests.streams import ALONE, NO_TESTS, SLOTS, combined, failures, next_to_start, slowest, units

    found = units()
    # a module that times a ratio runs first and alone: while it runs, nothing else fits
    alone, found = found[:len(ALONE)], found[len(ALONE):]
    assert {u.name for u in alone} == ALONE and all(u.weight == SLOTS for u in alone)
    assert next_to_start(found, SLOTS - alone[0].weight) is None
    tiers = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    named = [Path(path) for u in alone + found for path in u.paths]
    assert sorted({p.parts[1] for p in named}) == tiers
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "integration").glob("test_*.py"))
    assert sorted(str(p) for p in named if p.parts[1] == "integration") == modules
    assert len(named) == len(set(named))
    assert found[0].name == "others" and found[0].weight == 2 <= SLOTS
    # beside "others", one module at a time; the longest pending one waits for room rather than be overtaken
    assert next_to_start(found[1:], SLOTS - 2) is found[1]
    assert next_to_start(found, 1) is None and next_to_start([], SLOTS) is None
    assert combined([0, 1]) == 1 and combined([2, 0]) == 2 and combined([0, 1, 2]) == 1
    assert combined([NO_TESTS, 0]) == 0
    assert combined([NO_TESTS, NO_TESTS]) == NO_TESTS
    # the slowest tests, over every unit's JUnit report (one unreadable report is left out)
    (tmp_path / "a.xml").write_text('<testsuites><testsuite><testcase classname="tests.unit.test_a" name="test_x" '
                                    'time="1.5"/><testcase classname="tests.unit.test_a" name="test_y" time="9"/>'
                                    '</testsuite></testsuites>')
    (tmp_path / "b.xml").write_text('<testsuites><testsuite><testcase classname="tests.integration.test_b" '
                                    'name="test_z[1]" time="4.25"/></testsuite></testsuites>')
    (tmp_path / "c.xml").write_text("<testsuites>")
    assert slowest([tmp_path / n for n in ("a.xml", "b.xml", "c.xml", "d.xml")], 2) == [
        (9.0, "tests/unit/test_a.py::test_y"), (4.25, "tests/integration/test_b.py::test_z[1]")]
    # last, what failed or errored, with its message's first line: the tail of CI's log names it
    (tmp_path / "e.xml").write_text('<testsuites><testsuite><testcase classname="tests.e2e.test_e" name="test_f" time="2">'
                                    '<failure message="assert 1 == 2&#10;where 1 = f()">trace</failure></testcase>'
                                    '<testcase classname="tests.e2e.test_e" name="test_g" time="1"><error message="">'
                                    'fixture broke&#10;more</error></testcase></testsuite></testsuites>')
    assert failures([tmp_path / n for n in ("a.xml", "c.xml", "d.xml", "e.xml")]) == [
        ("ERROR", str(tmp_path / "c.xml"), "an unfinished JUnit report: the unit's pytest ended early"),
        ("FAILED", "tests/e2e/test_e.py::test_f", "assert 1 == 2"), ("ERROR", "tests/e2e/test_e.py::test_g", "fixture broke")]
