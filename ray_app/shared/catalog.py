"""A checkpoint's life, from its write to its deletion, and the one place that finds and chooses checkpoints.

1. write: every rank writes its share into a new folder ``{storage}/{run}/ckpt-s{step:09d}-{stamp}-{rand}``
   (``ray_app.worker.checkpoint.Checkpointer.save_shards`` and ``ray_app.worker.sharded``; a ``ray-app run``
   script's ``save``: ``ray_app.worker.script``). A write that fails removes its folder (``remove_uncommitted``).
2. commit: rank 0 writes ``manifest.json`` last (the sha256 and size of every file), after the lease's fence
   (``ray_app.shared.lease.fence``: only the driver holding the run commits). A folder without a manifest
   is no checkpoint; the next driver of the run sweeps such folders once older than ``run.lease_stale_s``
   (``sweep_uncommitted``).
3. find: ONE rule, ``good`` / ``newest_good`` / ``choose``: the newest checkpoint that verifies (manifest
   present, every file present at its size and matching its sha256). Train's resume, a warm start,
   ``ray-app eval``, ``checkpoints export``, the driver's config check and its "complete" check all choose
   here; a checkpoint ``ray-app checkpoints verify`` rejects is never used, and each skipped one is said once
   (``skipped_line``). Verifying reads every file once; the bytes a load needs are kept (``keep``), so the
   load reads nothing again.
4. load: ``ray_app.worker.checkpoint.load`` turns a chosen checkpoint into tensors (every file through
   ``torch.load(data, weights_only=True)``; a sharded one resharded through DCP). ``TrainState`` is the one schema of
   ``state.json`` (written and read by it only).
5. delete: Ray Train's retention keeps ``checkpoint.keep`` committed ones; uncommitted folders go as above.

``locate`` tells a run URI from a checkpoint URI (the one place that does) and opens its storage with the
retry budget. No torch: the driver reads the catalog before it imports torch.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Iterator

from ray_app.shared.errors import CheckpointDamaged, CheckpointError, StorageError

log = logging.getLogger("ray_app.shared.catalog")

MANIFEST = "manifest.json"
SHARDED_FORMAT = "ray_app.checkpoint/2"  # the training loop's checkpoints: every rank writes its share (ray_app.worker.sharded)
SINGLE_FILE_FORMAT = "ray_app.checkpoint/1"  # the loop's earlier checkpoints: rank 0 wrote model.pt (still loaded)
FORMAT = (SHARDED_FORMAT, SINGLE_FILE_FORMAT)  # what the loop writes and loads
SCRIPT_FORMAT = "ray_app.script/1"  # what a `ray-app run` script passes to ray_app.script.save()
# what a manifest of each format must list (a manifest of another format is not a ray_app checkpoint)
REQUIRED_FILES = {SHARDED_FORMAT: ("model/.metadata", "optim/.metadata", "state.json", "config.json"),
                  SINGLE_FILE_FORMAT: ("model.pt", "optimizer.pt", "state.json", "config.json"),
                  SCRIPT_FORMAT: ("state.pt",)}
PREFIX = "ckpt-s"
_NAME = re.compile(rf"{PREFIX}(\d+)-")

# what a command's own reads say when the store does not answer within the budget (a worker's restart instead)
AT_START = "check AWS_ENDPOINT_URL_S3 and that the store is running, then run the command again"


def checkpoint_dir_name(global_step: int) -> str:
    """Sortable by step, then time; unique so nothing is ever overwritten."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{PREFIX}{global_step:09d}-{stamp}-{os.urandom(2).hex()}"


