"""One writer per run: the training driver's lease on ``{run.storage}/{run.name}/``.

A driver takes the lease before Ray starts and holds it until it ends. The lease is one small JSON
object, ``{run}/.lease.json``: who holds it (user, host, pid, the Ray job's submission id when there is
one), since when, when it was last renewed, and a token. It is taken atomically: ``O_EXCL`` on a local
folder, a conditional write on S3 (``If-None-Match: *``; AWS S3, MinIO and moto_server refuse a second
writer with 412). A thread renews it every quarter of ``run.lease_stale_s``; a lease not renewed for
``run.lease_stale_s`` is stale (its driver was killed, its node lost) and the next driver takes it over,
with one line, by a write conditional on the stale lease (a rename on a local folder, ``If-Match`` on its
ETag on S3), so of two drivers taking over only one wins. A lease that missed two renewals (its driver
most likely gone on another host: a RayJob retried on a new cluster) is waited on until it goes stale,
with one line, rather than refused. Read-only commands take no lease.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from ray_app.shared.errors import RunHeld

LEASE_FILE = ".lease.json"


def holder_record(token: str, now: float) -> dict:
    """Who this driver is, for the line a second driver prints."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    record = {"user": user, "host": socket.gethostname(), "pid": os.getpid(), "since": now, "renewed": now,
              "token": token}
    job = os.environ.get("RAY_JOB_SUBMISSION_ID") or os.environ.get("RAY_JOB_ID")
    if job:
        record["ray_job"] = job
    return record


def holder_gone(record: dict) -> bool:
    """Whether the lease's driver ran on this host and its process no longer exists (a driver killed here,
    and the run submitted again at once): such a lease is taken over without waiting for it to go stale.
    A driver on another host is only known gone by its lease not being renewed."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if record["pid"] == os.getpid():
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's process, say)
        return False
    return False


def describe(record: dict, now: float) -> str:
    who = f"{record.get('user', '?')}@{record.get('host', '?')} pid {record.get('pid', '?')}"
    if record.get("ray_job"):
        who += f" (Ray job {record['ray_job']})"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record.get("since", 0))))
    return f"{who} since {since} (renewed {max(0.0, now - float(record.get('renewed', 0))):.0f} s ago)"


class LocalLeaseFile:
    """The lease as a file in a local folder; versions are the file's bytes."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LEASE_FILE

    def create(self, body: bytes) -> bool:
        """Create the lease with its whole body at once: the body goes to a file of its own, then a hard
        link names it (atomic, and refused when the lease exists), so no reader ever sees a lease being
        written. Where the folder has no hard links, ``O_EXCL`` and a write."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{LEASE_FILE}.{uuid.uuid4().hex[:8]}.new")
        try:
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:  # a full disk: no temp file left
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        return True

    def read(self):
        """(record, version) or None when there is no lease."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw), raw
        except ValueError:  # being written (O_EXCL, no hard links) or its driver killed meanwhile:
            try:  # renewed when the file was last written
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                return None
            return {"renewed": mtime, "since": mtime}, raw

    def replace(self, body: bytes, version) -> bool:
        """The renewal: write ``body`` in place of the lease if it is still ``version`` (no moment without
        a lease file, so a driver starting meanwhile finds it held)."""
        current = self.read()
        if current is None or current[1] != version:
            return False
        tmp = self.path.with_name(f"{LEASE_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_bytes(body)
            os.replace(tmp, self.path)
        finally:  # a renewal that failed (a full disk) leaves no temp file
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return True

    def sweep(self, stale_s: float, now: float) -> None:
        """At a driver's start, holding the lease: the temp files a failed renewal (``.tmp``: only the
        holder writes them) or a killed driver (``.new``, ``.stale``, once older than ``stale_s``) left."""
        for f in self.path.parent.glob(f"{LEASE_FILE}.*"):
            try:
                if f.suffix == ".tmp" or (f.suffix in (".new", ".stale") and now - f.stat().st_mtime > stale_s):
                    f.unlink()
            except FileNotFoundError:
                pass

    def take_over(self, body: bytes, version) -> bool:
        """Replace a stale lease ``version``: of two drivers taking over, one moves it away, the other
        finds none."""
        moved = self.path.with_name(f"{LEASE_FILE}.{uuid.uuid4().hex[:8]}.stale")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return False
        if moved.read_bytes() != version:  # renewed or taken since it was read: put it back
            os.rename(moved, self.path)
            return False
        moved.unlink()
        return self.create(body)

    def delete(self, version) -> None:
        current = self.read()
        if current is not None and current[1] == version:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class S3LeaseObject:
    """The lease as an S3 object written with conditional requests; versions are ETags."""

    def __init__(self, storage, rel: str):
        self.storage, self.key = storage, storage._key(f"{rel}/{LEASE_FILE}")
        self.bucket = storage.settings.bucket

    def _call(self, what: str, fn):
        try:
            return self.storage.retry_raw(what, fn)
        except Exception as exc:  # a refused condition is the lease's answer; anything else is one line
            error = None if self._refused(exc) else self.storage.as_storage_error(exc, what)
            if error is None:
                raise
            raise error from None

    @staticmethod
    def _refused(exc) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey") \
            or status in (409, 412)

    def _put(self, body: bytes, **condition) -> bool:
        def put() -> bool:  # a refusal (412) is an answer, not an error: never retried, never a StorageError
            try:
                self.storage.client.put_object(Bucket=self.bucket, Key=self.key, Body=body,
                                               ContentType="application/json", **condition)
            except Exception as exc:
                if self._refused(exc):
                    return False
                raise
            return True

        return self._call("writing the run's lease", put)

    def create(self, body: bytes) -> bool:
        return self._put(body, IfNoneMatch="*")

    def read(self):
        from botocore.exceptions import ClientError

        def get():
            try:
                out = self.storage.client.get_object(Bucket=self.bucket, Key=self.key)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            return out["Body"].read(), out["ETag"]

        found = self._call("reading the run's lease", get)
        if found is None:
            return None
        raw, etag = found
        try:
            return json.loads(raw), etag
        except ValueError:
            return {"renewed": 0, "since": 0}, etag

    def replace(self, body: bytes, version) -> bool:
        return self._put(body, IfMatch=version)

    take_over = replace

    def sweep(self, stale_s: float, now: float) -> None:
        """Nothing to sweep: conditional writes leave no temp objects."""

    def delete(self, version) -> None:
        with contextlib.suppress(Exception):
            self.storage.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)


