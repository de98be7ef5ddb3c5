"""Resuming: where training is (``Position``, ``ray_app.shared.catalog``'s), restoring it from the newest good checkpoint, re-sharding
the rest of an epoch at another world size, and what the config may change on resume.

``restore`` loads the checkpoint the checkpointer finds (each file read once, verified as read), puts its
model, optimizer, LR schedule and every rank's RNG back, and returns where the run continues; a resume at
the same world size continues exactly where an uninterrupted run would have been (bit-identical on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ray_app.shared.catalog import Position
from ray_app.shared.config import Config, resume_conflicts
from ray_app.shared.errors import CheckpointError, PluginError, first_line
from ray_app.worker.checkpoint import restore_rng_state
from ray_app.worker.ddp import seed_everything


@dataclass
class Resumed:
    """What a restore hands back to the loop."""

    pos: Position
    from_step: int = 0
    checkpoint_unix: float = 0.0
    last_eval: dict = field(default_factory=dict)
    tracking: dict = field(default_factory=dict)  # the trackers' state (ray_app.worker.tracking: the MLflow run id, ...)
    epoch_loss: tuple[float, float] = (0.0, 0.0)  # the epoch's global loss sums up to pos (TrainState.epoch_loss)


def restore(cfg: Config, parts, checkpointer, rank: int, world_size: int, say=print) -> Resumed | None:
    """The newest good checkpoint of the run (or of ``run.resume_from``) loaded into ``parts``; None for a
    fresh start. A checkpoint of another config is bad input (one line, exit 2), unless it warm-starts a
    new run from another run's weights."""
    def put_back(loaded) -> None:
        conflicts = resume_conflicts(loaded.config, cfg)
        if conflicts and not checkpointer.warm_start:
            raise PluginError(f"checkpoint {loaded.uri} was made with another {', '.join(conflicts)}; "
                              "use another run.name (or run.resume_from to warm-start)")
        try:  # either strategy, any world size (ray_app.worker.strategy); a warm start takes the weights alone
            loaded.load_into(parts.model, None if conflicts else parts.optimizer)
        except CheckpointError:
            raise  # a damaged share: the checkpointer skips it for the next older one
        except (RuntimeError, KeyError, ValueError) as exc:
            first = first_line(exc)
            raise PluginError(f"checkpoint {loaded.uri} does not fit model.name={cfg.model.name} ({first}); "
                              "use another run.name for a changed model") from None

    try:
        loaded = checkpointer.restore(rank, put_back)
    except CheckpointError as exc:  # run.resume_from with no checkpoint that loads, or one torch refuses
        raise PluginError(str(exc)) from None  # bad input: one line, exit 2, not retried
    if loaded is None:
        return None
    conflicts = resume_conflicts(loaded.config, cfg)
    if conflicts:  # a warm start from another run's checkpoint: its weights, a fresh start otherwise
        say(f"warm start from {loaded.uri}: model weights only (it differs in {', '.join(conflicts)})")
        return None
    if loaded.scheduler:
        parts.scheduler.load_state_dict(loaded.scheduler)
    state = loaded.train_state(cfg.data.batch_size, world_size)
    pos, saved_world = state.pos, state.world_size
    if saved_world != world_size:
        reshard(cfg, parts, pos, saved_world, world_size, say)
    apply_hyperparameters(cfg, parts.optimizer, parts.scheduler)
    if loaded.rng is not None:
        restore_rng_state(loaded.rng)
    else:  # a rank the checkpoint's world did not have: a stream of its own, derived, not the run's first
        seed_everything(cfg.run.seed * 1000 + rank + 1_000_003 * pos.global_step)
    say(f"resumed from {loaded.uri} at epoch {pos.epoch} batch {pos.batches_done} step {pos.global_step}")
    return Resumed(pos, pos.global_step, loaded.created, state.last_eval, state.tracking, state.epoch_loss)


def reshard(cfg: Config, parts, pos: Position, saved_world: int, world_size: int, say=print) -> None:
    """Resuming at another world size: the rest of the epoch is dealt out over this one (the sampler),
    and the LR schedule goes to where a run at this world size would be after as many samples. The
    per-worker batch stays data.batch_size, so the global batch is data.batch_size x the world size;
    global_step keeps counting the optimizer steps taken."""
    accum = cfg.train.grad_accum
    parts.train_sampler.set_start(pos.samples_done, pos.epoch_world_size)
    left = math.ceil(len(parts.train_sampler) / cfg.data.batch_size)
    pos.batches_done = parts.batches_per_epoch - left
    parts.scheduler.last_epoch = pos.epoch * parts.steps_per_epoch + pos.batches_done // accum
    say(f"world size {saved_world} -> {world_size}: the rest of epoch {pos.epoch} "
        f"({pos.samples_done} of its samples read) re-sharded, {left} batches per rank left; "
        f"global batch {cfg.data.batch_size * world_size}")


def apply_hyperparameters(cfg: Config, optimizer, scheduler) -> None:
    """After loading a checkpoint: the config's lr, weight decay and momentum win over the saved ones
    (loading restores them; a resumed run may change them). Unchanged, this sets what was loaded.

    Through public attributes only: the optimizer's groups hold the LR in use (what the loop logs);
    the scheduler's record of its last LR (``get_last_lr``) follows at its next ``step``."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.train.lr
        group["weight_decay"] = cfg.train.weight_decay
        if cfg.train.optimizer == "sgd":
            group["momentum"] = cfg.train.momentum
    scheduler.base_lrs = [cfg.train.lr for _ in optimizer.param_groups]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
