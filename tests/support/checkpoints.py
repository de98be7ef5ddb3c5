"""A real checkpoint of a tiny model, for the tests of what reads, lists, verifies and resumes checkpoints:
as the kit writes them (``save_tiny_shards``) and in the earlier single-file format, which the kit no
longer writes and still loads (``write_single_file_dir``, ``write_checkpoint``)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ray_app.shared.catalog import SINGLE_FILE_FORMAT, Position, TrainState, checkpoint_dir_name
from ray_app.worker.checkpoint import CheckpointFiles, capture_rng_state, write_manifest


@dataclass
class CheckpointPayload:
    """Everything a checkpoint of the earlier single-file format holds (rank 0 wrote it all)."""

    model: dict
    optimizer: dict
    scheduler: dict
    rng_per_rank: list[dict]
    state: dict  # state.json: epoch, batches_done (in the epoch), global_step, world_size
    config: dict
    metrics: dict = field(default_factory=dict)


def write_single_file_dir(path: Path, payload: CheckpointPayload) -> dict:
    """A checkpoint of the single-file format (``ray_app.checkpoint/1``) at ``path``: every file, then the
    manifest (last). Returns the manifest."""
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
    return write_manifest(path, global_step=payload.state["global_step"], epoch=payload.state["epoch"],
                          fmt=SINGLE_FILE_FORMAT)


def _tiny_trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def tiny_payload(step: int, *, seed: int = 0, ranks: int = 1, epoch: int = 1, batches_done: int = 0,
                 config: dict | None = None, metrics: dict | None = None) -> CheckpointPayload:
    """A ``Linear(5, 4)`` after one SGD step with momentum (so the optimizer state is not empty), its
    scheduler, and one RNG state per rank, at ``global_step`` ``step``. The same ``seed`` gives the same
    weights. ``metrics`` defaults to ``{"global_step": step}``, ``config`` to ``{}``."""
    model, opt, sched = _tiny_trained(seed)
    return CheckpointPayload(model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                             rng_per_rank=[capture_rng_state() for _ in range(ranks)],
                             state={"epoch": epoch, "batches_done": batches_done, "global_step": step,
                                    "world_size": ranks},
                             config=config or {}, metrics=metrics or {"global_step": step})


def save_tiny_shards(ckpt, step: int, *, seed: int = 0, epoch: int = 1, config: dict | None = None) -> tuple[str, float]:
    """``tiny_payload``'s model and optimizer saved as the kit saves them (``Checkpointer.save_shards``, every
    rank's share; here one process, world size 1, no process group), at ``epoch`` with ``config`` (default
    ``{}``). Returns the checkpoint's name and the seconds ``save_shards`` said training was blocked."""
    model, opt, sched = _tiny_trained(seed)
    name = ckpt.new_name(step)
    files = CheckpointFiles(sched.state_dict(), TrainState(Position(epoch=epoch, global_step=step), world_size=1),
                            config=config or {}, metrics={"global_step": step})
    with warnings.catch_warnings():  # DCP: "torch.distributed is ... uninitialized, ... a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        blocked = ckpt.save_shards(model, opt, files, capture_rng_state(), {"global_step": step},
                                   rank=0, world_size=1, name=name)
    return name, blocked


def write_checkpoint(run_dir: Path, step: int, **payload) -> Path:
    """``tiny_payload(step, **payload)`` committed (manifest last) as ``run_dir``'s checkpoint of ``step``, in the
    single-file format."""
    path = Path(run_dir) / checkpoint_dir_name(step)
    write_single_file_dir(path, tiny_payload(step, **payload))
    return path


def checkpoint_model(uri: str, env: dict | None = None) -> dict:
    """The model state_dict of a checkpoint (or of a run's newest), consolidated from every rank's share as
    `ray-app checkpoints export` does; ``env``: the S3 settings (endpoint, credentials) to read it with."""
    import os

    from ray_app.worker.checkpoint import load_uri

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        return load_uri(uri, rank=None, model_only=True).model
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
