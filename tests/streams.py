"""`make test`: every tier, in pytest processes side by side, the longest first.

The work is cut into units, each one pytest process: the unit, deploy, bench and e2e tiers together
("others": e2e last, its image building meanwhile) and each module of the integration tier. A kit run on a
2-core machine keeps its cores about a third busy (process start-up, Ray's waits, storage outages and hang
timeouts the tests wait out), while "others" keeps them busy on its own. So units start longest first
(their measured seconds below; a module not listed counts as NEW_MODULE_S) for as long as their weights fit
in SLOTS: "others" weighs 2 and an integration module 1, so one integration module runs beside "others" and
three side by side once it is done. A module that times a ratio (ALONE) runs first, before any other unit.

Each line a process prints is shown as it comes, prefixed by its unit's name; at the end, one line per unit
(its exit code and wall seconds), the slowest tests of all units together and, last, each test that failed or
errored with the first line of its message (what a log's tail shows names it). The exit code is the first
non-zero one in unit order (a unit that collected no test under a ``-k`` selection is not a failure
unless none collected any). A unit's CPU seconds are its pytest process's and those of the processes waited
for under it (its multiprocessing ranks, the ``ray-app`` commands' own processes): a floor, not the whole, as
Ray's daemons and workers, containers and ``ray start`` heads are nobody's waited-for children.

    python -m tests.streams [--durations=N] [PYTEST_ARGS...]
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OTHERS = ["tests/unit", "tests/deploy", "tests/bench", "tests/e2e"]
INTEGRATION = "tests/integration"
SLOTS = 3
# A module whose test asserts a ratio of two wall times of one run (the compile cache's: a restarted group's
# time to its first step at least 3x shorter than the cold compile's) runs first and alone: with other units
# beside it (three at once) the ratio measured 2.5 (4.8 alone), as the load changed between the two moments it times
ALONE = {"test_compile_restart"}
WEIGHT = {"others": 2, **{name: SLOTS for name in ALONE}}  # an integration module: 1
# Wall seconds of each unit measured in a clean-clone `.ci/run` on 2 cores (the whole suite at once, on a
# machine doing nothing else): only the order they start in depends on them. Its cores were 81-98 % busy while
# "others" ran and 99-100 % after: less time needs less work (CPU-seconds), not more processes.
MEASURED_S = {
    "others": 1281,
    "test_s3_checkpoints": 346, "test_sweep": 320, "test_run_faults": 291, "test_user_project": 279,
    "test_script_mode": 274, "test_hf_models": 258, "test_storage_outage": 246, "test_shards_train": 229,
    "test_examples": 218, "test_chaos": 216, "test_compile_restart": 183, "test_train_local": 174,
    "test_tracking_mlflow": 171, "test_faults": 155, "test_metrics_prometheus": 128, "test_local_sockets": 50,
    "test_eval_passes": 3,
}
NEW_MODULE_S = 60
NO_TESTS = 5  # pytest's exit code when it collected nothing


@dataclass
class Unit:
    name: str
    paths: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the pytest process's and the processes waited for under it (not Ray's, nor containers)
    code: int | None = None
    relay: threading.Thread | None = field(default=None, repr=False)

    @property
    def weight(self) -> int:
        return WEIGHT.get(self.name, 1)


def units() -> list[Unit]:
    """Every unit, those that run alone first, then longest first; each integration module found on disk is one
    (a new one is never left out)."""
    found = [Unit("others", OTHERS)] + [Unit(p.stem, [str(p.relative_to(REPO))])
                                        for p in sorted((REPO / INTEGRATION).glob("test_*.py"))]
    return sorted(found, key=lambda u: (u.name not in ALONE, -MEASURED_S.get(u.name, NEW_MODULE_S)))


def next_to_start(pending: list[Unit], free: int) -> Unit | None:
    """The longest pending unit that fits in ``free`` slots; none while the longest does not fit (it would
    otherwise wait behind ever more short ones)."""
    if pending and pending[0].weight <= free:
        return pending[0]
    return None


def combined(codes: list[int]) -> int:
    """One exit code for the units' (in unit order)."""
    if all(code == NO_TESTS for code in codes):
        return NO_TESTS
    return next((code for code in codes if code not in (0, NO_TESTS)), 0)


def _test_id(case: ET.Element) -> str:
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"


def slowest(reports: list[Path], n: int) -> list[tuple[float, str]]:
    """The ``n`` slowest tests over the units' JUnit reports (setup, call and teardown together)."""
    times = []
    for report in reports:
        try:
            root = ET.parse(report).getroot()
        except (OSError, ET.ParseError):
            continue
        times += [(float(case.get("time", 0)), _test_id(case)) for case in root.iter("testcase")]
    return sorted(times, reverse=True)[:n]


