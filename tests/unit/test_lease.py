"""One writer per run: the driver's lease on a local folder, with real files and a real clock."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from ray_app.shared.errors import RunHeld
from ray_app.shared.lease import LEASE_FILE, LocalLeaseFile, RunLease, held_run, lease_store
from ray_app.shared.storage import LocalStorage


def _lease(tmp_path, stale_s=30.0, said=None, clock=time.time, sleep=time.sleep):
    return RunLease(LocalLeaseFile(tmp_path / "run"), str(tmp_path / "run"), stale_s,
                    say=(said.append if said is not None else lambda m: None), clock=clock, sleep=sleep)


@pytest.mark.timeout(30)
def test_a_second_driver_is_refused_naming_the_holder_and_since_when(tmp_path):
    first = _lease(tmp_path)
    first.acquire()
    with pytest.raises(RunHeld) as refused:
        _lease(tmp_path).acquire()
    line = str(refused.value)
    assert "\n" not in line
    assert f"pid {os.getpid()}" in line and "since 20" in line and "run.lease_stale_s" in line
    first.release()
    assert not (tmp_path / "run" / LEASE_FILE).exists()
    _lease(tmp_path).acquire()  # released: the next driver takes it


@pytest.mark.timeout(30)
def test_of_many_drivers_starting_at_once_exactly_one_holds_the_run(tmp_path):
    won, refused = [], []
    barrier = threading.Barrier(8)

    def start():
        lease = _lease(tmp_path)
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease)
        except RunHeld:
            refused.append(lease)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7


@pytest.mark.timeout(30)
def test_a_lease_not_renewed_for_the_stale_time_is_taken_over_with_one_line(tmp_path):
    now = [1000.0]
    gone = _lease(tmp_path, stale_s=10, clock=lambda: now[0])
    gone.acquire()  # then its driver is SIGKILLed: no release, no renewal
    now[0] += 4  # within two renewals (every 2.5 s): its driver may well be alive
    with pytest.raises(RunHeld):
        _lease(tmp_path, stale_s=10, clock=lambda: now[0]).acquire()
    now[0] += 7
    said = []
    heir = _lease(tmp_path, stale_s=10, said=said, clock=lambda: now[0])
    heir.acquire()
    assert len(said) == 1 and "taking over" in said[0] and "not renewed for 11 s" in said[0]
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_bytes())["token"] == heir.token
    assert gone.renew() is False  # the old holder, were it alive, finds it is no longer its lease


@pytest.mark.timeout(30)
def test_a_lease_that_missed_its_renewals_is_waited_on_until_stale_and_a_renewal_ends_the_wait(tmp_path):
    """A RayJob retried on a new cluster finds its first driver's lease, renewed 7 s ago of 10: not yet
    stale, but two renewals missed. It waits (one line) until the lease is stale and takes it over; had
    the holder renewed meanwhile, it is alive, and the second driver is refused."""
    now = [1000.0]

    def sleep(s):
        now[0] += s

    gone = _lease(tmp_path, stale_s=10, clock=lambda: now[0])
    gone.acquire()
    now[0] += 7
    said = []
    heir = _lease(tmp_path, stale_s=10, said=said, clock=lambda: now[0], sleep=sleep)
    heir.acquire()
    assert now[0] > 1010 and now[0] < 1012, now[0]  # waited until stale, not longer
    assert len(said) == 2 and "missed its renewals; waiting 3 s" in said[0] and "taking over" in said[1], said
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_bytes())["token"] == heir.token

    def renewing_sleep(s):  # the holder was only slow: it renews while the second driver waits
        now[0] += s
        alive.renew()

    alive = heir
    now[0] += 7
    with pytest.raises(RunHeld, match="held by another driver"):
        _lease(tmp_path, stale_s=10, clock=lambda: now[0], sleep=renewing_sleep).acquire()
    assert json.loads((tmp_path / "run" / LEASE_FILE).read_bytes())["token"] == alive.token


@pytest.mark.timeout(30)
def test_the_renewing_thread_keeps_a_long_run_held(tmp_path):
    storage = LocalStorage(str(tmp_path))
    with held_run(storage, "run", stale_s=2.0):
        time.sleep(3.0)  # longer than the stale time: only renewals keep it fresh
        with pytest.raises(RunHeld):
            RunLease(LocalLeaseFile(tmp_path / "run"), "run", 2.0).acquire()
    assert not (tmp_path / "run" / LEASE_FILE).exists()


HOLDER = """
import sys, time
from ray_app.shared.lease import held_run
from ray_app.shared.storage import LocalStorage
with held_run(LocalStorage(sys.argv[1]), "run", stale_s=float(sys.argv[2])):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_lease_left_by_a_sigkilled_driver_is_taken_over_once_stale(tmp_path):
    import signal
    import subprocess
    import sys

    stale_s = 2.0
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(stale_s)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(stale_s)  # renewed meanwhile: still held
        with pytest.raises(RunHeld, match=f"pid {holder.pid}"):
            _lease(tmp_path, stale_s=stale_s).acquire()
        holder.send_signal(signal.SIGKILL)  # no release, no more renewals
        holder.wait(timeout=10)
        killed = time.monotonic()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    said = []
    while True:
        try:
            _lease(tmp_path, stale_s=stale_s, said=said).acquire()
            break
        except RunHeld:
            assert time.monotonic() - killed < stale_s + 5
            time.sleep(0.2)
    assert len(said) == 1 and "taking over" in said[0] and f"pid {holder.pid}" in said[0]


