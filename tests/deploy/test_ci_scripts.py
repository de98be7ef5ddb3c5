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

