"""What a checkpoint holds, and how it is written, verified, chosen and loaded.

Layout of one checkpoint, ``{run.storage}/{run.name}/ckpt-s{step}-{stamp}/``::

    model.pt  optimizer.pt  scheduler.pt          (torch.save of plain state dicts)
    rng/rank_{r}.pt                               (each rank's torch/numpy/python RNG)
    state.json  config.json  metrics.json         (position in training, the config, metrics)
    manifest.json                                 (sha256 + size of every file above; uploaded last)

Older checkpoints also hold ``scaler.pt`` (the state of a GradScaler that was never enabled: bf16
autocast needs no loss scaling); it is verified with the rest and not loaded.

A checkpoint whose manifest is missing or does not match is never loaded.
Loading uses ``torch.load(..., weights_only=True)`` only.

A ``ray-app run`` script's checkpoints (``ray_app.script.save``) live the same way under their run: one
``state.pt`` and a manifest of format ``SCRIPT_FORMAT``; the loop never loads them, nor the script the loop's.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from ray_app.errors import CheckpointDamaged, CheckpointError, StorageError
from ray_app.storage import split_uri

log = logging.getLogger("ray_app.checkpoint")

MANIFEST = "manifest.json"
FORMAT = "ray_app.checkpoint/1"  # the training loop's checkpoints
SCRIPT_FORMAT = "ray_app.script/1"  # what a `ray-app run` script passes to ray_app.script.save()
# what a manifest of each format must list (a manifest of another format is not a ray_app checkpoint)
REQUIRED_FILES = {FORMAT: ("model.pt", "optimizer.pt", "state.json", "config.json"), SCRIPT_FORMAT: ("state.pt",)}
PREFIX = "ckpt-s"


def checkpoint_dir_name(global_step: int) -> str:
    """Sortable by step, then time; unique so nothing is ever overwritten."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{PREFIX}{global_step:09d}-{stamp}-{os.urandom(2).hex()}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- RNG state

def capture_rng_state() -> dict:
    """This rank's RNG state in types ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_cached_gaussian": float(np_state[4]),
        "python_version": int(py_state[0]),
        "python_state": list(py_state[1]),
        "python_gauss": py_state[2],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_cached_gaussian"]))
    random.setstate((state["python_version"], tuple(state["python_state"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------- writing

@dataclass
class CheckpointPayload:
    """Everything needed to continue training exactly."""

    model: dict
    optimizer: dict
    scheduler: dict
    rng_per_rank: list[dict]
    state: dict  # state.json: epoch, batches_done (in the epoch), global_step, world_size, last_eval (the newest
    #              eval metrics: a resumed run's summary and checkpoints carry them until it evaluates again)
    config: dict
    metrics: dict = field(default_factory=dict)


def write_checkpoint_dir(path: Path, payload: CheckpointPayload) -> dict:
    """Write every file, then the manifest (last). Returns the manifest."""
    path.mkdir(parents=True, exist_ok=True)
    for name, obj in (("model.pt", payload.model), ("optimizer.pt", payload.optimizer),
                      ("scheduler.pt", payload.scheduler)):
        torch.save(obj, path / name)
    (path / "rng").mkdir(exist_ok=True)
    for rank, rng in enumerate(payload.rng_per_rank):
        torch.save(rng, path / "rng" / f"rank_{rank}.pt")
    for name, obj in (("state.json", payload.state), ("config.json", payload.config),
                      ("metrics.json", payload.metrics)):
        (path / name).write_text(json.dumps(obj, indent=1, sort_keys=True))
    return write_manifest(path, global_step=payload.state["global_step"], epoch=payload.state["epoch"])


def write_manifest(path: Path, *, global_step: int, epoch: int | None, fmt: str = FORMAT) -> dict:
    """The sha256 and size of every file already in ``path``, written last: the checkpoint's commit."""
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[f.relative_to(path).as_posix()] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    manifest = {"format": fmt, "created": time.time(), "global_step": global_step, "epoch": epoch, "files": files}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _cpu_copy(obj):
    """A deep copy whose tensors are new CPU tensors (nothing shared with the live training state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Snapshot:
    """A consistent CPU copy of a payload, taken without stopping training for the big part.

    What the next forward pass may change (module buffers such as BatchNorm statistics) and
    the small parts are copied at once. Parameters and optimizer state change only in the next
    optimizer step, so they are copied on a thread while the next forward/backward runs; the
    loop calls ``wait()`` before that step.
    """

    def __init__(self, payload: CheckpointPayload, param_keys: frozenset[str]):
        self._model = {k: v if k in param_keys else _cpu_copy(v) for k, v in payload.model.items()}
        self._param_keys = param_keys
        self._optimizer = payload.optimizer
        self._small = _cpu_copy({"scheduler": payload.scheduler, "rng": payload.rng_per_rank, "state": payload.state,
                                 "config": payload.config, "metrics": payload.metrics})
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._copy_rest, name="ray-app-ckpt-snapshot", daemon=True)
        self._thread.start()

    def _copy_rest(self) -> None:
        try:
            self._model = {k: _cpu_copy(v) if k in self._param_keys else v for k, v in self._model.items()}
            self._optimizer = _cpu_copy(self._optimizer)
        except BaseException as e:  # surfaced by wait(), on the training thread
            self._error = e

    def wait(self) -> float:
        """Block until the copy is complete; returns the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"copying the checkpoint state failed: {self._error}") from self._error
        return time.perf_counter() - t0

    def payload(self) -> CheckpointPayload:
        self.wait()
        s = self._small
        return CheckpointPayload(model=self._model, optimizer=self._optimizer, scheduler=s["scheduler"],
                                 rng_per_rank=s["rng"], state=s["state"], config=s["config"], metrics=s["metrics"])


