"""The failure table: for each kind of failure, how a worker recognises and wraps it, what the failure
policy decides, what the driver raises, the exit code and the one line the user sees.

The worker (``wrap``), the failure policy in Ray Train's controller (``decide``), the driver
(``at_driver``) and the command line (``exit_code``, ``one_line``) consult this table and nothing else.
The exceptions themselves live in ``ray_app.shared.errors``.

===========================  ==================================  ===========================  ================  ====
kind                         a worker raises                     the policy                   the driver raises exit
===========================  ==================================  ===========================  ================  ====
bad input                    ConfigError (PluginError; a shard   stop                         UserError         2
                             that fails its manifest; DDP's
                             unused-parameters error); RunHeld
                             (another driver took the run over:
                             no commit); StorageError (a full
                             disk, access denied)
the user's error             UserCodeError (fingerprint: type,   restart, one line naming it; TrainingFailed,   1
                             message, place, global step)        the same fingerprint again:  traceback once
                                                                 stop
divergence                   Diverged (every rank, same step)    stop                         TrainingFailed    1
a stop (driver's SIGTERM)    Stopped (after the checkpoint)      stop                         RunStopped        143
an interrupt (SIGINT)        Stopped (after the checkpoint)      stop                         RunInterrupted    130
preemption                   Preempted (after the checkpoint)    restart, not counted         -                 -
storage unavailable          StorageUnavailable                  restart, one line, counted   TrainingFailed    1
a lost peer                  PeerLost (a failed collective, Ray  restart, counted; the line   TrainingFailed    1
                             Train's own call failing as it      names the rank that failed
                             tears the group down, or any error
                             after the notice)
a killed worker, a hang      (Ray's: the actor died, the health  restart, one line, counted   TrainingFailed    1
                             check or a collective timed out)
a group that did not start   (Ray's controller: start timeout)   restart, one line            TrainingFailed    1
storage at a command's start (the driver's own reads: eval's or   -                            StorageError,     2
                             a warm start's checkpoint, ``ray-app                              StorageUnavailable
                             checkpoints``), past the budget
===========================  ==================================  ===========================  ================  ====

Every restart is one line (``restart_line``); a run that ends is one line at the driver (``one_line``),
the user's traceback once before it for their own error. A hang's restart line follows the hang report's
line (``ray_app.shared.reports``: the rank that did not reach the collective the others wait in, and where their
stacks are).
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass

from ray_app.shared import ray_seam
from ray_app.shared.errors import (
    CheckpointError,
    ConfigError,
    DataPipelineError,
    Diverged,
    PeerLost,
    PluginError,
    Preempted,
    RunHeld,
    RunInterrupted,
    RunStopped,
    ShardError,
    Stopped,
    StorageError,
    StorageUnavailable,
    TrainingFailed,
    UserCodeError,
    UserError,
    first_line,
)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 128 + signal.SIGTERM, 130

STOP, RETRY, RETRY_FREE, RETRY_ONCE = "stop", "restart", "restart, not counted", "restart; the same again: stop"


@dataclass(frozen=True)
class Kind:
    """One row of the table."""

    name: str
    worker_raises: tuple[type, ...]  # what a worker raises for it (empty: Ray's own error)
    decision: str  # STOP, RETRY, RETRY_FREE or RETRY_ONCE
    driver_raises: type | None  # what the driver raises when the run ends on it
    exit_code: int | None


BAD_INPUT_KIND = Kind("bad input", (ConfigError, RunHeld, StorageError), STOP, UserError, EXIT_BAD_INPUT)
USER_ERROR = Kind("the user's error", (UserCodeError,), RETRY_ONCE, TrainingFailed, EXIT_FAILED)
DIVERGED = Kind("divergence", (Diverged,), STOP, TrainingFailed, EXIT_FAILED)
STOPPED = Kind("a stop", (Stopped,), STOP, RunStopped, EXIT_STOPPED)
INTERRUPTED = Kind("an interrupt", (Stopped,), STOP, RunInterrupted, EXIT_INTERRUPTED)
PREEMPTED = Kind("preemption", (Preempted,), RETRY_FREE, None, None)
STORAGE = Kind("storage unavailable", (StorageUnavailable,), RETRY, TrainingFailed, EXIT_FAILED)
LOST_PEER = Kind("a lost peer", (PeerLost,), RETRY, TrainingFailed, EXIT_FAILED)
RAYS_OWN = Kind("a killed worker, a hang", (), RETRY, TrainingFailed, EXIT_FAILED)
NOT_STARTED = Kind("a group that did not start", (), RETRY, TrainingFailed, EXIT_FAILED)

TABLE = (BAD_INPUT_KIND, USER_ERROR, DIVERGED, STOPPED, INTERRUPTED, PREEMPTED, STORAGE, LOST_PEER, RAYS_OWN,
         NOT_STARTED)

# what a command ends with, one line naming the key or resource (exit 2); a store that did not answer a
# command's own reads (before any worker: eval's checkpoint, a warm start's, `checkpoints`) within
# failure.storage_retry_s is named as the preflight names an unreachable one
BAD_INPUT = (ConfigError, StorageError, CheckpointError, ShardError, UserError, RunHeld, StorageUnavailable)


def kind_of(error: BaseException) -> Kind:
    """The row of one worker's (or the controller's) error."""
    for kind in (BAD_INPUT_KIND, USER_ERROR, DIVERGED, STOPPED, PREEMPTED, STORAGE, LOST_PEER):
        if isinstance(error, kind.worker_raises):
            return kind
    return RAYS_OWN


# ---------------------------------------------------------------- the worker: recognise and wrap

UNUSED_PARAMETERS_HINT = ("DDP found parameters that received no gradient (the loss does not use them); "
                          "set train.find_unused_parameters=true (and train.static_graph=true if the same "
                          "parameters are unused every step)")


def unused_parameters_error(exc: BaseException) -> ConfigError | None:
    """DDP's reduction error ('Expected to have finished reduction in the prior iteration ...') as one
    line naming the key that fixes it; None for any other exception."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" in text or \
            "find_unused_parameters=True" in text and "reduction" in text:
        return ConfigError(UNUSED_PARAMETERS_HINT)
    return None