def step_of(name: str) -> int | None:
    """The step a checkpoint's name carries; None for a name that is no checkpoint's."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def is_checkpoint_name(name: str) -> bool:
    return name.startswith(PREFIX)


# ---------------------------------------------------------------- what a checkpoint's state.json holds

@dataclass
class Position:
    """Where training is: epoch (0-based), batches done in it (on each rank), optimizer steps so far, and
    the samples of the epoch's order read so far by all ranks together (what a resume at another world
    size starts from), and the world size the epoch started at (the streamed shards' order is cut into
    that many blocks; 0 before the first epoch starts)."""

    epoch: int = 0
    batches_done: int = 0
    global_step: int = 0
    samples_done: int = 0
    epoch_world_size: int = 0


@dataclass
class TrainState:
    """The one schema of a checkpoint's ``state.json``, written (``state_dict``) and read (``from_state_dict``)
    here only: where training is, the world size it was at, the newest eval metrics (a resumed run's summary
    and checkpoints carry them until it evaluates again), the trackers' state (the MLflow run id, ...) and the
    epoch's loss so far: the global (sum of loss x samples, samples) of its batches up to ``pos`` (a run resumed
    mid-epoch reports the whole epoch's loss, the steps re-done after a failure counted once)."""

    pos: Position
    world_size: int
    last_eval: dict = field(default_factory=dict)
    tracking: dict = field(default_factory=dict)
    epoch_loss: tuple[float, float] = (0.0, 0.0)

    def state_dict(self) -> dict:
        p = self.pos
        return {"epoch": p.epoch, "batches_done": p.batches_done, "samples_done": p.samples_done,
                "epoch_world_size": p.epoch_world_size, "global_step": p.global_step, "world_size": self.world_size,
                "last_eval": self.last_eval, "tracking": self.tracking,
                "epoch_loss_sum": float(self.epoch_loss[0]), "epoch_loss_samples": float(self.epoch_loss[1])}

    @classmethod
    def from_state_dict(cls, s: dict, batch_size: int = 0, world_size: int = 1) -> TrainState:
        """Older checkpoints lack some keys: their samples read so far follow from the batches done at their
        world size, and their epoch started at that world size (``world_size``: this run's, if theirs is missing);
        without the epoch's loss sums, the epoch's loss is that of the steps after the resume (sums from zero)."""
        saved_world = s.get("world_size", world_size)
        pos = Position(s["epoch"], s["batches_done"], s["global_step"],
                       s.get("samples_done", s["batches_done"] * batch_size * saved_world),
                       s.get("epoch_world_size", saved_world))
        epoch_loss = (float(s.get("epoch_loss_sum", 0.0)), float(s.get("epoch_loss_samples", 0.0)))
        return cls(pos, saved_world, s.get("last_eval", {}), s.get("tracking", {}), epoch_loss)

    @classmethod
    def from_json(cls, raw: bytes, batch_size: int = 0, world_size: int = 1) -> TrainState:
        return cls.from_state_dict(json.loads(raw), batch_size, world_size)


# ---------------------------------------------------------------- checking one checkpoint