def lease_store(storage, run: str):
    """The lease of ``run`` in ``storage`` (a ``LocalStorage`` or an ``S3Storage``)."""
    if hasattr(storage, "root"):
        return LocalLeaseFile(Path(storage.root) / run)
    return S3LeaseObject(storage, run)


def fence(storage, run: str, token: str):
    """A check for the workers, before each commit: ``RunHeld`` unless the run's lease still holds ``token``
    (their driver's). A driver killed without releasing leaves its workers running until Ray notices; once
    another driver has taken the run over, they must not commit another checkpoint (one writer per run)."""
    store = lease_store(storage, run)

    def check() -> None:
        current = store.read()
        record = current[0] if current else {}
        if record.get("token") != token:
            held = describe(record, time.time()) if record.get("token") else "nobody"
            raise RunHeld(f"run {storage.uri(run)} is no longer held by this worker group's driver (now: {held}); "
                          "no checkpoint is committed")

    return check


class RunLease:
    """A driver's lease on its run: ``acquire``, renewed by a thread, ``release``."""

    def __init__(self, store, where: str, stale_s: float, say=None, clock=time.time, sleep=time.sleep):
        self.store, self.where, self.stale_s, self.clock, self.sleep = store, where, stale_s, clock, sleep
        self.say = say or (lambda m: print(m, file=sys.stderr, flush=True))
        self.token = uuid.uuid4().hex
        self.record: dict = {}
        self.version = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False
        self.took_over: dict | None = None  # whom this driver took the run over from, and why

    def _body(self) -> bytes:
        return json.dumps(self.record, sort_keys=True).encode()

    def acquire(self) -> None:
        """Take the lease, or raise ``RunHeld`` naming the holder; a stale lease is taken over."""
        now = self.clock()
        self.record = holder_record(self.token, now)
        for _ in range(5):  # a lease that vanishes or changes between two calls: look again
            if self.store.create(self._body()):
                self.version = self._current_version()
                if self.version is not None:
                    return
                continue
            found = self.store.read()
            if found is None:
                continue
            held, version = found
            idle = self.clock() - float(held.get("renewed", 0))
            gone = holder_gone(held)
            if not gone and self.stale_s / 2 < idle <= self.stale_s:
                self._wait_until_stale(held, version)  # overdue: its driver is likely gone (a RayJob retry)
                continue
            if idle <= self.stale_s and not gone:
                raise RunHeld(f"run {self.where} is held by another driver: {describe(held, self.clock())}; "
                              f"wait for it to end or use another run.name (a driver that is gone loses the "
                              f"lease {self.stale_s:g} s after its last renewal: run.lease_stale_s)")
            self.record["since"] = self.record["renewed"] = self.clock()  # after a wait: held from now
            if self.store.take_over(self._body(), version):
                self.version = self._current_version()
                if self.version is None:
                    continue
                why = ("its process is gone from this host" if gone else
                       f"not renewed for {idle:.0f} s (> run.lease_stale_s = {self.stale_s:g})")
                self.took_over = {"from": describe(held, self.clock()), "why": why}  # for the run journal
                self.say(f"ray-app: taking over run {self.where} from {self.took_over['from']}: {why}")
                return
        raise RunHeld(f"run {self.where}: another driver is taking its lease at the same time; try again")

    def _wait_until_stale(self, held: dict, version) -> None:
        """A lease whose driver missed two renewals (it renews every quarter of ``run.lease_stale_s``) is
        likely left by a driver that is gone on another host: a RayJob retried on a new cluster, a driver
        restarted by its supervisor. Wait for it to go stale rather than fail (one line); a renewal
        meanwhile means its driver is alive: ``RunHeld``."""
        deadline = float(held.get("renewed", 0)) + self.stale_s
        self.say(f"ray-app: run {self.where} is held by {describe(held, self.clock())}, which missed its "
                 f"renewals; waiting {max(0.0, deadline - self.clock()):.0f} s for the lease to go stale "
                 "(run.lease_stale_s)")
        while self.clock() <= deadline:
            self.sleep(min(1.0, max(0.05, deadline - self.clock() + 0.01)))
            found = self.store.read()
            if found is None:
                return  # released meanwhile: take it
            if found[1] != version:
                raise RunHeld(f"run {self.where} is held by another driver: {describe(found[0], self.clock())}; "
                              "wait for it to end or use another run.name")

    def _current_version(self):
        found = self.store.read()
        return found[1] if found is not None and found[0].get("token") == self.token else None

    def renew(self) -> bool:
        """Write a new renewal time if the lease is still this driver's; False once it is not."""
        self.record["renewed"] = self.clock()
        if self.version is None or not self.store.replace(self._body(), self.version):
            return False
        self.version = self._current_version()
        return self.version is not None

    def start_renewing(self) -> None:
        interval = max(self.stale_s / 4, 0.5)

        def loop():
            while not self._stop.wait(interval):
                try:
                    ok = self.renew()
                except Exception as exc:  # storage down: try again at the next interval
                    self.say(f"ray-app: could not renew the lease of run {self.where} ({type(exc).__name__}); "
                             "retrying")
                    continue
                if not ok and not self._lost:
                    self._lost = True
                    self.say(f"ray-app: the lease of run {self.where} was taken by another driver; "
                             "this driver's checkpoints may interleave with its")
                    return

        self._thread = threading.Thread(target=loop, name="ray-app-lease", daemon=True)
        self._thread.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def release(self) -> None:
        self.stop_renewing()
        if self.version is not None and not self._lost:
            with contextlib.suppress(Exception):
                self.store.delete(self.version)
        self.version = None


