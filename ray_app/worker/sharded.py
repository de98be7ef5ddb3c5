"""Checkpoints every rank writes (``torch.distributed.checkpoint``, DCP), their commit, and loading them.

Layout of one sharded checkpoint (format ``ray_app.checkpoint/2``), under ``{run.storage}/{run.name}/``::

    model/.metadata  model/__{r}_0.distcp        the model state, keyed by parameter name (DCP)
    optim/.metadata  optim/__{r}_0.distcp        the optimizer state, keyed by parameter name (DCP)
    rng/rank_{r}.pt                             each rank's RNG, written by that rank
    scheduler.pt  state.json  config.json  metrics.json      written by rank 0
    parts/rank_{r}.json                         each rank's files with their sha256 and size: its share, done
    manifest.json                               every rank's files, written last by rank 0: the commit

Each rank writes its share: under FSDP its shards, under DDP a part of the replicated state (DCP's planner
writes each replicated tensor once, spread over the ranks), so no rank gathers the whole state and a
checkpoint's blocked time falls as workers are added. A rank uploads its files, then its ``parts`` file;
rank 0 writes the manifest once every rank's ``parts`` file is there (through storage, not a collective:
it also works from a background upload). Nothing is loaded without a complete, matching manifest: every
file a load reads is checked against its sha256 as it arrives.

Loading reshards: DCP reads what each rank's state asks for, at any world size and under either strategy
(``ray_app.worker.strategy``: state keyed by parameter name). ``consolidate_model`` reads the model alone, with no
process group: ``ray-app checkpoints export`` and evaluation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ray_app.shared.catalog import MANIFEST, SHARDED_FORMAT, read_verified, sha256_file
from ray_app.shared.errors import CheckpointError, StorageError, first_line

PARTS = "parts"


# ---------------------------------------------------------------- writing one rank's share

def own_share(model_sd: dict, optim_sd: dict, rank: int, world_size: int) -> tuple[dict, dict]:
    """What this rank writes: every DTensor (its shard), and of the tensors every rank holds whole (DDP's
    replicated state) those of the parameters dealt to it: the parameters sorted by size, each to the rank with
    the fewest bytes so far (the same deal on every rank). Staged, a rank copies only this."""
    sizes = {k: v.numel() * v.element_size() for k, v in model_sd.items()
             if isinstance(v, torch.Tensor) and not _is_dtensor(v)}
    sizes.update({k: sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
                  + sizes.get(k, 0) for k, s in optim_sd.get("state", {}).items()
                  if not any(_is_dtensor(t) for t in s.values())})
    load, mine = [0] * world_size, set()
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += sizes[key]
        if r == rank:
            mine.add(key)
    model = {k: v for k, v in model_sd.items() if k not in sizes or k in mine}
    optim = {"state": {k: s for k, s in optim_sd.get("state", {}).items() if k not in sizes or k in mine},
             "param_groups": optim_sd.get("param_groups", [])}
    return model, optim


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local")


def write_state(local: Path, model_sd: dict, optim_sd: dict, group=None) -> None:
    """This rank's share of the model and optimizer state into ``local/model`` and ``local/optim`` (every rank
    calls this at the same point: DCP plans the save over ``group``, the default one when None)."""
    from torch.distributed.checkpoint.api import CheckpointException

    for name, sd in (("model", model_sd), ("optim", optim_sd)):
        try:
            dcp.save(sd, storage_writer=FileSystemWriter(local / name, sync_files=False), process_group=group)
        except CheckpointException as exc:  # DCP's BaseException: a local write failed (a full disk, most likely)
            inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
            why = f"{type(inner[0]).__name__}: {first_line(inner[0])}" if inner else first_line(exc)
            raise StorageError(f"{local}: writing this rank's share of a checkpoint failed ({why}); free space in "
                               "the temp folder (TMPDIR) of the workers; the same run then resumes from its newest "
                               "committed checkpoint") from None


class _AsStaged:
    """An ``AsyncStager`` that hands DCP the state as it is: the kit staged it already, on the training thread."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class _QuietWriter(FileSystemWriter):
    """The ``FileSystemWriter`` sent to DCP's checkpoint process. That process sets its root logger to INFO and
    logs four lines at each save (eight a checkpoint, per rank); unpickled there, this writer sets that
    process's root logger back to WARNING, so only its start-up lines reach the run's output."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        logging.getLogger().setLevel(logging.WARNING)


def share_bytes(*state_dicts: dict) -> int:
    """Bytes of the tensors a rank holds in these state dicts (a DTensor: its local shard)."""
    def walk(obj) -> int:
        if isinstance(obj, torch.Tensor):
            t = obj.to_local() if _is_dtensor(obj) else obj
            return t.numel() * t.element_size()
        if isinstance(obj, dict):
            return sum(walk(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v) for v in obj)
        return 0

    return sum(walk(sd) for sd in state_dicts)


SHM = "/dev/shm"


def check_shared_memory(need: int, rank: int, shm: str = SHM) -> None:
    """Refuse, before any buffer is made, a share that does not fit in ``shm``: a tmpfs that fills while a
    buffer is written kills the process with SIGBUS (a container's default /dev/shm is 64 MiB)."""
    import os

    from ray_app.shared.errors import ConfigError

    try:
        st = os.statvfs(shm)
    except OSError:
        return  # no /dev/shm to check: torch reports what it cannot map
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise ConfigError(f"checkpoint.async_writer=process: rank {rank}'s share ({need / 2**20:.0f} MiB) does not fit "
                          f"in {shm} ({free / 2**20:.0f} MiB free); give the container a larger {shm} (a memory-backed "
                          f"emptyDir, docker --shm-size) or set checkpoint.async_writer=thread")


def shared_memory_stager():
    """Copies a rank's share into shared memory, the same buffers at every checkpoint (allocated at the first):
    what DCP's checkpoint process reads without another copy."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                                        use_non_blocking_copy=False))


def write_state_in_process(local: Path, staged: dict, group) -> None:
    """``write_state`` done by DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``): serializing and writing
    run in a process of their own, so they share no GIL with training. One such process a training process,
    started by the first call (a few seconds: a Python with torch, and a gloo group of those processes planned
    over ``group``, which every rank passes at the same point). Called from a background thread; returns when
    the files are written."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    for name in ("model", "optim"):
        dcp.async_save(staged[name], storage_writer=_QuietWriter(local / name, sync_files=False),
                       process_group=group, async_stager=_AsStaged(),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()


def upload_share(local: Path, storage, rel: str, rank: int) -> dict:
    """Upload every file under ``local`` (this rank's), then ``parts/rank_{rank}.json`` listing them with their
    sha256 and size (the sign that this rank's share is complete). Returns that listing."""
    files = {}
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        name = f.relative_to(local).as_posix()
        files[name] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        storage.upload_file(str(f), f"{rel}/{name}")
    part = local / PARTS / f"rank_{rank}.json"
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_text(json.dumps(files, sort_keys=True))
    storage.upload_file(str(part), f"{rel}/{PARTS}/rank_{rank}.json")
    return files


def commit(storage, rel: str, world_size: int, *, global_step: int, epoch: int, wait_s: float,
           before_commit=None, local: Path | None = None) -> dict:
    """Rank 0: once every rank's ``parts`` file is there (waiting up to ``wait_s``), write the manifest of all
    their files (and the parts files themselves) last, after ``before_commit()`` (the lease's fence)."""
    wanted = [f"{PARTS}/rank_{r}.json" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while True:
        present = storage.list_files(rel)
        missing = [w for w in wanted if w not in present]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CheckpointError(f"checkpoint {storage.uri(rel)}: {', '.join(missing)} not written within "
                                  f"{wait_s:g} s; it is left uncommitted (never loaded)")
        time.sleep(0.1)
    files = {}
    for w in wanted:
        raw = storage.read_bytes(f"{rel}/{w}")
        files.update(json.loads(raw))
        files[w] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    manifest = {"format": SHARDED_FORMAT, "created": time.time(), "global_step": global_step, "epoch": epoch,
                "world_size": world_size, "files": files}
    tmp = Path(tempfile.mkdtemp(prefix="ray-app-manifest-")) if local is None else local
    try:
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if before_commit is not None:
            before_commit()
        storage.upload_file(str(tmp / MANIFEST), f"{rel}/{MANIFEST}")
    finally:
        if local is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


# ---------------------------------------------------------------- loading

class VerifiedReader(FileSystemReader):
    """DCP's file reader over a local cache that fetches, from the kit's storage, only the files a load reads,
    each checked against the manifest's sha256 as it arrives (``CheckpointDamaged`` if it does not match)."""

    def __init__(self, storage, rel: str, files: dict, sub: str, cache: Path, contents: dict | None = None):
        super().__init__(cache / sub)
        self._storage, self._rel, self._files, self._sub, self._cache = storage, rel, files, sub, cache
        self._contents = {} if contents is None else contents  # bytes the catalog's verification kept

    def _fetch(self, name: str) -> None:
        target = self._cache / self._sub / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            key = f"{self._sub}/{name}"
            data = self._contents.get(key)
            target.write_bytes(data if data is not None else read_verified(self._storage, self._rel, self._files, key))

    def read_metadata(self, *args, **kwargs):
        self._fetch(".metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self._fetch(name)
        return super().read_data(plan, planner)


def _load(state: dict, reader: VerifiedReader, *, everything: bool = False) -> None:
    """``dcp.load`` into ``state`` (``everything``: all the checkpoint holds, in this process alone, no process
    group: DCP's own offline conversion, ``dcp_to_torch_save``, does it this way), with the kit's own errors
    (a damaged file, storage that did not answer) raised as they are, not inside DCP's per-rank wrapper."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        if everything:
            _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        else:
            dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]  # (exception, traceback)
        for e in inner:
            if isinstance(e, (CheckpointError, StorageError)):
                raise e from None
        # a state that does not fit the checkpoint (missing keys, other shapes): an Exception, not DCP's BaseException
        raise RuntimeError(f"{type(inner[0]).__name__}: {inner[0]}" if inner else str(exc)) from None


class ShardedRef:
    """A committed sharded checkpoint, not yet read: what ``load_into`` and ``consolidate_model`` read from
    (``contents``: the verified bytes the catalog kept, so nothing is read twice)."""

    def __init__(self, storage, rel: str, files: dict, contents: dict | None = None):
        self.storage, self.rel, self.files, self.contents = storage, rel, files, contents

    def _reader(self, sub: str, cache: Path) -> VerifiedReader:
        return VerifiedReader(self.storage, self.rel, self.files, sub, cache, self.contents)

    def load_into(self, model: torch.nn.Module, optimizer=None) -> None:
        """Every rank: the model's (and the optimizer's) state from the checkpoint, resharded to this run's world
        size and strategy. A collective: every rank calls it at the same point."""
        from ray_app.worker.strategy import load_model_state, load_train_state, model_state, train_state

        cache = Path(tempfile.mkdtemp(prefix="ray-app-load-"))
        try:
            if optimizer is None:
                model_sd = model_state(model)
                _load(model_sd, self._reader("model", cache))
                load_model_state(model, model_sd)
                return
            model_sd, optim_sd = train_state(model, optimizer)
            _load(model_sd, self._reader("model", cache))
            _load(optim_sd, self._reader("optim", cache))
            load_train_state(model, optimizer, model_sd, optim_sd)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def model_tensors(self) -> dict:
        """Each tensor of the model's state as the checkpoint holds it whole: name -> (shape, dtype), read from
        DCP's metadata alone."""
        cache = Path(tempfile.mkdtemp(prefix="ray-app-export-"))
        try:
            meta = self._reader("model", cache).read_metadata()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                if hasattr(m, "size") and hasattr(m, "properties")}

    def consolidate_some(self, names, shapes: dict) -> dict:
        """The model tensors ``names`` (``shapes``: ``model_tensors()``'s), whole, read in this process alone
        (only their pieces are read)."""
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in names}
        cache = Path(tempfile.mkdtemp(prefix="ray-app-export-"))
        try:
            _load_state_dict(state, storage_reader=self._reader("model", cache), planner=DefaultLoadPlanner(),
                             no_dist=True)
            return state
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def consolidate_model(self) -> dict:
        """The whole model state (plain tensors keyed by parameter name), read in this process alone: no
        process group, nothing of the optimizer read."""
        cache = Path(tempfile.mkdtemp(prefix="ray-app-export-"))
        try:
            state: dict = {}
            _load(state, self._reader("model", cache), everything=True)
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        finally:
            shutil.rmtree(cache, ignore_errors=True)
