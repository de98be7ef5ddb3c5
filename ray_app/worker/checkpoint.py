"""Writing and loading a checkpoint's tensors: the worker's part of its life (the whole life, and the one
rule that chooses which checkpoint is used: ``ray_app.shared.catalog``).

The loop's checkpoints are written by every rank (``Checkpointer.save_shards`` and ``ray_app.worker.sharded``:
format ``ray_app.checkpoint/2``, DCP), under ``{run.storage}/{run.name}/ckpt-s{step}-{stamp}/``: the model and
optimizer state keyed by parameter name (``model/``, ``optim/``), each rank's RNG, and rank 0's small files
(``CheckpointFiles``: the LR schedule, ``state.json``, ``config.json``, ``metrics.json``); ``manifest.json``
is written last, once every rank's share is uploaded, after the lease's fence. A write that fails removes
its folder. The earlier single-file format (``ray_app.checkpoint/1``: rank 0's ``model.pt``,
``optimizer.pt``, ``scheduler.pt``, ``rng/rank_{r}.pt``, the JSON files) is no longer written and still
loads, under either strategy. Older checkpoints also hold ``scaler.pt`` (a GradScaler that was never
enabled), verified and not loaded.

``load`` reads a checkpoint the catalog chose (it verified: every file matches its manifest) from the
bytes the verification kept; ``torch.load(..., weights_only=True)`` only.

A ``ray-app run`` script's checkpoints (``ray_app.script.save``) live the same way under their run: one
``state.pt`` and a manifest of format ``SCRIPT_FORMAT``; the loop never loads them, nor the script the loop's.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ray_app.shared import catalog
from ray_app.shared.catalog import MANIFEST, SHARDED_FORMAT, TrainState, checkpoint_dir_name, sha256_file
from ray_app.shared.errors import CheckpointDamaged, CheckpointError, first_line

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
class CheckpointFiles:
    """Rank 0's small files of a checkpoint, beside every rank's share of the model and optimizer: the LR
    schedule, ``state.json`` (``TrainState``: where training is), the config and the metrics."""

    scheduler: dict
    state: TrainState
    config: dict
    metrics: dict

    def write(self, local: Path) -> None:
        torch.save(self.scheduler, local / "scheduler.pt")
        for name, obj in (("state.json", self.state.state_dict()), ("config.json", self.config),
                          ("metrics.json", self.metrics)):
            (local / name).write_text(json.dumps(obj, indent=1, sort_keys=True))


def write_manifest(path: Path, *, global_step: int, epoch: int | None, fmt: str) -> dict:
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
    ``before_commit()`` (the lease's fence: it raises when another driver holds the run). An upload that
    fails, or a fence that refuses, leaves no folder behind."""
    with removed_unless_committed(storage, rel):
        for f in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST):
            storage.upload_file(str(f), f"{rel}/{f.relative_to(local).as_posix()}")
        if before_commit is not None:
            before_commit()
        storage.upload_file(str(local / MANIFEST), f"{rel}/{MANIFEST}")


@contextlib.contextmanager
def removed_unless_committed(storage, rel: str):
    """Around a checkpoint's write: on any error its folder in storage goes (``catalog.remove_uncommitted``)."""
    try:
        yield
    except BaseException:
        catalog.remove_uncommitted(storage, rel)
        raise


# ---------------------------------------------------------------- loading

@dataclass
class LoadedCheckpoint:
    uri: str
    model: dict
    optimizer: dict
    scheduler: dict
    rng: dict | None
    state_json: bytes  # read through ``train_state`` only (``TrainState``: the schema of state.json)
    config: dict
    created: float = 0.0  # unix time the checkpoint was written (from its manifest)
    sharded: object = None  # a sharded checkpoint's ``ray_app.worker.sharded.ShardedRef``: model and optimizer not yet read

    def train_state(self, batch_size: int = 0, world_size: int = 1) -> TrainState:
        """Where the checkpoint's training was (``batch_size``, ``world_size``: this run's, for older ones)."""
        return TrainState.from_json(self.state_json, batch_size, world_size)

    @property
    def global_step(self) -> int:
        return self.train_state().pos.global_step

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
            getattr(model, "module", model).load_state_dict(self.model, strict=not strategy.is_lora(model))
            if optimizer is not None:
                optimizer.load_state_dict(self.optimizer)


def load_torch_bytes(data: bytes, where: str = "checkpoint file"):
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # e.g. a pickled object weights_only refuses: bad input, not a crash
        first = first_line(exc)
        raise CheckpointError(f"{where} cannot be loaded with torch.load(weights_only=True) "
                              f"({type(exc).__name__}: {first}); it is not a plain ray_app checkpoint") from None


MODEL_FILES = ("model.pt", "state.json", "config.json")  # what evaluation and export load of a single-file one


def needed(rank: int | None, model_only: bool = False):
    """Which verified files a load keeps the bytes of (``catalog.verify``'s ``keep``): the model (and, unless
    ``model_only``, the optimizer, the LR schedule and this rank's RNG), ``state.json`` and the config."""
    own = {*MODEL_FILES, "scheduler.pt", "optimizer.pt", f"rng/rank_{rank}.pt"}

    def keep(name: str) -> bool:
        if name.startswith("model/") or name in MODEL_FILES:
            return True
        return not model_only and (name in own or name.startswith("optim/"))

    return keep