def sweep_leftovers(storage, run: str, lease: RunLease) -> None:
    """What earlier writers of the run left, removed by the driver that now holds it: uncommitted checkpoint
    folders older than ``run.lease_stale_s`` (``ray_app.shared.catalog.sweep_uncommitted``; the lease's own
    temp files go in ``held_run``). Best effort: what cannot be removed now is tried at the next start."""
    from ray_app.shared.catalog import sweep_uncommitted

    try:
        sweep_uncommitted(storage, run, lease.stale_s, say=lease.say, now=lease.clock())
    except Exception as exc:
        lease.say(f"ray-app: could not remove what earlier writes of run {lease.where} left "
                  f"({type(exc).__name__}: {exc}); trying again at the next start")


@contextlib.contextmanager
def held_run(storage, run: str, stale_s: float):
    """The run's lease, held (and renewed) for the ``with`` block, released at its end; what earlier writers
    left uncommitted is swept once it is held (``sweep_leftovers``)."""
    lease = RunLease(lease_store(storage, run), storage.uri(run), stale_s)
    lease.acquire()
    lease.store.sweep(lease.stale_s, lease.clock())  # before the renewing thread writes temp files of its own
    lease.start_renewing()
    sweep_leftovers(storage, run, lease)
    try:
        yield lease
    finally:
        lease.release()
