"""`make test`: every tier, in two pytest processes at once.

A kit run on a 2-core machine keeps its cores about half busy (process start-up, Ray's waits, storage
outages and hang timeouts the tests wait out), so the integration tier runs in one process and the
others (unit, deploy, bench, e2e: e2e last, its image building meanwhile) in a second. Each line a
process prints is shown as it comes, prefixed by its stream's name; each stream ends with its own
summary and slowest tests. The exit code is the first non-zero one of the two (a stream that
collected no test under a ``-k`` selection is not a failure unless both collected none).

    python -m tests.streams [PYTEST_ARGS...]
"""

from __future__ import annotations

import getpass
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Measured on 2 cores, clean clone, whole .ci/run: the integration tier alone in one stream 1865 s (streams
# 1744 s and 1065 s); with two integration modules moved to the other stream 2002 s (1869 s and 1567 s): the
# cores are saturated while both run, so the split stays by tier.
STREAMS = {
    "integration": ["tests/integration"],
    "others": ["tests/unit", "tests/deploy", "tests/bench", "tests/e2e"],
}
NO_TESTS = 5  # pytest's exit code when it collected nothing


def _relay(name: str, proc: subprocess.Popen, lock: threading.Lock) -> None:
    width = max(map(len, STREAMS))
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{name:<{width}}] {line}")
            sys.stdout.flush()


def combined(codes: dict[str, int]) -> int:
    """One exit code for the streams' (in STREAMS order)."""
    if all(code == NO_TESTS for code in codes.values()):
        return NO_TESTS
    return next((code for code in codes.values() if code not in (0, NO_TESTS)), 0)


def main(pytest_args: list[str]) -> int:
    lock, procs, relays = threading.Lock(), {}, []
    t0 = time.monotonic()
    for name, paths in STREAMS.items():
        # a base folder each, the same every time: two sessions never number, lock or clean up each other's
        # folders, and pytest empties it as the next `make test` starts (what a run leaves stays bounded)
        basetemp = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}" / f"streams-{name}"
        basetemp.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # pytest makes the folder, not its parent
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pytest", *paths, f"--basetemp={basetemp}", *pytest_args], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        relays.append(threading.Thread(target=_relay, args=(name, procs[name], lock), daemon=True))
        relays[-1].start()
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached both pytest processes too (one process group): let them end
            for other in procs.values():
                other.wait()
            return 130
    for relay in relays:
        relay.join(timeout=10)
    for name, code in codes.items():
        print(f"[{name}] pytest exited {code}")
    print(f"every stream done in {time.monotonic() - t0:.0f} s")
    return combined(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
