"""Every exception the kit raises on purpose, when each is raised, and the exit code it ends a command with.

Callers import their exceptions from here only, so no module imports another just to catch its error.
"""

from __future__ import annotations


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
    """Another driver holds the run's lease (``ray_app.lease``): one writer per run (exit code 2)."""


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