def upload_checkpoint_dir(local: Path, storage, rel: str) -> None:
    """Copy a written checkpoint to storage: data files first, the manifest last (the commit)."""
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST)
    for f in files:
        storage.upload_file(str(f), f"{rel}/{f.relative_to(local).as_posix()}")
    storage.upload_file(str(local / MANIFEST), f"{rel}/{MANIFEST}")


# ---------------------------------------------------------------- verifying

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


_MALFORMED = (ValueError, KeyError, TypeError, AttributeError)  # what parsing a malformed manifest raises


def _check(storage, rel: str, name: str, fmt: str | None) -> tuple[Verification, dict[str, int]]:
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
    if fmt is not None and found != fmt:
        return Verification(name, False, [f"a {found} checkpoint, not {fmt}"], manifest), present
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
    the file is read (``load_verified``, ``verify``).

    Content problems make a not-ok Verification; storage errors (listing or reading the manifest) propagate,
    so a caller waits an outage out or fails over, never skips a good checkpoint for it."""
    return _check(storage, rel, name or rel.rsplit("/", 1)[-1], fmt)[0]


def verify(storage, rel: str, name: str | None = None, fmt: str | None = None) -> Verification:
    """Check every manifest entry (presence, size, sha256) without loading anything.

    ``fmt``: the format the caller can load (None: any of ``REQUIRED_FILES``, as ``ray-app checkpoints`` lists).
    Storage errors propagate (``check_manifest``)."""
    v, present = _check(storage, rel, name or rel.rsplit("/", 1)[-1], fmt)
    if v.manifest is None or (fmt is not None and v.manifest.get("format") != fmt):
        return v
    problems = list(v.problems)
    for fname, meta in sorted(v.manifest["files"].items()):
        if present.get(fname) == meta["bytes"] and \
                hashlib.sha256(storage.read_bytes(f"{rel}/{fname}")).hexdigest() != meta["sha256"]:
            problems.append(f"sha256 mismatch in {fname}")
    return Verification(v.name, not problems, problems, v.manifest)


def list_checkpoints(storage, run: str) -> list[str]:
    """Checkpoint dir names of a run, oldest first."""
    return [d for d in storage.list_dirs(run) if d.startswith(PREFIX)]


def newest_verified(storage, run: str, warn=log.warning, fmt: str = FORMAT) -> tuple[str | None, list[Verification]]:
    """The newest checkpoint of format ``fmt`` whose manifest matches; broken newer ones are skipped with a warning."""
    skipped = []
    for name in reversed(list_checkpoints(storage, run)):
        v = verify(storage, f"{run}/{name}", name, fmt)
        if v.ok:
            return name, skipped
        warn(f"skipping checkpoint {storage.uri(run, name)}: {v.reason}")
        skipped.append(v)
    return None, skipped


def newest_committed_config(storage, run: str) -> tuple[str, dict] | None:
    """(URI, config) of the newest checkpoint of a run that has a manifest, its config.json checked against
    it (cheap: the other files are not read). None when the run has no committed checkpoint.
    Storage errors propagate."""
    for name in reversed(list_checkpoints(storage, run)):
        found = _committed_config(storage, f"{run}/{name}")
        if found is not None:
            return found
    return None


def _committed_config(storage, rel: str) -> tuple[str, dict] | None:
    """(URI, config) of one checkpoint if its manifest checks out (``check_manifest``: every file present at
    its size) and its config.json matches it; else None. Reads the manifest and config.json only."""
    v = check_manifest(storage, rel, fmt=FORMAT)
    if not v.ok:
        return None  # not committed, incomplete, or not the loop's
    data = storage.read_bytes(f"{rel}/config.json")
    if hashlib.sha256(data).hexdigest() != v.manifest["files"]["config.json"]["sha256"]:
        return None
    try:
        return storage.uri(rel), json.loads(data)
    except _MALFORMED:
        return None


# ---------------------------------------------------------------- loading

@dataclass
class LoadedCheckpoint:
    uri: str
    model: dict
    optimizer: dict
    scheduler: dict
    rng: dict | None
    state: dict
    config: dict
    created: float = 0.0  # unix time the checkpoint was written (from its manifest)


def load_torch_bytes(data: bytes, where: str = "checkpoint file"):
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # e.g. a pickled object weights_only refuses: bad input, not a crash
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{where} cannot be loaded with torch.load(weights_only=True) "
                              f"({type(exc).__name__}: {first}); it is not a plain ray_app checkpoint") from None


def read_verified(storage, rel: str, files: dict, name: str) -> bytes:
    """One file of a checkpoint, read once and hashed against its manifest entry (``files``: the manifest's);
    CheckpointDamaged if it does not match."""
    data = storage.read_bytes(f"{rel}/{name}")
    if hashlib.sha256(data).hexdigest() != files[name]["sha256"]:
        raise CheckpointDamaged(storage.uri(rel), f"sha256 mismatch in {name}")
    return data


MODEL_FILES = ("model.pt", "state.json", "config.json")  # what evaluation and export load


def load_verified(storage, rel: str, rank: int | None = 0, *, model_only: bool = False,
                  checked: Verification | None = None) -> LoadedCheckpoint:
    """Load a checkpoint whose manifest checks out (``checked``: its ``check_manifest``, if the caller has it),
    reading each file once and hashing it as read: CheckpointDamaged if one does not match.

    A restore reads every file the manifest lists, other ranks' RNG files too (small), so every rank comes
    to the same verdict on the same bytes; ``model_only`` reads only ``MODEL_FILES``."""
    v = checked if checked is not None else check_manifest(storage, rel, fmt=FORMAT)
    if not v.ok:
        raise CheckpointDamaged(storage.uri(rel), v.reason)
    files = v.manifest["files"]
    rng_name = f"rng/rank_{rank}.pt"
    used = {*MODEL_FILES, "optimizer.pt", "scheduler.pt", rng_name}
    data = {}
    for name in (MODEL_FILES if model_only else sorted(files)):
        content = read_verified(storage, rel, files, name)
        if name in used:
            data[name] = content

    def load(name: str):
        return load_torch_bytes(data[name], f"{storage.uri(rel)}/{name}")

    model = load("model.pt")
    state = json.loads(data["state.json"])
    config = json.loads(data["config.json"])
    created = v.manifest.get("created", 0.0)
    if model_only:
        return LoadedCheckpoint(storage.uri(rel), model, {}, {}, None, state, config, created)
    rng = load(rng_name) if rank is not None and rng_name in data else None
    return LoadedCheckpoint(storage.uri(rel), model, load("optimizer.pt"),
                            load("scheduler.pt") if "scheduler.pt" in data else {}, rng, state, config, created)


def load_newest(storage, rels: list[str], rank: int | None, warn=log.warning) -> LoadedCheckpoint | None:
    """The first of ``rels`` (newest first) that loads: one whose manifest does not check out, or whose
    files do not match it, is skipped with a warning. Storage errors propagate."""
    for rel in rels:
        try:
            return load_verified(storage, rel, rank)
        except CheckpointDamaged as exc:
            warn(f"skipping checkpoint {exc.uri}: {exc.reason}")
    return None


def committed_config(uri: str) -> tuple[str, dict]:
    """(URI, config) of a checkpoint URI, or of a run URI's newest committed checkpoint, reading only its
    manifest and config.json (checked against it): what the driver compares before a warm start."""
    storage, last = split_uri(uri)
    if not last.startswith(PREFIX):
        found = newest_committed_config(storage, last)
        if found is None:
            _no_checkpoint(uri, storage, last)
        return found
    found = _committed_config(storage, last)
    if found is None:
        if not storage.list_files(last):
            raise StorageError(f"{uri}: no such checkpoint; list them with `ray-app checkpoints list RUN_URI`")
        v = check_manifest(storage, last, fmt=FORMAT)
        reason = v.reason if not v.ok else "sha256 mismatch in config.json"
        raise CheckpointError(f"checkpoint {storage.uri(last)} failed verification: {reason}; "
                              "see `ray-app checkpoints verify`")
    return found


def _no_checkpoint(uri: str, storage, run: str) -> NoReturn:
    if list_checkpoints(storage, run):
        raise CheckpointError(f"{uri}: no checkpoint of this run passes verification; "
                              "see `ray-app checkpoints verify`")
    raise StorageError(f"{uri}: no checkpoints found; pass a run URI such as runs/NAME or s3://bucket/prefix/NAME")


def checkpoint_rels(uri: str) -> tuple[object, list[str]]:
    """(storage, rels newest first) of a checkpoint URI (one) or a run URI (its checkpoints)."""
    storage, last = split_uri(uri)
    if last.startswith(PREFIX):
        if not storage.list_files(last):
            raise StorageError(f"{uri}: no such checkpoint; list them with `ray-app checkpoints list RUN_URI`")
        return storage, [last]
    names = list_checkpoints(storage, last)
    if not names:
        _no_checkpoint(uri, storage, last)
    return storage, [f"{last}/{n}" for n in reversed(names)]


def resolve_checkpoint_uri(uri: str) -> tuple[object, str]:
    """A checkpoint URI, or a run URI (-> its newest checkpoint whose manifest checks out), as (storage, rel).
    No file but manifests is read: ``load_verified`` hashes what it loads."""
    storage, rels = checkpoint_rels(uri)
    if uri.rstrip("/").rsplit("/", 1)[-1].startswith(PREFIX):
        return storage, rels[0]
    for rel in rels:
        v = check_manifest(storage, rel, fmt=FORMAT)
        if v.ok:
            return storage, rel
        log.warning(f"skipping checkpoint {storage.uri(rel)}: {v.reason}")
    _no_checkpoint(uri, storage, rels[0].rsplit("/", 1)[0])


class Checkpointer:
    """The loop's handle on checkpoints: which one to start from, when to save, and what saving cost.

    It owns the cadence (``every_epochs``, ``every_steps``, the final one) and the
    account of time training was blocked (``blocked_seconds``, ``written``): the loop
    asks ``step_due`` / ``epoch_due`` / ``final_due`` and calls ``save`` on every rank, with
    the name the writer rank took from ``new_name`` (every rank reports that one name).
    ``report(metrics, local_dir, dir_name, upload_fn)`` is supplied by the runtime
    (Ray Train's ``ray.train.report`` in production).

    With ``staged=True`` (``checkpoint.upload: async``) the writer rank only takes a
    :class:`Snapshot`; writing the files, hashing them and uploading happen in
    ``upload_fn``, which Ray Train runs on its background upload thread. One
    checkpoint is in flight at a time: a new one waits for the previous upload, so
    at most one extra copy of the state is held in memory.
    """

    def __init__(self, storage, run: str, report, *, every_epochs: int = 1, every_steps: int = 0,
                 resume_from: str = "", warn=log.warning, staged: bool = False):
        self.storage, self.run, self._report, self.resume_from, self.warn = storage, run, report, resume_from, warn
        self.every_epochs, self.every_steps, self.staged = every_epochs, every_steps, staged
        self.last_uri: str | None = None
        self.warm_start = False  # the restored checkpoint came from run.resume_from, not from this run
        self.blocked_seconds, self.written = 0.0, 0
        self._snapshot: Snapshot | None = None
        self._pending_blocked: float | None = None
        self._uploaded: threading.Event | None = None
        self.on_commit = None  # called with (uri, global_step) once a checkpoint is committed (rank 0's trackers)

    # ------------------------------------------------------------ cadence
    def step_due(self, pos, batches_per_epoch: int) -> bool:
        """Mid-epoch checkpoints every ``every_steps`` optimizer steps (epoch ends have their own)."""
        return bool(self.every_steps) and pos.global_step % self.every_steps == 0 and pos.batches_done < batches_per_epoch

    def epoch_due(self, epochs_done: int, total_epochs: int) -> bool:
        """Every ``every_epochs`` epochs; the last epoch is left to the final checkpoint."""
        return bool(self.every_epochs) and epochs_done % self.every_epochs == 0 and epochs_done < total_epochs

    def final_due(self, global_step: int, resumed_from_step: int) -> bool:
        """The run ends on a checkpoint unless checkpoints are off or this start trained nothing new."""
        trained = global_step > resumed_from_step or self.last_uri is None
        return trained and bool(self.every_epochs or self.every_steps)

    # ------------------------------------------------------------ restore
    def restore(self, rank: int) -> LoadedCheckpoint | None:
        """The newest checkpoint of this run that loads (broken newer ones skipped with a warning), else
        run.resume_from's (a warm start), else None for a fresh start. Each file is read once."""
        rels = [f"{self.run}/{name}" for name in reversed(list_checkpoints(self.storage, self.run))]
        loaded = load_newest(self.storage, rels, rank, self.warn)
        if loaded is None and self.resume_from:
            self.warm_start = True
            storage, rels = checkpoint_rels(self.resume_from)
            loaded = load_newest(storage, rels, rank, self.warn)
            if loaded is None:
                raise CheckpointError(f"run.resume_from {self.resume_from}: no checkpoint passes verification; "
                                      "see `ray-app checkpoints verify`")
        if loaded is not None:
            self.last_uri = loaded.uri
        return loaded

    # ------------------------------------------------------------ save
    @staticmethod
    def new_name(global_step: int) -> str:
        """A new checkpoint's directory name (unique: time and random bytes). Each rank gets a different
        one, so the loop takes the writer's and passes it to ``save`` on every rank."""
        return checkpoint_dir_name(global_step)

    def save(self, payload: CheckpointPayload | None, metrics: dict, is_writer: bool,
             param_keys: frozenset[str] = frozenset(), name: str | None = None) -> float | None:
        """Write or stage (on the writer rank) and report a checkpoint.

        ``name``: the writer's :meth:`new_name`, the same on every rank (None: a new one, for a single
        process). Returns the seconds training was blocked, or None while a staged snapshot is still copying
        (``param_keys``: the state-dict keys only an optimizer step changes, which staged mode copies in
        the background; call :meth:`settle` before the next optimizer step, it returns the total then).
        """
        t0 = time.perf_counter()
        name = name or self.new_name(metrics["global_step"])
        local, snapshot, uploaded = None, None, None
        if is_writer:
            if self._uploaded is not None:
                self._uploaded.wait()  # back-pressure: the previous upload is still running
            local = Path(tempfile.mkdtemp(prefix="ray-app-ckpt-"))
            if self.staged:
                snapshot = self._snapshot = Snapshot(payload, param_keys)
                uploaded = self._uploaded = threading.Event()
            else:
                write_checkpoint_dir(local, payload)
        self.last_uri = self.storage.uri(self.run, name)  # every rank: the name is the writer's
        metrics = dict(metrics, checkpoint=self.last_uri)

        def upload(local_dir: Path, dir_name: str) -> None:
            try:
                if snapshot is not None:
                    write_checkpoint_dir(local_dir, snapshot.payload())
                upload_checkpoint_dir(local_dir, self.storage, f"{self.run}/{dir_name}")
                if self.on_commit is not None:
                    self.on_commit(self.storage.uri(self.run, dir_name), metrics["global_step"])
            finally:
                if uploaded is not None:
                    uploaded.set()

        self._report(metrics, local, name, upload)
        self._pending_blocked = time.perf_counter() - t0
        return None if self.staged else self.settle()

    def wait_committed(self) -> None:
        """Until the newest checkpoint's upload has ended (a staged one uploads in the background)."""
        if self._uploaded is not None:
            self._uploaded.wait()

    def settle(self) -> float | None:
        """Wait until a staged snapshot no longer needs the live state; account the checkpoint.

        Returns the seconds the last checkpoint blocked training in all, or None if none is pending."""
        if self._pending_blocked is None:
            return None
        snapshot, self._snapshot = self._snapshot, None
        blocked = self._pending_blocked + (snapshot.wait() if snapshot is not None else 0.0)
        self._pending_blocked = None
        self.blocked_seconds += blocked
        self.written += 1
        return blocked


def cleanup_local(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