def wrap(exc: Exception, *, rank: int, step: int, roots: tuple[str, ...], leaving: bool) -> Exception | None:
    """What a worker raises for ``exc``, raised in its train, eval or script function at global ``step``
    (``roots``: the folders of the user's plug-in code; ``leaving``: the group was told to leave). None: the
    kit's own error or Ray's, raised as it is (and logged by Ray Train)."""
    if isinstance(exc, (ConfigError, RunHeld, StorageError, UserCodeError, Preempted, Stopped, Diverged,
                        StorageUnavailable, PeerLost)):
        return exc  # already a row of the table
    if isinstance(exc, ShardError):  # a shard that does not match its manifest: bad input, not retried
        return PluginError(str(exc))
    unused = unused_parameters_error(exc)
    if unused is not None:  # the same on every restart
        return unused
    lost = PeerLost.of(exc, rank, leaving=ray_seam.group_torn_down(exc))
    if lost is not None:  # another rank's failure reached this one: the restart line names the cause
        return lost
    if isinstance(exc, DataPipelineError):  # the user's data: a bug unless the next attempt passes
        return UserCodeError.from_data_pipeline(exc, rank, step)
    wrapped = UserCodeError.from_exception(exc, rank, step, roots)
    if wrapped is None and leaving:  # an error after the notice to leave (a group Ray tears down)
        return PeerLost.of(exc, rank, leaving=True)
    return wrapped


# ---------------------------------------------------------------- the failure policy: decide


@dataclass
class Decision:
    """What the policy does with one worker group's failure: ``action`` STOP, RETRY or RETRY_FREE
    (RETRY is Ray's counted restart, which Ray may turn into a stop when ``failure.max_failures`` is spent);
    ``line``: the restart's one line without its count (empty: none)."""

    action: str
    line: str = ""


class FailureHistory:
    """What the policy remembers between attempts: the fingerprints of the user's errors last time."""

    def __init__(self):
        self.last_fingerprints: set[str] = set()

    def decide(self, failures: dict[int, BaseException], controller_error: BaseException | None = None) -> Decision:
        """The decision for one failed attempt (``failures``: each failed rank's error, as the worker raised
        it; ``controller_error``: the controller's own, a group that did not start)."""
        errors = [failures[r] for r in sorted(failures)]
        if any(kind_of(e).decision == STOP for e in errors):
            return Decision(STOP)
        if errors and all(isinstance(e, Preempted) for e in errors):
            return Decision(RETRY_FREE)
        user = [e for e in errors if isinstance(e, UserCodeError)]
        fingerprints = {e.fingerprint for e in user}
        recurring = bool(fingerprints & self.last_fingerprints)
        self.last_fingerprints = fingerprints
        if recurring:
            return Decision(STOP)
        return Decision(RETRY, restart_cause(failures, controller_error))


