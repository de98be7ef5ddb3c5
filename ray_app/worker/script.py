"""Script mode: ``ray-app run [--config FILE] [--set ...] SCRIPT [ARGS...]`` runs a torchrun-style DDP
script, unchanged, in every Ray Train worker.

What the script gets in each worker:

- ``__main__`` as ``python SCRIPT ARGS`` gives it: ``sys.argv == [SCRIPT, *ARGS]`` (SCRIPT's absolute
  path, as ``__file__``), the script's folder first on ``sys.path``, ``if __name__ == "__main__":`` runs;
  the working directory is the folder ``ray-app run`` was started in (where the node has it; else the
  job's ``--working-dir``).
- torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
  (the node's rank), ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``TORCHELASTIC_RUN_ID`` (the run's
  name), and ``MASTER_ADDR`` / ``MASTER_PORT`` as Ray Train set them for its process group.
- that process group, already set up by Ray Train (gloo on CPU, nccl with ``scaling.use_gpu``). While the
  script runs, ``torch.distributed.init_process_group(...)`` returns at once whatever backend,
  ``init_method``, port, world size or rank it names (one notice line on rank 0 naming what differs from
  the kit's group), and
  ``destroy_process_group()`` of the default group does nothing: the group is Ray Train's, torn down after.
- ``sys.exit(0)`` (or none) ends normally. An exception or ``sys.exit(non-zero)`` fails the worker group:
  Ray Train restarts the whole script on every worker up to ``failure.max_failures``; the same error at
  the same place and save after a restart is a bug and ends the run (``ray_app.controller.failure_policy``);
  ``ray-app run`` shows the script's traceback once and exits 1.
- the config's ``scaling.*``, ``failure.*``, ``run.storage``, ``run.name`` (default: the script's file
  name without ``.py``) and ``checkpoint.keep`` / ``checkpoint.upload`` apply; ``data.*``, ``model.*``,
  ``task.*``, ``train.*`` and ``metrics.*`` are the plug-in mode's and do nothing here.

Checkpoints, two calls; every rank calls each of them, the same number of times::

    from ray_app import script as kit

    state = kit.load()        # None on a fresh start, else what the newest committed kit.save() was given
    start = 0
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"]); start = state["epoch"] + 1
    for epoch in range(start, epochs):
        ...                   # one epoch
        kit.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch})

``save(state)``: ``state`` is a dict of what ``torch.load(weights_only=True)`` loads (tensors, ints,
floats, bools, strings, None, and dicts / lists / tuples of them: state dicts qualify); anything else is
a TypeError naming the entry, on every rank, under torchrun too. Rank 0 writes it with ``torch.save`` into
a new checkpoint directory of the run, ``{run.storage}/{run.name}/ckpt-s{N}-.../state.pt`` (N counts the
run's saves), then the kit's manifest (sha256 of every file, written last: the commit), through the run's
storage (a folder or S3), and reports it to Ray Train, which keeps the newest ``checkpoint.keep``.
``ray-app checkpoints list|verify`` read them (N as the step, an int ``state["epoch"]`` as the epoch).
Every rank reports (``ray.train.report`` is a barrier), so ``save`` is a synchronisation point.

``load()``: the state of the run's newest checkpoint that verifies (broken or partial ones are skipped,
each with one line), the same checkpoint on every rank (rank 0 chooses), tensors on the CPU
(``load_state_dict`` copies them to the device). A run resumes by its ``run.name``: running a finished
run's name again loads its last state; another name starts fresh. What is saved is what resumes: the
data order, RNG states and anything else the script needs to continue exactly are the script's to save.

Outside ``ray-app run`` (``python`` or ``torchrun``) ``save`` only checks the state and ``load``
returns None: the script runs as it did, from its beginning, saving nothing.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import runpy
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ray_app.shared.errors import ConfigError

STATE_FILE = "state.pt"


# ---------------------------------------------------------------- worker side

def run_in_worker(job: dict, runtime) -> dict:
    """One worker's run of the script (called by ``ray_app.worker.entry.worker_main`` in the project folder). An
    exception or non-zero exit of the script comes back as a ``UserCodeError`` the driver shows once."""
    import ray.train

    from ray_app.shared.errors import PeerLost, RunHeld, UserCodeError

    global _SESSION
    started = time.time()
    script = _script_here(job["script"])
    os.environ.update(torchrun_env(ray.train.get_context(), runtime.run))
    session = _SESSION = _Session(runtime.storage, runtime.run, runtime.rank, runtime.world_size, runtime.report)
    if job.get("lease_token"):  # no commit once another driver holds the run (this one's was killed)
        from ray_app.shared.lease import fence

        session.before_commit = fence(runtime.storage, runtime.run, job["lease_token"])
    script_start, t0 = time.time(), time.perf_counter()
    try:
        with kit_process_group(say=print if runtime.rank == 0 else None):
            run_main(script, job["args"])
    except (Exception, SystemExit) as exc:
        lost = PeerLost.of(exc, runtime.rank, leaving=False)  # another rank is gone: not the script's bug
        if lost is not None:
            raise lost from None
        if isinstance(exc, RunHeld):  # save()'s fence: another driver holds the run, not the script's bug
            raise exc from None
        wrapped = UserCodeError.from_exception(exc, runtime.rank, session.progress, script_roots(script))
        if wrapped is None:
            raise
        raise wrapped from None
    finally:
        _SESSION = None
    return {"checkpoint": session.last or session.loaded, "saves": session.saves, "resumed_from": session.loaded,
            "script_seconds": round(time.perf_counter() - t0, 3), "worker_start_unix": started,
            "script_start_unix": script_start}


def _script_here(path: str) -> str:
    script = os.path.abspath(path)
    if not os.path.isfile(script):  # a node that has neither the driver's folder nor the job's working dir
        raise ConfigError(f"SCRIPT {path}: not found on the worker on {socket.gethostname()} (in {os.getcwd()}); "
                          "ship it with `ray job submit --working-dir .`, put it in the image, or run from a "
                          "folder every node shares")
    return script


def torchrun_env(ctx, run_id: str) -> dict[str, str]:
    """What torchrun puts in each worker's environment, from Ray Train's context (MASTER_ADDR and
    MASTER_PORT are already there: Ray Train sets them for its own env:// rendezvous)."""
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    env = {"RANK": rank, "LOCAL_RANK": ctx.get_local_rank(), "WORLD_SIZE": world,
           "LOCAL_WORLD_SIZE": ctx.get_local_world_size(), "GROUP_RANK": ctx.get_node_rank(),
           "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": run_id}
    return {k: str(v) for k, v in env.items()}


def run_main(script: str, args: list[str]) -> None:
    """Run SCRIPT as ``python SCRIPT ARGS`` does; returns on a normal end or ``sys.exit(0)``, raises the
    script's exception or its non-zero SystemExit. sys.argv and sys.path are restored afterwards."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]  # runpy sets argv[0] to the path it runs: the absolute one, for its frames
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))  # as python does: symlinks resolved
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def script_roots(script: str) -> tuple[str, ...]:
    """Where the user's code is, for their traceback and the failure policy's fingerprint: the script's
    folder, or the script alone when that folder also holds the kit or the Python environment (a venv
    inside the project), whose frames are not the user's."""
    from ray_app.shared.errors import under as _under

    folder = os.path.dirname(script)
    holds_others = any(_under(p, (folder,)) for p in (os.path.dirname(os.path.abspath(__file__)), sys.prefix))
    return (script,) if holds_others else (folder,)


@contextlib.contextmanager
def kit_process_group(say: Callable | None = print):
    """While the script runs, its ``init_process_group`` returns at once when a group exists (the kit's,
    which Ray Train set up and tears down), ``say`` (rank 0's print) noting once a backend that differs;
    ``destroy_process_group`` of the default group does nothing. Both are restored afterwards."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    real_init, real_destroy = c10d.init_process_group, c10d.destroy_process_group
    noticed = []

    @functools.wraps(real_init)
    def init_process_group(*args, **kwargs):
        if not dist.is_initialized():
            return real_init(*args, **kwargs)
        differs = _differs_from_the_kits(dict(zip(("backend", "init_method"), args)) | kwargs)
        if differs and say is not None and not noticed:
            noticed.append(differs)
            say(f"ray-app: notice: the script asks for {', '.join(differs)}; it runs on the kit's process group "
                f"({dist.get_backend()}, world size {dist.get_world_size()}, set up by Ray Train: gloo on CPU, "
                "nccl with scaling.use_gpu=true)", flush=True)
        return None

    @functools.wraps(real_destroy)
    def destroy_process_group(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return None  # Ray Train's group: it outlives the script
        return real_destroy(group)

    patched = {"init_process_group": init_process_group, "destroy_process_group": destroy_process_group}
    saved = [(module, name, getattr(module, name)) for module in (dist, c10d) for name in patched]
    for module, name, _ in saved:
        setattr(module, name, patched[name])
    try:
        yield
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def _differs_from_the_kits(asked: dict) -> list[str]:
    """What a script's ``init_process_group`` arguments ask for that the kit's group is not."""
    import torch.distributed as dist

    out = []
    backend = asked.get("backend")
    if backend is not None and str(backend).lower() not in (str(dist.get_backend()), "cpu:gloo,cuda:nccl"):
        out.append(f"backend {str(backend)!r}")
    method = asked.get("init_method")
    if method not in (None, "env://"):
        out.append(f"init_method {method!r}")  # another rendezvous: not made, the group exists already
    for key, kit in (("world_size", dist.get_world_size()), ("rank", dist.get_rank())):
        if asked.get(key) not in (None, -1, kit):
            out.append(f"{key} {asked[key]}")
    return out


# ---------------------------------------------------------------- the checkpoint API

@dataclass
class _Session:
    """The running script's handle on its run (one per worker, set while the script runs)."""

    storage: object
    run: str
    rank: int
    world_size: int
    report: Callable  # ray_app.worker.entry.RayRuntime.report: (metrics, local_dir=None, dir_name=None, upload=None)
    progress: int = 0  # the loaded checkpoint's number plus the saves since: the same on every rank
    next_number: int | None = None  # rank 0: the number of its next checkpoint directory
    saves: int = 0
    loaded: str | None = None
    last: str | None = None
    before_commit: Callable | None = None  # the lease's fence before each manifest (ray_app.shared.lease.fence)


_SESSION: _Session | None = None


def save(state: dict) -> None:
    """Commit ``state`` as the run's newest checkpoint (rank 0 writes, every rank reports). Every rank
    calls it, the same number of times. Outside ``ray-app run``: checks ``state``, saves nothing."""
    check_plain(state)
    s = _SESSION
    if s is None:
        return
    s.saves += 1
    s.progress += 1
    metrics = {"script_saves": s.progress}
    if s.rank != 0:
        s.report(metrics)
        return
    s.last = _write_and_report(s, state, metrics)


def load() -> dict | None:
    """The state of the run's newest committed checkpoint, the same on every rank; None on a fresh start
    (and outside ``ray-app run``). Every rank calls it."""
    s = _SESSION
    if s is None:
        return None
    from ray_app.shared.catalog import MANIFEST, SCRIPT_FORMAT, newest_good, read_verified
    from ray_app.worker.checkpoint import load_torch_bytes

    found = newest_good(s.storage, s.run, fmt=SCRIPT_FORMAT, keep=STATE_FILE.__eq__,
                        say=lambda line: print(line, flush=True)) if s.rank == 0 else None
    name = _agree(s, found.name if found is not None else None)  # rank 0 chose: every file verified, once
    if name is None:
        return None
    rel = f"{s.run}/{name}"
    if found is not None:
        manifest, raw = found.manifest, found.read(STATE_FILE)
    else:
        manifest = json.loads(s.storage.read_bytes(f"{rel}/{MANIFEST}"))
        raw = read_verified(s.storage, rel, manifest["files"], STATE_FILE)
    state = load_torch_bytes(raw, s.storage.uri(rel))
    s.progress, s.loaded = int(manifest["global_step"]), s.storage.uri(rel)
    if s.rank == 0:
        print(f"ray-app: resuming from {s.loaded} (save {s.progress})", flush=True)
    return state


def _write_and_report(s: _Session, state: dict, metrics: dict) -> str:
    import torch

    from ray_app.shared.catalog import SCRIPT_FORMAT, checkpoint_dir_name
    from ray_app.worker.checkpoint import upload_checkpoint_dir, write_manifest

    if s.next_number is None:  # after every directory of the run, committed or not, so ours sorts newest
        s.next_number = _after_newest(s.storage, s.run)
    number, s.next_number = s.next_number, s.next_number + 1
    local = Path(tempfile.mkdtemp(prefix="ray-app-script-ckpt-"))
    torch.save(state, local / STATE_FILE)
    epoch = state.get("epoch") if type(state.get("epoch")) is int else None  # shown by `ray-app checkpoints list`
    write_manifest(local, global_step=number, epoch=epoch, fmt=SCRIPT_FORMAT)
    name = checkpoint_dir_name(number)
    uri = s.storage.uri(s.run, name)
    s.report(dict(metrics, checkpoint=uri), local, name,
             lambda local_dir, dir_name: upload_checkpoint_dir(local_dir, s.storage, f"{s.run}/{dir_name}",
                                                               before_commit=s.before_commit))
    return uri


def _after_newest(storage, run: str) -> int:
    from ray_app.shared.catalog import list_checkpoints, step_of

    return max((step_of(n) or 0 for n in list_checkpoints(storage, run)), default=0) + 1


def _agree(s: _Session, value):
    """Rank 0's ``value`` on every rank: a checkpoint committed while a rank lists must not split them."""
    if s.world_size == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_PLAIN_LEAVES = (int, float, bool, str, bytes, type(None))


def check_plain(state, where: str = "state") -> None:
    """TypeError naming the first entry ``torch.load(weights_only=True)`` would refuse, at save time
    rather than at resume. Exact types: numpy scalars and named tuples pickle as their classes."""
    import torch

    if where == "state" and not isinstance(state, dict):
        raise TypeError(f"ray_app.script.save(state): state must be a dict, not {type(state).__name__}")
    if isinstance(state, (torch.Tensor, torch.dtype, torch.device, torch.Size)) or type(state) in _PLAIN_LEAVES:
        return
    if type(state) in (dict, collections.OrderedDict):
        for key, value in state.items():
            if type(key) not in _PLAIN_LEAVES:
                raise TypeError(f"ray_app.script.save(state): a key of {where} is a {type(key).__name__}; "
                                "use strings or numbers")
            check_plain(value, f"{where}[{key!r}]")
        return
    if type(state) in (list, tuple):
        for i, value in enumerate(state):
            check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(f"ray_app.script.save(state): {where} is a {type(state).__module__}.{type(state).__qualname__}, "
                    "which torch.load(weights_only=True) does not load; save tensors, numbers, strings and "
                    "dicts / lists of them (state_dict() gives such a dict; .item() or .tolist() convert numpy)")
