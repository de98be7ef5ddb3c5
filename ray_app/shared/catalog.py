"""The checkpoint catalog: the one place that names, lists, checks and finds checkpoints.

A run is ``{storage}/{run}/``; its checkpoints are the folders ``ckpt-s{step:09d}-{stamp}-{rand}`` in it,
each committed by its ``manifest.json`` (the sha256 and size of every file, written last). ``locate``
tells a run URI from a checkpoint URI (the one place that does) and opens its storage with the retry
budget; ``find`` yields a run's checkpoints newest first that pass a check (listed, manifest, config,
verified), or the one named. The loop's restore, warm starts, ``ray-app eval``, the driver's resume check,
script mode and ``ray-app checkpoints`` all find their checkpoints here. No torch: the driver reads the
catalog before it imports torch (``ray_app.worker.checkpoint`` writes and loads).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Iterator

from ray_app.shared.errors import CheckpointDamaged, CheckpointError, StorageError

log = logging.getLogger("ray_app.worker.checkpoint")

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


# ---------------------------------------------------------------- checking one checkpoint

@dataclass
class Verification:
    name: str
    ok: bool
    problems: list[str]
    manifest: dict | None

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


def _check(storage, rel: str, name: str, fmt: str | tuple | None) -> tuple[Verification, dict[str, int]]:
    """(what ``check_manifest`` says, the files present with their sizes)."""
    present = storage.list_files(rel)  # a storage error propagates: an outage is no reason to skip a checkpoint
    if MANIFEST not in present:
        return Verification(name, False, ["no manifest (incomplete or not a ray_app checkpoint)"], None), present
    raw = storage.read_bytes(f"{rel}/{MANIFEST}")  # likewise
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
            problems.append(f"size mismatch in {fname}")
    for required in REQUIRED_FILES[found]:
        if required not in entries:
            problems.append(f"manifest lists no {required}")
    return Verification(name, not problems, problems, manifest), present


def check_manifest(storage, rel: str, name: str | None = None, fmt: str | None = None) -> Verification:
    """What can be checked reading nothing but the manifest: it parses, its format, every file it lists is
    present at its size, the format's required files are listed. The sha256 of each file is checked where
    the file is read (``read_verified``, ``verify``).

    Content problems make a not-ok Verification; storage errors (listing or reading the manifest) propagate,
    so a caller waits an outage out or fails over, never skips a good checkpoint for it."""
    return _check(storage, rel, name or rel.rsplit("/", 1)[-1], fmt)[0]


def verify(storage, rel: str, name: str | None = None, fmt: str | None = None) -> Verification:
    """Check every manifest entry (presence, size, sha256) without loading anything.

    ``fmt``: the format the caller can load (None: any of ``REQUIRED_FILES``, as ``ray-app checkpoints`` lists).
    Storage errors propagate (``check_manifest``)."""
    v, present = _check(storage, rel, name or rel.rsplit("/", 1)[-1], fmt)
    if v.manifest is None or not of_format(v.manifest, fmt):
        return v
    problems = list(v.problems)
    for fname, meta in sorted(v.manifest["files"].items()):
        if present.get(fname) == meta["bytes"] and \
                hashlib.sha256(storage.read_bytes(f"{rel}/{fname}")).hexdigest() != meta["sha256"]:
            problems.append(f"sha256 mismatch in {fname}")
    return Verification(v.name, not problems, problems, v.manifest)


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
        raise CheckpointDamaged(storage.uri(rel), f"sha256 mismatch in {name}")
    return data


# ---------------------------------------------------------------- finding

LISTED, MANIFEST_OK, CONFIG_OK, VERIFIED = "listed", "manifest", "config", "verified"


@dataclass
class Found:
    """One checkpoint the catalog found: where it is, what its check said, and (check ``config``) its config."""

    storage: object
    run: str
    name: str
    verification: Verification | None = None
    config: dict | None = None

    @property
    def rel(self) -> str:
        return f"{self.run}/{self.name}" if self.run else self.name

    @property
    def uri(self) -> str:
        return self.storage.uri(self.rel)


def list_checkpoints(storage, run: str) -> list[str]:
    """Checkpoint dir names of a run, oldest first."""
    return [d for d in storage.list_dirs(run) if is_checkpoint_name(d)]


def _passes(storage, rel: str, name: str, check: str, fmt: str | None) -> tuple[Verification | None, dict | None]:
    if check == LISTED:
        return Verification(name, True, [], None), None
    v = (verify if check == VERIFIED else check_manifest)(storage, rel, name, fmt)
    if not v.ok or check != CONFIG_OK:
        return v, None
    data = storage.read_bytes(f"{rel}/config.json")
    if hashlib.sha256(data).hexdigest() != v.manifest["files"]["config.json"]["sha256"]:
        return Verification(name, False, ["sha256 mismatch in config.json"], v.manifest), None
    try:
        return v, json.loads(data)
    except _MALFORMED:
        return Verification(name, False, ["config.json is not JSON"], v.manifest), None


def find(storage, run: str, *, name: str | None = None, check: str = MANIFEST_OK, fmt: str | None = FORMAT,
         warn=None) -> Iterator[Found]:
    """The checkpoints of ``run`` (or only ``name``), newest first, that pass ``check``:

    - ``listed``: every checkpoint folder, nothing read;
    - ``manifest``: the manifest parses, is of format ``fmt`` and every file it lists is present at its size;
    - ``config``: that, and ``config.json`` matches it (its config is read: what the driver compares);
    - ``verified``: every file's sha256 too.

    One that fails is skipped with ``warn`` (when given). Storage errors propagate: an outage is never a
    reason to skip a good checkpoint."""
    names = [name] if name is not None else list(reversed(list_checkpoints(storage, run)))
    for n in names:
        rel = f"{run}/{n}" if run else n
        v, config = _passes(storage, rel, n, check, fmt)
        if v is not None and v.ok:
            yield Found(storage, run, n, v, config)
        elif warn is not None:
            warn(f"skipping checkpoint {storage.uri(rel)}: {v.reason}")


def newest(storage, run: str, **kwargs) -> Found | None:
    """The first of ``find`` (newest that passes), or None."""
    return next(find(storage, run, **kwargs), None)


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


def named_or_newest(uri: str, *, check: str, fmt: str | None = FORMAT, retry_s: float = 0.0, then: str | None = None,
                    warn=None) -> Found:
    """The checkpoint a URI names, or a run URI's newest that passes ``check`` (older ones tried in turn).
    A named checkpoint that fails is ``CheckpointError``; a run with none that passes too; a URI with no
    checkpoint at all is ``StorageError``."""
    storage, run, name = locate(uri, retry_s, then)
    if name is not None:
        if not storage.list_files(f"{run}/{name}" if run else name):
            raise StorageError(f"{uri}: no such checkpoint; list them with `ray-app checkpoints list RUN_URI`")
        found = next(find(storage, run, name=name, check=check, fmt=fmt), None)
        if found is None:
            v, _ = _passes(storage, f"{run}/{name}" if run else name, name, check, fmt)
            raise CheckpointError(f"checkpoint {storage.uri(run, name)} failed verification: {v.reason}; "
                                  "see `ray-app checkpoints verify`")
        return found
    found = newest(storage, run, check=check, fmt=fmt, warn=warn)
    if found is None:
        no_checkpoint(uri, storage, run)
    return found


def no_checkpoint(uri: str, storage, run: str):
    if list_checkpoints(storage, run):
        raise CheckpointError(f"{uri}: no checkpoint of this run passes verification; "
                              "see `ray-app checkpoints verify`")
    raise StorageError(f"{uri}: no checkpoints found; pass a run URI such as runs/NAME or s3://bucket/prefix/NAME")


def committed_config(uri: str, retry_s: float = 0.0) -> tuple[str, dict]:
    """(URI, config) of a checkpoint URI, or of a run URI's newest committed checkpoint, reading only its
    manifest and config.json (checked against it): what the driver compares before a warm start or an eval."""
    found = named_or_newest(uri, check=CONFIG_OK, retry_s=retry_s, then=AT_START)
    return found.uri, found.config


def newest_committed_config(storage, run: str) -> tuple[str, dict] | None:
    """(URI, config) of the newest checkpoint of a run whose manifest and config.json check out; None when
    the run has no committed checkpoint. Storage errors propagate."""
    found = newest(storage, run, check=CONFIG_OK)
    return (found.uri, found.config) if found is not None else None


def newest_verified(storage, run: str, warn=log.warning, fmt: str | tuple = FORMAT) -> tuple[str | None, list]:
    """The name of the newest checkpoint of format ``fmt`` whose every file matches its manifest (broken
    newer ones skipped with ``warn``), and the list of skipped ones' reasons (kept for callers that count)."""
    skipped = []

    def note(message: str) -> None:
        skipped.append(message)
        warn(message)

    found = newest(storage, run, check=VERIFIED, fmt=fmt, warn=note)
    return (found.name if found else None), skipped