@pytest.mark.timeout(30)
def test_a_lease_whose_driver_is_gone_from_this_host_is_taken_over_at_once(tmp_path):
    """The whole job killed on this machine and submitted again at once (a lost local run): the lease's
    process no longer exists here, so it does not lock the run for run.lease_stale_s."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = _lease(tmp_path, stale_s=3600)
    holder.acquire()
    path = tmp_path / "run" / LEASE_FILE
    record = json.loads(path.read_text())
    path.write_text(json.dumps(dict(record, pid=gone.pid, token="a-driver-killed-here")))
    said = []
    _lease(tmp_path, stale_s=3600, said=said).acquire()  # not stale by the clock: gone by its pid
    assert len(said) == 1 and f"pid {gone.pid}" in said[0] and "gone from this host" in said[0]
    alive = dict(record, pid=os.getppid(), token="a-driver-running-here")  # a live process on this host
    path.write_text(json.dumps(alive))
    with pytest.raises(RunHeld):
        _lease(tmp_path, stale_s=3600).acquire()


def test_workers_commit_no_checkpoint_once_another_driver_holds_the_run(tmp_path):
    """A driver killed without releasing its lease: once another driver has taken the run over, its
    orphaned workers' next checkpoint is not committed (the fence before the manifest raises RunHeld)."""
    from ray_app.shared.catalog import list_checkpoints, newest_good
    from ray_app.shared.lease import fence
    from ray_app.worker.checkpoint import Checkpointer
    from tests.support.checkpoints import save_tiny_shards

    storage = LocalStorage(str(tmp_path))
    first = RunLease(lease_store(storage, "r"), storage.uri("r"), stale_s=30)
    first.acquire()

    def report(metrics, local_dir, dir_name, upload):
        upload(local_dir, dir_name)

    ckpt = Checkpointer(storage, "r", report)
    ckpt.before_commit = fence(storage, "r", first.token)
    save_tiny_shards(ckpt, 1)
    assert newest_good(storage, "r") is not None  # its own driver: committed

    (tmp_path / "r" / LEASE_FILE).unlink()  # the first driver is gone; a second one takes the run
    second = RunLease(lease_store(storage, "r"), storage.uri("r"), stale_s=30)
    second.acquire()
    with pytest.raises(RunHeld, match="no longer held by this worker group's driver"):
        save_tiny_shards(ckpt, 2)
    assert list_checkpoints(storage, "r") == [newest_good(storage, "r").name]  # never committed, and removed
    second.release()


def _named_ago(step: int, seconds: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(time.time() - seconds))
    return f"ckpt-s{step:09d}-{stamp}-abcd"


@pytest.mark.timeout(60)
def test_the_driver_holding_the_run_sweeps_what_earlier_writes_left_uncommitted(tmp_path, capsys):
    """At the next start: an uncommitted checkpoint folder (a killed worker's share, no manifest) older than
    run.lease_stale_s and a failed renewal's temp file go; a committed checkpoint and a folder being written
    now stay."""
    from ray_app.shared.catalog import list_checkpoints
    from ray_app.worker.checkpoint import Checkpointer
    from tests.support.checkpoints import save_tiny_shards

    storage = LocalStorage(str(tmp_path))

    def report(metrics, local_dir, dir_name, upload):
        upload(local_dir, dir_name)

    committed, _ = save_tiny_shards(Checkpointer(storage, "r", report), 1)
    left, in_flight = _named_ago(2, 120), _named_ago(3, 5)
    for name in (left, in_flight):
        (tmp_path / "r" / name / "model").mkdir(parents=True)
        (tmp_path / "r" / name / "model" / "__0_0.distcp").write_bytes(b"a share")
    (tmp_path / "r" / f"{LEASE_FILE}.0123abcd.tmp").write_text("{}")  # a renewal that failed half-way
    with held_run(storage, "r", stale_s=60.0):
        assert list_checkpoints(storage, "r") == [committed, in_flight]
        assert sorted(p.name for p in (tmp_path / "r").iterdir() if p.name.startswith(LEASE_FILE)) == [LEASE_FILE]
    err = capsys.readouterr().err
    assert f"ray-app: removed {storage.uri('r', left)}: never committed (no manifest)" in err
    assert in_flight not in err


@pytest.mark.timeout(60)
def test_a_renewal_on_a_full_disk_leaves_no_temp_file(tmp_path):
    from tests.support.disks import files_under, small_disk

    with small_disk(tmp_path / "disk", "1M") as disk:
        lease = RunLease(LocalLeaseFile(disk), str(disk), stale_s=30)
        lease.acquire()
        (disk / "filler").write_bytes(b"x" * ((1 << 20) - 4096))  # the disk, full
        while True:
            try:
                with open(disk / "filler", "ab") as f:
                    f.write(b"x" * 512)
            except OSError:
                break
        with pytest.raises(OSError):
            lease.renew()
        assert files_under(disk) == [LEASE_FILE, "filler"]


@pytest.mark.timeout(60)
def test_a_killed_workers_share_in_the_s3_bucket_is_swept_at_the_next_start(s3, monkeypatch):
    """On S3 (moto_server): the objects of an uncommitted checkpoint older than run.lease_stale_s go when the
    next driver holds the run; a committed checkpoint's stay."""
    from ray_app.shared.storage import S3Storage

    for key, value in s3.env().items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    storage = S3Storage(f"s3://{s3.bucket}/sweep", retry_s=10)
    left, committed = _named_ago(2, 120), _named_ago(1, 300)
    for name, files in ((left, ("model/__0_0.distcp", "parts/rank_0.json")), (committed, ("state.pt", "manifest.json"))):
        for f in files:
            storage.write_bytes(f"r/{name}/{f}", b"x")
    with held_run(storage, "r", stale_s=60.0):
        assert storage.list_dirs("r") == [committed]
    assert set(storage.list_files(f"r/{committed}")) == {"state.pt", "manifest.json"}
