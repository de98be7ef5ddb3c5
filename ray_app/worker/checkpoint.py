"""What a checkpoint holds, and how it is written, verified, chosen and loaded.

The loop's checkpoints are written by every rank (``ray_app.worker.sharded``: format ``ray_app.checkpoint/2``,
DCP), under ``{run.storage}/{run.name}/ckpt-s{step}-{stamp}/``: the model and optimizer state keyed by
parameter name (``model/``, ``optim/``), each rank's RNG, the LR schedule, ``state.json`` (position in
training), ``config.json``, ``metrics.json``, and ``manifest.json`` written last, once every rank's share is
uploaded. The earlier single-file format (``ray_app.checkpoint/1``: rank 0's ``model.pt``, ``optimizer.pt``,
``scheduler.pt``, ``rng/rank_{r}.pt``, the JSON files; ``write_checkpoint_dir``) still loads, under either
strategy. Older checkpoints also hold ``scaler.pt`` (a GradScaler that was never enabled), verified and not
loaded.

A checkpoint whose manifest is missing or does not match is never loaded; every file is checked against
its sha256 as it is read. Loading uses ``torch.load(..., weights_only=True)`` only.

A ``ray-app run`` script's checkpoints (``ray_app.script.save``) live the same way under their run: one
``state.pt`` and a manifest of format ``SCRIPT_FORMAT``; the loop never loads them, nor the script the loop's.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ray_app.shared import catalog
from ray_app.shared.catalog import (
    FORMAT,
    MANIFEST,
    SHARDED_FORMAT,
    SINGLE_FILE_FORMAT,
    Verification,
    check_manifest,
    checkpoint_dir_name,
    read_verified,
    sha256_file,
)
from ray_app.shared.errors import CheckpointDamaged, CheckpointError, first_line

log = logging.getLogger("ray_app.worker.checkpoint")


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
    """Everything needed to continue training exactly, in the single-file format (rank 0 wrote it all). The kit
    now writes sharded checkpoints (``Checkpointer.save_shards``); this format's writer stays as its
    reference, for checkpoints of it that still load and for the tests that make them."""

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


def write_manifest(path: Path, *, global_step: int, epoch: int | None, fmt: str = SINGLE_FILE_FORMAT) -> dict:
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


def upload_checkpoint_dir(local: Path, storage, rel: str, before_commit=None) -> None:
    """Copy a written checkpoint to storage: data files first, the manifest last (the commit), after
    ``before_commit()`` (the lease's fence: it raises when another driver holds the run)."""
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST)
    for f in files:
        storage.upload_file(str(f), f"{rel}/{f.relative_to(local).as_posix()}")
    if before_commit is not None:
        before_commit()
    storage.upload_file(str(local / MANIFEST), f"{rel}/{MANIFEST}")


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
    sharded: object = None  # a sharded checkpoint's ``ray_app.worker.sharded.ShardedRef``: model and optimizer not yet read

    def load_into(self, model: torch.nn.Module, optimizer=None) -> None:
        """The model's (and the optimizer's) state into a model of either strategy at any world size: a sharded
        checkpoint through DCP (every rank calls this), a single-file one from its whole state."""
        from ray_app.worker import strategy

        if self.sharded is not None:
            self.sharded.load_into(model, optimizer)
        elif strategy.is_sharded(model):
            strategy.load_model_state(model, self.model, full=True)
            if optimizer is not None:
                strategy.load_full_optimizer_state(model, optimizer, self.optimizer)
        else:
            getattr(model, "module", model).load_state_dict(self.model)
            if optimizer is not None:
                optimizer.load_state_dict(self.optimizer)


def load_torch_bytes(data: bytes, where: str = "checkpoint file"):
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # e.g. a pickled object weights_only refuses: bad input, not a crash
        first = first_line(exc)
        raise CheckpointError(f"{where} cannot be loaded with torch.load(weights_only=True) "
                              f"({type(exc).__name__}: {first}); it is not a plain ray_app checkpoint") from None


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
    if v.manifest["format"] == SHARDED_FORMAT:
        return _load_sharded(storage, rel, v.manifest, rank, model_only)
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


