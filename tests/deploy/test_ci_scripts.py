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



def test_make_test_runs_every_tier_once_and_fails_when_either_stream_fails():
    """`make test` (tests/streams.py): the two streams together run each tier folder exactly once, and the
    run's exit code is a failing stream's (a stream that collected nothing under -k is not a failure)."""
    from tests.streams import NO_TESTS, STREAMS, combined

    tiers = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    named = sorted(Path(path).name for paths in STREAMS.values() for path in paths if not path.startswith("-"))
    assert named == tiers
    assert combined({"integration": 0, "others": 1}) == 1 and combined({"integration": 2, "others": 0}) == 2
    assert combined({"integration": NO_TESTS, "others": 0}) == 0
    assert combined({"integration": NO_TESTS, "others": NO_TESTS}) == NO_TESTS
