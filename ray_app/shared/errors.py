"""Every exception the kit raises on purpose, and when each is raised.

Callers import their exceptions from here only, so no module imports another just to catch its error.
What each failure means (how a worker wraps it, what the failure policy decides, what the driver raises,
the exit code and the one line shown) is the table in ``ray_app.shared.failures``; an exit code a class
below names is that table's (a unit test reads them). An error's line is ``first_line`` (or ``last_line`` for a traceback's text),
at most ``LINE_LIMIT`` characters wherever it is shown, journaled or reported.

Raised in workers and carried to the driver: ``UserCodeError`` (the user's traceback, shown once),
``Preempted`` / ``Stopped`` (every rank, after the checkpoint they agreed on), ``Diverged``
(every rank at the same step: training diverged with ``train.nonfinite: stop``), ``StorageUnavailable`` (a
fault: the worker group restarts).
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path


class ConfigError(ValueError):
    """Bad input a user can fix: the message names the key and the fix."""


class PluginError(ConfigError):
    """A plug-in that breaks its contract. Raised in a worker it ends the run at once (exit code 2)."""


class UserCodeError(RuntimeError):
    """An exception raised inside the user's code on a worker, carried to the driver as text.

    ``fingerprint`` says where it happened (exception type, message, the innermost frames, the
    global step at which it was raised); the same fingerprint after a restart means a bug, not a fault.
    ``step``: that global step (-1: before training started).
    """

    def __init__(self, summary: str, traceback_text: str, fingerprint: str, rank: int, step: int = -1,
                 report: bool = False):
        super().__init__(summary, traceback_text, fingerprint, rank, step, report)
        self.summary, self.traceback_text, self.fingerprint, self.rank = summary, traceback_text, fingerprint, rank
        self.step, self.report = step, report

    def __str__(self) -> str:
        return self.summary

    @property
    def where(self) -> str:
        return f"at step {self.step}" if self.step >= 0 else "before training"

    @property
    def shown_above(self) -> str:
        """What the driver writes above the last line: the traceback, or the data pipeline's report."""
        return "its report" if self.report else "traceback"

    @classmethod
    def from_data_pipeline(cls, exc: BaseException, rank: int, step: int = -1) -> UserCodeError:
        """A ``DataPipelineError`` (raised here or in a DataLoader worker): its report, shown as written."""
        report = DataPipelineError.report_of(exc).strip()
        summary = f"in the data pipeline: {last_line(report) if report else 'the data pipeline failed'}"
        return cls(summary, report + "\n", f"data|{report}|step {step}", rank, step, report=True)

    @classmethod
    def from_exception(cls, exc: BaseException, rank: int, step: int, roots: tuple[str, ...]) -> UserCodeError | None:
        """The exception as raised in plug-in code under ``roots``; None if no frame of it is there."""
        frames = traceback.extract_tb(exc.__traceback__)
        mine = [i for i, f in enumerate(frames) if under(f.filename, roots)]
        if not mine:
            return None
        # the user's frames and what they called; not the kit's or Ray's above them, nor torch's call plumbing
        shown = [f for f in frames[mine[0]:] if not _plumbing(f)]
        text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(shown)) + \
            "".join(traceback.format_exception_only(type(exc), exc))
        summary = f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__
        where = frames[mine[-1]]
        return cls(summary, text, f"{type(exc).__qualname__}|{exc}|{where.filename}:{where.lineno}|step {step}", rank,
                   step)


_PLUMBING = {("module.py", "_wrapped_call_impl"), ("module.py", "_call_impl"), ("distributed.py", "forward"),
             ("distributed.py", "_run_ddp_forward")}


def _plumbing(frame: traceback.FrameSummary) -> bool:
    """torch's nn.Module.__call__ and DDP's forward: between the user's call and the user's forward."""
    return f"{os.sep}torch{os.sep}nn{os.sep}" in frame.filename and (Path(frame.filename).name, frame.name) in _PLUMBING


def under(filename: str, roots: tuple[str, ...]) -> bool:
    """Whether ``filename`` lies in one of the folders (or is one of the files) ``roots``."""
    if filename.startswith("<"):  # "<frozen runpy>", "<string>": no file, and abspath would put it in the cwd
        return False
    path = os.path.abspath(filename)
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class StorageError(RuntimeError):
    """A storage problem a user can fix (bucket, credentials, endpoint, path): exit 2."""


class StorageUnavailable(RuntimeError):
    """The object store did not answer for longer than the retry budget (``failure.storage_retry_s``):
    a fault, not bad input. In a worker it fails the worker group, which restarts from the newest
    committed checkpoint (Ray Train's policy, up to ``failure.max_failures``)."""


class UserError(RuntimeError):
    """Bad input found at launch time: the cluster too small for the workers, a run whose checkpoints
    need another config, a script that is not Python (exit code 2)."""