def failures(reports: list[Path]) -> list[tuple[str, str, str]]:
    """(FAILED or ERROR, test, the first line of its message) of each test that failed or errored, over the
    units' JUnit reports; a report pytest could not finish (its unit died) is named as such."""
    found = []
    for report in reports:
        try:
            root = ET.parse(report).getroot()
        except FileNotFoundError:
            continue
        except ET.ParseError:
            found.append(("ERROR", str(report), "an unfinished JUnit report: the unit's pytest ended early"))
            continue
        for case in root.iter("testcase"):
            for kind, tag in (("FAILED", "failure"), ("ERROR", "error")):
                for bad in case.iter(tag):
                    text = (bad.get("message") or bad.text or "").strip()
                    found.append((kind, _test_id(case), text.splitlines()[0][:300] if text else ""))
    return found


def split_durations(args: list[str]) -> tuple[int, list[str]]:
    """``--durations=N`` is the scheduler's (one list over every unit), the rest pytest's."""
    n, rest = 0, []
    for arg in args:
        if arg.startswith("--durations="):
            n = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return n, rest


def _relay(unit: Unit, width: int, lock: threading.Lock) -> None:
    for line in unit.proc.stdout:
        with lock:
            sys.stdout.write(f"[{unit.name:<{width}}] {line}")
            sys.stdout.flush()


def _start(unit: Unit, pytest_args: list[str], base: Path, width: int, lock: threading.Lock) -> None:
    # a base folder each, the same every time: two sessions never number, lock or clean up each other's
    # folders, and pytest empties it as the next `make test` starts (what a run leaves stays bounded)
    basetemp = base / f"streams-{unit.name}"
    (base / f"streams-{unit.name}.xml").unlink(missing_ok=True)  # an earlier run's report is never read as this one's
    unit.proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *unit.paths, f"--basetemp={basetemp}",
         f"--junitxml={base / f'streams-{unit.name}.xml'}", *pytest_args], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    unit.started = time.monotonic()
    unit.relay = threading.Thread(target=_relay, args=(unit, width, lock), daemon=True)
    unit.relay.start()


def _ended(unit: Unit) -> bool:
    """Whether the unit's pytest process ended; if so its exit code and CPU seconds are set (``os.wait4``: the
    process's own and that of the processes waited for under it; Ray's daemons and workers are not)."""
    pid, status, usage = os.wait4(unit.proc.pid, os.WNOHANG)
    if pid == 0:
        return False
    unit.code = unit.proc.returncode = os.waitstatus_to_exitcode(status)
    unit.cpu_seconds = usage.ru_utime + usage.ru_stime
    return True


def main(args: list[str]) -> int:
    n_slowest, pytest_args = split_durations(args)
    base = Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)  # pytest makes each unit's folder, not its parent
    pending, running, done = units(), [], []
    width = max(len(u.name) for u in pending)
    lock, t0 = threading.Lock(), time.monotonic()
    try:
        while pending or running:
            free = SLOTS - sum(u.weight for u in running)
            unit = next_to_start(pending, free)
            if unit is not None:
                pending.remove(unit)
                _start(unit, pytest_args, base, width, lock)
                running.append(unit)
                continue
            time.sleep(0.5)
            for unit in [u for u in running if _ended(u)]:
                unit.seconds = time.monotonic() - unit.started
                unit.relay.join(timeout=10)
                running.remove(unit)
                done.append(unit)
    except KeyboardInterrupt:  # Ctrl-C reached the pytest processes too (one process group): let them end
        for unit in running:
            unit.proc.wait()
        return 130
    print(f"{'unit':<{width}}  exit  seconds  cpu-seconds")
    for unit in done:
        note = "  (no test selected)" if unit.code == NO_TESTS else ""
        print(f"{unit.name:<{width}}  {unit.code:>4}  {unit.seconds:7.0f}  {unit.cpu_seconds:11.0f}{note}")
    reports = [base / f"streams-{u.name}.xml" for u in done]
    if n_slowest:
        print(f"slowest {n_slowest} tests of every unit:")
        for seconds, name in slowest(reports, n_slowest):
            print(f"{seconds:8.2f}s {name}")
    bad = failures(reports)
    for kind, name, message in bad:
        print(f"{kind} {name} - {message}")
    print(f"every unit done in {time.monotonic() - t0:.0f} s; {len(bad)} failed or errored")
    order = {u.name: i for i, u in enumerate(units())}
    return combined([u.code for u in sorted(done, key=lambda u: order[u.name])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