def _load_sharded(storage, rel: str, manifest: dict, rank: int | None, model_only: bool) -> LoadedCheckpoint:
    """A sharded checkpoint's small files, read and verified; its model and optimizer are read by ``load_into``
    (resharded, every rank its share), or with ``model_only`` consolidated here, in this process alone."""
    from ray_app.worker.sharded import ShardedRef

    files = manifest["files"]
    ref = ShardedRef(storage, rel, files)

    def small(name: str):
        return read_verified(storage, rel, files, name) if name in files else None

    state, config = json.loads(small("state.json")), json.loads(small("config.json"))
    created = manifest.get("created", 0.0)
    if model_only:
        return LoadedCheckpoint(storage.uri(rel), ref.consolidate_model(), {}, {}, None, state, config, created)
    where = storage.uri(rel)
    scheduler, rng = small("scheduler.pt"), small(f"rng/rank_{rank}.pt") if rank is not None else None
    return LoadedCheckpoint(where, None, None, load_torch_bytes(scheduler, f"{where}/scheduler.pt") if scheduler else {},
                            load_torch_bytes(rng, f"{where}/rng/rank_{rank}.pt") if rng else None, state, config,
                            created, sharded=ref)


def load_newest(storage, run: str, rank: int | None, warn=log.warning, *,
                model_only: bool = False) -> LoadedCheckpoint | None:
    """The newest checkpoint of ``run`` that loads (``ray_app.shared.catalog.find``): one whose manifest does not
    check out, or whose files do not match it, is skipped with a warning. Storage errors propagate."""
    for found in catalog.find(storage, run, check=catalog.MANIFEST_OK, warn=warn):
        try:
            return load_verified(storage, found.rel, rank, model_only=model_only, checked=found.verification)
        except CheckpointDamaged as exc:
            warn(f"skipping checkpoint {exc.uri}: {exc.reason}")
    return None


def resolve_checkpoint_uri(uri: str, retry_s: float = 0.0) -> tuple[object, str]:
    """A checkpoint URI, or a run URI (-> its newest checkpoint whose manifest checks out), as (storage, rel)
    (``ray_app.shared.catalog``). No file but manifests is read: ``load_verified`` hashes what it loads."""
    found = catalog.named_or_newest(uri, check=catalog.MANIFEST_OK, retry_s=retry_s, warn=log.warning)
    return found.storage, found.rel


def load_named_or_newest(uri: str, rank: int | None, *, model_only: bool = False, retry_s: float = 0.0,
                         then: str | None = None, warn=log.warning) -> LoadedCheckpoint:
    """The checkpoint a URI names (one whose files do not match its manifest: ``CheckpointError``), or the
    newest of a run URI that loads (damaged newer ones skipped with ``warn``): ``ray-app eval`` and export."""
    storage, run, name = catalog.locate(uri, retry_s, then)
    if name is not None:
        found = catalog.named_or_newest(uri, check=catalog.MANIFEST_OK, retry_s=retry_s, then=then)
        return load_verified(found.storage, found.rel, rank, model_only=model_only, checked=found.verification)
    loaded = load_newest(storage, run, rank, warn, model_only=model_only)
    if loaded is None:
        catalog.no_checkpoint(uri, storage, run)
    return loaded