def load(found: catalog.Found, rank: int | None = 0, *, model_only: bool = False) -> LoadedCheckpoint:
    """A checkpoint the catalog chose (it verified: ``catalog.good`` / ``choose``), its files taken from the
    bytes the verification kept (read again, hashed, only if it kept none). ``model_only``: the model,
    ``state.json`` and the config (evaluation and export)."""
    where, manifest = found.uri, found.manifest
    created = manifest.get("created", 0.0)
    state, config = found.read("state.json"), found.json("config.json")
    if manifest["format"] == SHARDED_FORMAT:
        from ray_app.worker.sharded import ShardedRef

        ref = ShardedRef(found.storage, found.rel, manifest["files"], found.verification.contents)
        if model_only:
            return LoadedCheckpoint(where, ref.consolidate_model(), {}, {}, None, state, config, created)
        scheduler = load_torch_bytes(found.read("scheduler.pt"), f"{where}/scheduler.pt") \
            if "scheduler.pt" in manifest["files"] else {}
        return LoadedCheckpoint(where, None, None, scheduler, _rng(found, rank), state, config, created, sharded=ref)
    model = load_torch_bytes(found.read("model.pt"), f"{where}/model.pt")
    if model_only:
        return LoadedCheckpoint(where, model, {}, {}, None, state, config, created)
    files = manifest["files"]
    return LoadedCheckpoint(where, model, load_torch_bytes(found.read("optimizer.pt"), f"{where}/optimizer.pt"),
                            load_torch_bytes(found.read("scheduler.pt"), f"{where}/scheduler.pt")
                            if "scheduler.pt" in files else {}, _rng(found, rank), state, config, created)


def _rng(found: catalog.Found, rank: int | None) -> dict | None:
    name = f"rng/rank_{rank}.pt"
    if rank is None or name not in found.manifest["files"]:
        return None  # a rank the checkpoint's world did not have
    return load_torch_bytes(found.read(name), f"{found.uri}/{name}")


def load_uri(uri: str, rank: int | None = None, *, model_only: bool = False, retry_s: float = 0.0,
             then: str | None = None, say=None, said: set | None = None) -> LoadedCheckpoint:
    """The checkpoint a URI names, or a run URI's newest that verifies (``catalog.choose``), loaded:
    ``ray-app eval``, ``checkpoints export`` and a warm start."""
    found = catalog.choose(uri, keep=needed(rank, model_only), retry_s=retry_s, then=then, say=say, said=said)
    return load(found, rank, model_only=model_only)


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
                 resume_from: str = "", warn=None, staged: bool = False, retry_s: float = 0.0,
                 wait_s: float = 300.0, writer: str = "thread", said=()):
        self.storage, self.run, self._report, self.resume_from, self.warn = storage, run, report, resume_from, warn
        self.said = set(said)  # the checkpoints already said to be skipped (by the driver): not said again
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
        """The newest checkpoint of this run that verifies (``catalog.good``: damaged or uncommitted newer ones
        skipped, each said once), else run.resume_from's (a warm start), else None for a fresh start. Each
        file is read once: verified, and loaded from the bytes the verification kept.

        ``put_back(loaded)`` loads its state into the model (every rank, at the same point); one that fails
        there as damaged (changed since it verified) is skipped for the next older one too (every rank gets
        the same verdict: DCP gathers each rank's failure)."""
        put_back = put_back or (lambda loaded: None)
        for found in catalog.good(self.storage, self.run, keep=needed(rank), say=self.warn, said=self.said):
            try:
                loaded = load(found, rank)
                put_back(loaded)
            except CheckpointDamaged as exc:
                self.said.add(found.name)
                if self.warn is not None:
                    self.warn(f"ray-app: skipped {exc.uri}: {exc.reason}")
                continue
            self.last_uri = loaded.uri
            return loaded
        if not self.resume_from:
            return None
        self.warm_start = True
        try:
            loaded = load_uri(self.resume_from, rank, retry_s=self.retry_s, say=self.warn, said=self.said)
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

    def save_shards(self, model: torch.nn.Module, optimizer, files: CheckpointFiles | None, rng: dict, metrics: dict,
                    *, rank: int, world_size: int, name: str) -> float:
        """Every rank, at the same point: write this rank's share of a sharded checkpoint (``ray_app.worker.sharded``)
        and report it; rank 0 (``files``: its small files) commits it once every rank's share is uploaded.
        Staged (``checkpoint.upload: async``): the state is copied (the time training is blocked: this rank's
        share), then written and uploaded on a background thread over a gloo group of its own. A write, an
        upload or a commit that fails removes the checkpoint's folder (and the local staging) before it raises.
        Returns the seconds training was blocked."""
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
        try:
            (local / "rng").mkdir()
            torch.save(rng, local / "rng" / f"rank_{rank}.pt")
            if files is not None:
                files.write(local)
        except BaseException:
            cleanup_local(local)
            raise
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
                    with removed_unless_committed(self.storage, rel):
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
                with removed_unless_committed(self.storage, rel):
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
            epoch = files.state.pos.epoch if files is not None else 0

            def commit(local_dir: Path, dir_name: str) -> None:
                try:
                    with removed_unless_committed(self.storage, f"{self.run}/{dir_name}"):
                        sharded.commit(self.storage, f"{self.run}/{dir_name}", world_size,
                                       global_step=metrics["global_step"], epoch=epoch, wait_s=self.wait_s, before_commit=self.before_commit, local=local_dir)
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