@dataclass
class Verification:
    name: str
    ok: bool
    problems: list[str]
    manifest: dict | None
    contents: dict[str, bytes] = field(default_factory=dict)  # the verified bytes kept for the load (``keep``)

    @property
    def reason(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"


def manifest_format(manifest: dict) -> str:
    """The format a manifest names; CheckpointError unless it is one of ``REQUIRED_FILES`` (a real check,
    not an ``assert``: it holds under ``python -O`` too)."""
    found = manifest.get("format")
    if found not in REQUIRED_FILES:
        raise CheckpointError(f"manifest of an unknown format {found!r} (known: {', '.join(REQUIRED_FILES)}): "
                              "not a ray_app checkpoint, or one of a newer version")
    return found


def _formats(fmt: str | tuple | None) -> tuple:
    return (fmt,) if isinstance(fmt, str) else tuple(fmt or ())


def of_format(manifest: dict, fmt: str | tuple | None) -> bool:
    """Whether a manifest is of ``fmt`` (a format, a tuple of formats such as ``FORMAT``, or None: any)."""
    return fmt is None or manifest.get("format") in _formats(fmt)


_MALFORMED = (ValueError, KeyError, TypeError, AttributeError)  # what parsing a malformed manifest raises


def mismatch(fname: str, what: str = "sha256") -> str:
    """The problem a file that differs from its manifest entry is named by."""
    return f"{fname} does not match its manifest ({what})"


def _check(storage, rel: str, name: str, fmt: str | tuple | None) -> tuple[Verification, dict[str, int]]:
    """(what can be checked reading nothing but the manifest, the files present with their sizes): it
    parses, its format, every file it lists is present at its size, the format's required files are listed.
    Storage errors (listing or reading the manifest) propagate: an outage is no reason to skip a checkpoint."""
    present = storage.list_files(rel)
    if MANIFEST not in present:
        return Verification(name, False, ["no manifest (incomplete or not a ray_app checkpoint)"], None), present
    raw = storage.read_bytes(f"{rel}/{MANIFEST}")
    try:
        manifest = json.loads(raw)
        entries = {str(k): (str(m["sha256"]), int(m["bytes"])) for k, m in dict(manifest["files"]).items()}
    except _MALFORMED:
        return Verification(name, False, ["manifest unreadable (not JSON with a files mapping)"], None), present
    try:
        found = manifest_format(manifest)
    except CheckpointError as exc:
        return Verification(name, False, [str(exc)], None), present
    if not of_format(manifest, fmt):
        return Verification(name, False, [f"a {found} checkpoint, not {' or '.join(_formats(fmt))}"], manifest), present
    problems = []
    for fname, (_, size) in sorted(entries.items()):
        if fname not in present:
            problems.append(f"missing file {fname}")
        elif present[fname] != size:
            problems.append(mismatch(fname, "size"))
    for required in REQUIRED_FILES[found]:
        if required not in entries:
            problems.append(f"manifest lists no {required}")
    return Verification(name, not problems, problems, manifest), present


def verify(storage, rel: str, name: str | None = None, fmt: str | tuple | None = None, keep=None) -> Verification:
    """Check every manifest entry: presence, size and sha256, each file read once; the bytes of the files
    ``keep(file name)`` wants are kept in ``contents`` (what a load then uses without reading them again).

    ``fmt``: the format the caller can load (None: any of ``REQUIRED_FILES``, as ``ray-app checkpoints`` lists).
    Storage errors propagate."""
    v, present = _check(storage, rel, name or rel.rsplit("/", 1)[-1], fmt)
    if v.manifest is None or not of_format(v.manifest, fmt):
        return v
    problems, contents = list(v.problems), {}
    for fname, meta in sorted(v.manifest["files"].items()):
        if present.get(fname) != meta["bytes"]:
            continue
        data = storage.read_bytes(f"{rel}/{fname}")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            problems.append(mismatch(fname))
        elif keep is not None and keep(fname):
            contents[fname] = data
    return Verification(v.name, not problems, problems, v.manifest, contents if not problems else {})


def sha256_file(path) -> str:
    """The sha256 of a local file, read in 1 MiB chunks (what a manifest records of each file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_verified(storage, rel: str, files: dict, name: str) -> bytes:
    """One file of a checkpoint, read once and hashed against its manifest entry (``files``: the manifest's);
    CheckpointDamaged if it does not match."""
    data = storage.read_bytes(f"{rel}/{name}")
    if hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
        raise CheckpointDamaged(storage.uri(rel), mismatch(name))
    return data


# ---------------------------------------------------------------- finding: the newest checkpoint that verifies

@dataclass
class Found:
    """One checkpoint that verifies: where it is, its verification (manifest, the bytes kept)."""

    storage: object
    run: str
    name: str
    verification: Verification

    @property
    def rel(self) -> str:
        return f"{self.run}/{self.name}" if self.run else self.name

    @property
    def uri(self) -> str:
        return self.storage.uri(self.rel)

    @property
    def manifest(self) -> dict:
        return self.verification.manifest

    def read(self, fname: str) -> bytes:
        """A file's verified bytes: kept by the verification, else read (and hashed) now."""
        kept = self.verification.contents.get(fname)
        return kept if kept is not None else read_verified(self.storage, self.rel, self.manifest["files"], fname)

    def json(self, fname: str) -> dict:
        return json.loads(self.read(fname))

    @property
    def config(self) -> dict:
        return self.json("config.json")


def list_checkpoints(storage, run: str) -> list[str]:
    """Checkpoint dir names of a run, oldest first."""
    return [d for d in storage.list_dirs(run) if is_checkpoint_name(d)]


def skipped_line(storage, rel: str, v: Verification) -> str:
    """The one line a checkpoint the rule skips is said with."""
    return f"ray-app: skipped {storage.uri(rel)}: {v.reason}"


def good(storage, run: str, *, fmt: str | tuple | None = FORMAT, keep=None, say=None,
         said: set | None = None) -> Iterator[Found]:
    """THE selection rule: the checkpoints of ``run`` that verify (``verify``), newest first. Each one that
    does not is said with ``say`` (one ``skipped_line``), once: names in ``said`` (what this process, or
    the driver before the workers, said already) are not said again, and each said one is added to it.
    Storage errors propagate: an outage is never a reason to skip a good checkpoint."""
    said = set() if said is None else said
    for name in reversed(list_checkpoints(storage, run)):
        rel = f"{run}/{name}" if run else name
        v = verify(storage, rel, name, fmt, keep)
        if v.ok:
            yield Found(storage, run, name, v)
        elif name not in said:
            said.add(name)
            if say is not None:
                say(skipped_line(storage, rel, v))


def newest_good(storage, run: str, **kwargs) -> Found | None:
    """The newest checkpoint of ``run`` that verifies (``good``), or None."""
    return next(good(storage, run, **kwargs), None)


def locate(uri: str, retry_s: float = 0.0, then: str | None = None) -> tuple[object, str, str | None]:
    """A run URI or a checkpoint URI as (storage, run, checkpoint name or None), the storage opened with
    ``retry_s`` of retry budget (``then``: what its line says follows when the budget is spent). The one
    place that tells the two apart."""
    from ray_app.shared.storage import open_storage

    uri = uri.rstrip("/")
    parent, _, last = uri.rpartition("/")
    if not last or (uri.startswith("s3://") and parent in ("s3:/", "s3:")):
        raise StorageError(f"{uri}: expected a run or checkpoint path such as s3://bucket/prefix/run-name")
    if is_checkpoint_name(last):
        run_parent, _, run = parent.rpartition("/")
        if run and not (parent.startswith("s3://") and run_parent in ("s3:/", "s3:")):
            return open_storage(run_parent or ".", retry_s=retry_s, then=then), run, last
        return open_storage(parent or ".", retry_s=retry_s, then=then), "", last
    return open_storage(parent or ".", retry_s=retry_s, then=then), last, None


def choose(uri: str, *, fmt: str | tuple | None = FORMAT, keep=None, retry_s: float = 0.0, then: str | None = None,
           say=None, said: set | None = None) -> Found:
    """The checkpoint a URI names (it must verify: else ``CheckpointError``), or a run URI's newest that
    verifies (``good``). A run with checkpoints but none that verifies is ``CheckpointError``; a URI with
    no checkpoint at all is ``StorageError``."""
    storage, run, name = locate(uri, retry_s, then)
    if name is None:
        found = newest_good(storage, run, fmt=fmt, keep=keep, say=say, said=said)
        if found is None:
            no_checkpoint(uri, storage, run)
        return found
    rel = f"{run}/{name}" if run else name
    if not storage.list_files(rel):
        raise StorageError(f"{uri}: no such checkpoint; list them with `ray-app checkpoints list RUN_URI`")
    return verified(storage, rel, fmt=fmt, keep=keep)


def verified(storage, rel: str, *, fmt: str | tuple | None = FORMAT, keep=None) -> Found:
    """The checkpoint at ``rel``, which must verify: else ``CheckpointError`` naming what does not match."""
    run, _, name = rel.rpartition("/")
    v = verify(storage, rel, name, fmt, keep)
    if not v.ok:
        raise CheckpointError(f"checkpoint {storage.uri(rel)} failed verification: {v.reason}; "
                              "see `ray-app checkpoints verify`")
    return Found(storage, run, name, v)


def no_checkpoint(uri: str, storage, run: str):
    if list_checkpoints(storage, run):
        raise CheckpointError(f"{uri}: no checkpoint of this run passes verification; "
                              "see `ray-app checkpoints verify`")
    raise StorageError(f"{uri}: no checkpoints found; pass a run URI such as runs/NAME or s3://bucket/prefix/NAME")


# ---------------------------------------------------------------- deleting what never committed

def written_at(name: str) -> float | None:
    """The unix time a checkpoint's folder was named (its stamp, UTC); None for a name without one."""
    parts = name.split("-")
    try:
        return float(calendar.timegm(time.strptime(parts[2], "%Y%m%dT%H%M%S")))
    except (IndexError, ValueError):
        return None


def remove_uncommitted(storage, rel: str) -> None:
    """Remove a checkpoint folder whose write failed (best effort: what is left, the next driver sweeps).
    Never a committed one: its manifest is the sign."""
    try:
        if MANIFEST not in storage.list_files(rel):
            storage.delete_tree(rel)
    except Exception as exc:  # the write's own error is what the caller raises
        log.warning("could not remove the uncommitted checkpoint %s (%s: %s)", storage.uri(rel),
                    type(exc).__name__, exc)


def sweep_uncommitted(storage, run: str, older_than_s: float, say=None, now: float | None = None) -> list[str]:
    """The driver holding the run's lease, at its start: every ``ckpt-*`` folder without a manifest named
    more than ``older_than_s`` ago (``run.lease_stale_s``: no live writer of this run is that slow, and an
    older driver's workers are fenced off) is garbage, removed with one line each. Returns their names."""
    now = time.time() if now is None else now
    removed = []
    for name in list_checkpoints(storage, run):
        at = written_at(name)
        rel = f"{run}/{name}" if run else name
        if at is None or now - at <= older_than_s or MANIFEST in storage.list_files(rel):
            continue
        storage.delete_tree(rel)
        removed.append(name)
        if say is not None:
            say(f"ray-app: removed {storage.uri(rel)}: never committed (no manifest), "
                f"written {now - at:.0f} s ago (> run.lease_stale_s = {older_than_s:g})")
    return removed