class Checkpointer:
    """The loop's handle on checkpoints: which one to start from, when to save, and what saving cost.

    It owns the cadence (``every_epochs``, ``every_steps``, the final one) and the
    account of time training was blocked (``blocked_seconds``, ``written``): the loop
    asks ``due`` at every step boundary (``final_due`` at the end) and calls ``save_shards`` on every rank,
    with the name rank 0 took from ``new_name`` (every rank reports that one name).
    ``report(metrics, local_dir, dir_name, upload_fn)`` is supplied by the runtime
    (Ray Train's ``ray.train.report`` in production).

    With ``staged=True`` (``checkpoint.upload: async``) a rank only copies its share (``writer``: into
    its own memory for a thread, into shared memory for DCP's checkpoint process); writing, hashing and
    uploading happen in the background, and rank 0 commits in ``upload_fn``, which Ray Train runs on its
    background upload thread. One checkpoint is in flight at a time: a new one waits for the previous
    share and commit, so at most one extra copy of a rank's share is held in memory.
    """

    def __init__(self, storage, run: str, report, *, every_epochs: int = 1, every_steps: int = 0,
                 resume_from: str = "", warn=log.warning, staged: bool = False, retry_s: float = 0.0,
                 wait_s: float = 300.0, writer: str = "thread"):
        self.storage, self.run, self._report, self.resume_from, self.warn = storage, run, report, resume_from, warn
        self.retry_s = retry_s  # the budget of run.resume_from's storage (failure.storage_retry_s)
        self.every_epochs, self.every_steps, self.staged = every_epochs, every_steps, staged
        self.last_uri: str | None = None
        self.warm_start = False  # the restored checkpoint came from run.resume_from, not from this run
        self.blocked_seconds, self.written = 0.0, 0
        self._uploaded: threading.Event | None = None
        self.on_commit = None  # called with (uri, global_step) once a checkpoint is committed (rank 0's trackers)
        self.before_commit = None  # called before each manifest is written (the lease's fence: one writer per run)
        self.batches_per_epoch, self.epochs, self.max_steps = float("inf"), 1 << 62, 0  # until plan()
        self.wait_s = wait_s  # how long rank 0 waits for the other ranks' shares before it commits
        self._share: threading.Thread | None = None  # this rank's staged share, writing and uploading
        self._share_error: BaseException | None = None
        self._group = None
        self.writer = writer  # staged shares: written on a thread, or by DCP's checkpoint process
        self._stager = None  # the process writer's shared-memory buffers

    # ------------------------------------------------------------ cadence
    def plan(self, *, batches_per_epoch: int, epochs: int, max_steps: int = 0) -> None:
        """What the run will train (the loop says it once): where epochs end, how many, train.max_steps."""
        self.batches_per_epoch, self.epochs, self.max_steps = batches_per_epoch, epochs, max_steps

    def due(self, pos, *, epoch_end: bool = False) -> bool:
        """Whether to checkpoint at this step boundary (``epoch_end``: the one after an epoch's evaluation;
        ``pos.epoch`` already counts it). Every ``every_steps`` optimizer steps inside an epoch, every
        ``every_epochs`` epochs at their end; never the run's last boundary (all epochs done, or
        train.max_steps reached): that is the final checkpoint's (``final_due``)."""
        if self.max_steps and pos.global_step >= self.max_steps:
            return False
        if epoch_end:
            return bool(self.every_epochs) and pos.epoch % self.every_epochs == 0 and pos.epoch < self.epochs
        return bool(self.every_steps) and pos.global_step % self.every_steps == 0 and \
            pos.batches_done < self.batches_per_epoch

    def final_due(self, global_step: int, resumed_from_step: int) -> bool:
        """The run ends on a checkpoint unless checkpoints are off or this start trained nothing new."""
        trained = global_step > resumed_from_step or self.last_uri is None
        return trained and bool(self.every_epochs or self.every_steps)

    # ------------------------------------------------------------ restore
    def restore(self, rank: int, put_back=None) -> LoadedCheckpoint | None:
        """The newest checkpoint of this run that loads (broken newer ones skipped with a warning), else
        run.resume_from's (a warm start), else None for a fresh start. Each file is read once.

        ``put_back(loaded)`` loads its state into the model (every rank, at the same point): a sharded
        checkpoint's shares are read, and found damaged, only there, so a damaged one is skipped for the
        next older one after it too (every rank gets the same verdict: DCP gathers each rank's failure)."""
        put_back = put_back or (lambda loaded: None)
        for found in catalog.find(self.storage, self.run, check=catalog.MANIFEST_OK, warn=self.warn):
            try:
                loaded = load_verified(self.storage, found.rel, rank, checked=found.verification)
                put_back(loaded)
            except CheckpointDamaged as exc:
                self.warn(f"skipping checkpoint {exc.uri}: {exc.reason}")
                continue
            self.last_uri = loaded.uri
            return loaded
        if not self.resume_from:
            return None
        self.warm_start = True
        try:
            loaded = load_named_or_newest(self.resume_from, rank, retry_s=self.retry_s, warn=self.warn)
            put_back(loaded)
        except CheckpointError as exc:
            raise CheckpointError(f"run.resume_from {self.resume_from}: {exc}") from None
        self.last_uri = loaded.uri
        return loaded

    # ------------------------------------------------------------ save
    @staticmethod
    def new_name(global_step: int) -> str:
        """A new checkpoint's directory name (unique: time and random bytes). Each rank gets a different
        one, so the loop takes rank 0's and passes it to ``save_shards`` on every rank."""
        return checkpoint_dir_name(global_step)

    def save_shards(self, model: torch.nn.Module, optimizer, shared: dict | None, rng: dict, metrics: dict, *,
                    rank: int, world_size: int, name: str) -> float:
        """Every rank, at the same point: write this rank's share of a sharded checkpoint (``ray_app.worker.sharded``)
        and report it; rank 0 (``shared``: its files by name, ``scheduler.pt``, ``state.json``, ...) commits it
        once every rank's share is uploaded. Staged (``checkpoint.upload: async``): the state is copied (the
        time training is blocked: this rank's share), then written and uploaded on a background thread over a
        gloo group of its own. Returns the seconds training was blocked."""
        from ray_app.worker import sharded
        from ray_app.worker.strategy import sync_buffers, train_state

        t0 = time.perf_counter()
        self._join_share()  # back-pressure: this rank's previous share is uploaded
        rel = f"{self.run}/{name}"
        sync_buffers(model)  # rank 0's BatchNorm statistics, whichever rank writes them
        model_sd, optim_sd = sharded.own_share(*train_state(model, optimizer), rank, world_size)
        if self.staged and self.writer == "process" and self._stager is None:  # before anything is made
            sharded.check_shared_memory(sharded.share_bytes(model_sd, optim_sd), rank)
            self._stager = sharded.shared_memory_stager()
        local = Path(tempfile.mkdtemp(prefix="ray-app-ckpt-"))
        (local / "rng").mkdir()
        torch.save(rng, local / "rng" / f"rank_{rank}.pt")
        for fname, obj in (shared or {}).items():
            if fname.endswith(".json"):
                (local / fname).write_text(json.dumps(obj, indent=1, sort_keys=True))
            else:
                torch.save(obj, local / fname)
        if self.staged:
            group = self._share_group()
            if self.writer == "process":
                staged = self._stager.stage({"model": model_sd, "optim": optim_sd})
                write = lambda: sharded.write_state_in_process(local, staged, group)  # noqa: E731
            else:
                model_sd, optim_sd = _cpu_copy(model_sd), _cpu_copy(optim_sd)
                write = lambda: sharded.write_state(local, model_sd, optim_sd, group)  # noqa: E731

            def share() -> None:
                try:
                    write()
                    sharded.upload_share(local, self.storage, rel, rank)
                except BaseException as exc:  # raised on the training thread at the next checkpoint or the end
                    self._share_error = exc
                finally:
                    cleanup_local(local)

            self._share = threading.Thread(target=share, name="ray-app-ckpt-share", daemon=True)
            self._share.start()
        else:
            try:
                sharded.write_state(local, model_sd, optim_sd)
                sharded.upload_share(local, self.storage, rel, rank)
            finally:
                cleanup_local(local)
        self.last_uri = self.storage.uri(self.run, name)
        metrics = dict(metrics, checkpoint=self.last_uri)
        if rank != 0:
            self._report(metrics, None, name, None)
        else:
            if self._uploaded is not None:
                self._uploaded.wait()  # one commit in flight at a time
            uploaded = self._uploaded = threading.Event()
            epoch = (shared or {}).get("state.json", {}).get("epoch", 0)

            def commit(local_dir: Path, dir_name: str) -> None:
                try:
                    sharded.commit(self.storage, f"{self.run}/{dir_name}", world_size, global_step=metrics["global_step"],
                                   epoch=epoch, wait_s=self.wait_s, before_commit=self.before_commit, local=local_dir)
                    if self.on_commit is not None:
                        self.on_commit(self.storage.uri(self.run, dir_name), metrics["global_step"])
                finally:
                    uploaded.set()

            self._report(metrics, Path(tempfile.mkdtemp(prefix="ray-app-commit-")), name, commit)
        blocked = time.perf_counter() - t0
        self.blocked_seconds += blocked
        self.written += 1
        return blocked

    def _share_group(self):
        """A gloo group of the staged shares' own (made once, by every rank at the same checkpoint): their DCP
        planning runs on a background thread, never on the group training uses."""
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def _join_share(self) -> None:
        if self._share is not None:
            self._share.join()
            self._share = None
        if self._share_error is not None:
            exc, self._share_error = self._share_error, None
            raise exc

    def wait_committed(self) -> None:
        """Until the newest checkpoint's upload has ended (a staged one uploads in the background)."""
        self._join_share()
        if self._uploaded is not None:
            self._uploaded.wait()


def cleanup_local(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