class TrainingFailed(RuntimeError):
    """Training failed after all retries (exit code 1)."""


class RunStopped(RuntimeError):
    """The driver was sent SIGTERM and the workers' checkpoint is committed (exit code 143 = 128 + SIGTERM)."""


class RunHeld(RuntimeError):
    """Another driver holds the run's lease (``ray_app.shared.lease``): one writer per run (exit code 2)."""


class RunInterrupted(RuntimeError):
    """The driver was sent SIGINT (Ctrl-C) and the workers' checkpoint is committed (exit code 130)."""


class DataPipelineError(RuntimeError):
    """An exception raised in the data pipeline (a data set's ``__getitem__``, the collate function), in
    the training process or a DataLoader worker: the user's, shown once with the user's frames or the
    samples' indices and shapes. A DataLoader worker's exception reaches the training process rebuilt from
    its text, so the whole report travels in the message, after ``MARKER``."""

    MARKER = "[ray-app data pipeline]\n"

    @classmethod
    def report_of(cls, exc: BaseException) -> str:
        """The report as written where it was raised, also from the text torch rebuilt it from."""
        text = str(exc)
        at = text.rfind(cls.MARKER)
        return text[at + len(cls.MARKER):] if at >= 0 else text


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted (missing, incomplete, tampered)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, incomplete, damaged, tampered): a restore
    skips it for the next older one. Storage errors are never this."""

    def __init__(self, uri: str, reason: str):
        super().__init__(f"checkpoint {uri} failed verification: {reason}")
        self.uri, self.reason = uri, reason

    def __reduce__(self):  # pickled between ranks (DCP gathers each rank's failure) and by Ray
        return type(self), (self.uri, self.reason)


class ShardError(RuntimeError):
    """Shards that cannot be read as a data set (``ray_app.shared.shards``): no manifest, a manifest of another format
    or version, a malformed one, a split without shards, a shard missing or whose bytes do not match it (exit 2)."""


class Diverged(RuntimeError):
    """Every rank raises this at the same step when the loss or the gradients are not finite and
    ``train.nonfinite`` is ``stop``: the run ends there (exit code 1), its newest good checkpoint kept."""


class Preempted(RuntimeError):
    """Every rank raises this after the preemption checkpoint is committed: restart the group from it."""


class Stopped(RuntimeError):
    """Every rank raises this after the checkpoint of a stop request is committed: the run ends there."""


class PeerLost(RuntimeError):
    """A collective (gloo, NCCL) failed because another rank is gone (killed, its node lost, or ended by
    an error of its own), or a worker failed after the group was told to leave: a consequence, not a
    cause. The worker group restarts (Ray Train's policy); the cause is shown where it happened, and
    this worker's traceback is not."""

    PATTERNS = ("gloo/transport", "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator was aborted")
    # gloo's own words, also without its source path (a collective timed out: the peer stopped answering)
    GLOO = ("Application timeout caused pair closure", "Connection closed by peer", "Connection reset by peer",
            "Timed out waiting")

    @classmethod
    def of(cls, exc: BaseException, rank: int, leaving: bool) -> PeerLost | None:
        """``exc`` as a lost peer: a distributed backend's error or one of its known messages, or any
        error of a worker that was already ``leaving`` (a notice or the group's teardown came first)."""
        from torch.distributed import DistError  # a worker's: the driver and the controller never call this

        text = str(exc)
        gloo = type(exc) is RuntimeError and any(p in text for p in cls.GLOO)  # not a user's OSError
        if not (leaving or gloo or isinstance(exc, DistError) or any(p in text for p in cls.PATTERNS)):
            return None
        return cls(f"rank {rank} lost a peer: {type(exc).__name__}: {first_line(exc)}")


LINE_LIMIT = 500  # the characters of an error's line that are shown, journaled or reported, everywhere


def _lines(exc: BaseException | str) -> list[str]:
    return [ln.strip() for ln in str(exc).splitlines() if ln.strip()]


def first_line(exc: BaseException | str) -> str:
    """An error's (or a text's) first non-blank line, at most ``LINE_LIMIT`` characters; an error's type's name
    if it has none ('' for a blank text)."""
    lines = _lines(exc)
    return (lines[0] if lines else "" if isinstance(exc, str) else type(exc).__name__)[:LINE_LIMIT]


def last_line(exc: BaseException | str) -> str:
    """An error's (or a text's) last non-blank line, at most ``LINE_LIMIT`` characters: where a traceback's text
    (Ray's of a remote error, a data pipeline's report) names the error; an error's type's name if it has none
    ('' for a blank text)."""
    lines = _lines(exc)
    return (lines[-1] if lines else "" if isinstance(exc, str) else type(exc).__name__)[:LINE_LIMIT]