def restart_cause(failures: dict[int, BaseException], controller_error: BaseException | None = None) -> str:
    """One line naming why a worker group failed: the user's error (once it recurs at the same step the run
    stops), the store, a worker's own error before a rank that only lost its peers (``PeerLost``), or the
    controller's (a group that did not start in time)."""
    if controller_error is not None:
        failure = getattr(controller_error, "controller_failure", controller_error)
        return f"{type(failure).__name__}: {first_line(failure).split('. ')[0]}"  # Ray's hints left out
    first = failed_first(failures)
    if first is None:
        return ""
    rank, error = first
    if isinstance(error, UserCodeError):
        return (f"rank {error.rank} raised in your code {error.where}: {error.summary} "
                "(retried: the same error at the same step again ends the run)")
    if isinstance(error, (StorageUnavailable, PeerLost)):
        return first_line(error)
    return f"rank {rank}: {type(error).__name__}: {first_line(error)}"


def failed_first(failures: dict[int, BaseException]) -> tuple[int, BaseException] | None:
    """The rank a restart's line names and its error: a worker's own error before a rank that only lost its
    peers (``PeerLost``), the lowest rank first; None for no failed rank."""
    ranked = sorted(failures.items(), key=lambda item: (isinstance(item[1], PeerLost), item[0]))
    return ranked[0] if ranked else None


def restart_line(cause: str, count: str) -> str:
    """The one line a restart prints (``count``: which restart, against which budget)."""
    then = "" if cause.startswith("storage ") else "; the worker group restarts from the newest committed checkpoint"
    return f"ray-app: {cause}{then} ({count})"


# ---------------------------------------------------------------- the driver: what it raises


def at_driver(error: BaseException, *, interrupted: bool, resume_command: str) -> Exception:
    """The exception the driver raises for a run that ended on ``error`` (Ray Train's, with each failed
    rank's error), after writing the user's traceback once to stderr for their own error."""
    failures = getattr(error, "worker_failures", None) or {}
    by_rank = [failures[r] for r in sorted(failures)]
    if by_rank and all(isinstance(e, Stopped) for e in by_rank):
        stopped = first_line(by_rank[0])
        if interrupted:
            return RunInterrupted(f"interrupted: {stopped}; resume with: {resume_command}")
        return RunStopped(stopped)
    for kind in (DIVERGED, BAD_INPUT_KIND):
        found = [e for e in by_rank if isinstance(e, kind.worker_raises)]
        if found:
            return kind.driver_raises(first_line(found[0], limit=1000))
    user = [e for e in by_rank if isinstance(e, UserCodeError)]
    if user:
        shown = user[0]
        sys.stderr.write(f"ray-app: rank {shown.rank} raised in your code {shown.where}:\n{shown.traceback_text}")
        sys.stderr.flush()
        return TrainingFailed(f"{shown.summary} (rank {shown.rank}, {shown.where}; {shown.shown_above} above)")
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return TrainingFailed((lines[-1] if lines else type(error).__name__)[:500])


# ---------------------------------------------------------------- the command line: exit code, one line


def exit_code(exc: BaseException) -> int | None:
    """The exit code a command ends with for ``exc``; None for an exception the kit did not raise on purpose."""
    if isinstance(exc, BAD_INPUT):
        return EXIT_BAD_INPUT
    if isinstance(exc, TrainingFailed):
        return EXIT_FAILED
    if isinstance(exc, RunStopped):
        return EXIT_STOPPED
    if isinstance(exc, (RunInterrupted, KeyboardInterrupt)):
        return EXIT_INTERRUPTED
    return None


def one_line(exc: BaseException) -> str:
    """The line a command ends with on stderr for ``exc``."""
    if isinstance(exc, BAD_INPUT):
        return f"ray-app: error: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return "ray-app: interrupted"
    return f"ray-app: training failed: {exc}" if isinstance(exc, TrainingFailed) else f"ray-app: {exc}"
