"""The failure table: for each kind of failure, how a worker recognises and wraps it, what the failure
policy decides, what the driver raises, the exit code and the one line the user sees.

``TABLE`` is data, and the worker (``wrap``), the failure policy in Ray Train's controller (``decide``,
``kind_of``), the driver (``at_driver``, ``controller_died``), the command line (``exit_code``, ``one_line``) and
sweeps read it and nothing else: change a row, and the behaviour changes. The exceptions themselves live in
``ray_app.shared.errors``. A row's worker classes say what the policy decides (the first row one matches;
an error no row names is Ray's own); its driver classes say what a command ends with (the first row one
matches: its exit code and its line). Rows that share a class agree on what that side decides (a unit
test checks): the workers raise ``Stopped`` for a stop and an interrupt alike, and the driver tells the two
apart by the signal it was sent. This prose table is the rows' (``tests/unit/test_failures.py`` reads it).

============================  ===================================  ==============================  ==================  ====  =====================
kind                          a worker raises                      the policy                      the driver raises   exit  the line (ray-app: ...)
============================  ===================================  ==============================  ==================  ====  =====================
bad input                     ConfigError (PluginError; a shard    stop                            UserError (from a   2     error: {}
                              that fails its manifest; DDP's                                       worker); from the
                              unused-parameters error); RunHeld                                    driver's own work:
                              (another driver took the run over:                                   ConfigError,
                              no commit); StorageError (a full                                     RunHeld,
                              disk, access denied)                                                 StorageError,
                                                                                                   CheckpointError,
                                                                                                   ShardError
the user's error              UserCodeError (fingerprint: type,    restart; the same again: stop   TrainingFailed,     1     training failed: {}
                              message, place, global step)         (one line naming it; the same   traceback once
                                                                   fingerprint: the same error)
divergence                    Diverged (every rank, same step)     stop                            TrainingFailed      1     training failed: {}
a stop                        Stopped (after the checkpoint)       stop                            RunStopped          143   {}
(the driver's SIGTERM)
an interrupt                  Stopped (after the checkpoint)       stop                            RunInterrupted      130   {}
(the driver's SIGINT)
preemption                    Preempted (after the checkpoint)     restart, not counted            -                   -     -
storage unavailable           StorageUnavailable                   restart (one line, counted)     TrainingFailed      1     training failed: {}
a lost peer                   PeerLost (a failed collective, Ray   restart (counted; the line      TrainingFailed      1     training failed: {}
                              Train's own call failing as it       names the rank that failed)
                              tears the group down, or any error
                              after the notice)
a killed worker, a hang       (Ray's: the actor died, the health   restart (one line, counted)     TrainingFailed      1     training failed: {}
                              check or a collective timed out)
a group that did not start    (Ray's controller: start timeout)    restart (one line)              TrainingFailed      1     training failed: {}
storage at a command's start  (the driver's own reads past the     -                               StorageUnavailable  2     error: {}
                              budget: eval's or a warm start's
                              checkpoint, ``ray-app checkpoints``)
an interrupt elsewhere        (none: SIGINT, or a SIGTERM outside  -                               KeyboardInterrupt   130   interrupted
                              a run's stop)
============================  ===================================  ==============================  ==================  ====  =====================

Every restart is one line (``restart_line``); a command that ends on a failure is one line at the driver
(``one_line``, the row's line with the exception's message for ``{}``), the user's traceback once before it
for their own error. A hang's restart line follows the hang report's line (``ray_app.shared.reports``: the
rank that did not reach the collective the others wait in, and where their stacks are). Where Ray Train's
controller itself dies (its storage set-up gave up), the kit's error in Ray's text is read by its row
(``controller_died``).
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
    last_line,
)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 128 + signal.SIGTERM, 130

STOP, RETRY, RETRY_FREE, RETRY_ONCE = "stop", "restart", "restart, not counted", "restart; the same again: stop"

ERROR, FAILED, AS_RAISED = "ray-app: error: {}", "ray-app: training failed: {}", "ray-app: {}"


@dataclass(frozen=True)
class Kind:
    """One row of the table."""

    name: str
    worker_raises: tuple[type[BaseException], ...]  # what a worker raises for it (empty: Ray's error, or no worker's)
    decision: str | None  # what the policy does with it: STOP, RETRY, RETRY_FREE or RETRY_ONCE (classes with a
    # ``fingerprint``); None: the policy never sees it
    driver_raises: tuple[type[BaseException], ...]  # what a command ends on; the first is what the driver raises for
    # a run that ended on it (empty: no command ends on it)
    exit_code: int | None  # the command's exit code (None: no command ends on it)
    line: str  # the one line a command ends with, ``{}`` its exception's message ("": none)


BAD_INPUT_KIND = Kind("bad input", (ConfigError, RunHeld, StorageError), STOP,
                      (UserError, ConfigError, RunHeld, StorageError, CheckpointError, ShardError), EXIT_BAD_INPUT, ERROR)
USER_ERROR = Kind("the user's error", (UserCodeError,), RETRY_ONCE, (TrainingFailed,), EXIT_FAILED, FAILED)
DIVERGED = Kind("divergence", (Diverged,), STOP, (TrainingFailed,), EXIT_FAILED, FAILED)
STOPPED = Kind("a stop", (Stopped,), STOP, (RunStopped,), EXIT_STOPPED, AS_RAISED)
INTERRUPTED = Kind("an interrupt", (Stopped,), STOP, (RunInterrupted,), EXIT_INTERRUPTED, AS_RAISED)
PREEMPTED = Kind("preemption", (Preempted,), RETRY_FREE, (), None, "")
STORAGE = Kind("storage unavailable", (StorageUnavailable,), RETRY, (TrainingFailed,), EXIT_FAILED, FAILED)
LOST_PEER = Kind("a lost peer", (PeerLost,), RETRY, (TrainingFailed,), EXIT_FAILED, FAILED)
RAYS_OWN = Kind("a killed worker, a hang", (), RETRY, (TrainingFailed,), EXIT_FAILED, FAILED)
NOT_STARTED = Kind("a group that did not start", (), RETRY, (TrainingFailed,), EXIT_FAILED, FAILED)
# a store that did not answer a command's own reads (before any worker: eval's checkpoint, a warm start's,
# `checkpoints`) within failure.storage_retry_s is named as the preflight names an unreachable one
STORAGE_AT_START = Kind("storage at a command's start", (), None, (StorageUnavailable,), EXIT_BAD_INPUT, ERROR)
INTERRUPTED_ELSEWHERE = Kind("an interrupt elsewhere", (), None, (KeyboardInterrupt,), EXIT_INTERRUPTED,
                             "ray-app: interrupted")

TABLE = (BAD_INPUT_KIND, USER_ERROR, DIVERGED, STOPPED, INTERRUPTED, PREEMPTED, STORAGE, LOST_PEER, RAYS_OWN,
         NOT_STARTED, STORAGE_AT_START, INTERRUPTED_ELSEWHERE)


def kind_of(error: BaseException) -> Kind:
    """The row of one worker's (or the controller's) error: the first whose worker classes it is one of; Ray's
    own error when none is."""
    return next((kind for kind in TABLE if isinstance(error, kind.worker_raises)), RAYS_OWN)


def kind_at_driver(error: type[BaseException]) -> Kind | None:
    """The row a command ends on for an exception of the class ``error`` at the driver: the first whose driver
    classes it is one of; None for an exception the kit did not raise on purpose."""
    return next((kind for kind in TABLE if issubclass(error, kind.driver_raises)), None)


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
    if any(isinstance(exc, kind.worker_raises) for kind in TABLE):
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
        decisions = [kind_of(e).decision for e in errors]
        if STOP in decisions:
            return Decision(STOP)
        if decisions and all(d == RETRY_FREE for d in decisions):
            return Decision(RETRY_FREE)
        fingerprints = {e.fingerprint for e, d in zip(errors, decisions) if d == RETRY_ONCE}
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
    by_rank = [(failures[r], kind_of(failures[r])) for r in sorted(failures)]
    if by_rank and all(kind is STOPPED for _, kind in by_rank):  # every rank stopped: the driver's signal says which
        stopped = first_line(by_rank[0][0])
        if interrupted:
            return INTERRUPTED.driver_raises[0](f"interrupted: {stopped}; resume with: {resume_command}")
        return STOPPED.driver_raises[0](stopped)
    for ended in (DIVERGED, BAD_INPUT_KIND):
        found = [e for e, kind in by_rank if kind is ended]
        if found:
            return ended.driver_raises[0](first_line(found[0]))
    user = [e for e, kind in by_rank if kind is USER_ERROR]
    if user:
        shown = user[0]
        sys.stderr.write(f"ray-app: rank {shown.rank} raised in your code {shown.where}:\n{shown.traceback_text}")
        sys.stderr.flush()
        return USER_ERROR.driver_raises[0](f"{shown.summary} (rank {shown.rank}, {shown.where}; {shown.shown_above} above)")
    return RAYS_OWN.driver_raises[0](last_line(error))


KIT_ERRORS = "ray_app.shared.errors."  # how Ray's text of a remote error names the kit's: module, class, ": "


def controller_died(error: BaseException) -> Exception:
    """The exception the driver raises when Ray Train's controller died (``error``: Ray's, with the controller's
    traceback as text): the row of the kit's own error in it (``StorageUnavailable``: its storage set-up gave up
    after ``failure.storage_retry_s``), the last one named; else Ray's own, its last line."""
    from ray_app.shared import errors

    for line in reversed(str(error).splitlines()):
        name, _, message = line.strip().partition(": ")
        raised = getattr(errors, name.removeprefix(KIT_ERRORS), None) if name.startswith(KIT_ERRORS) else None
        if isinstance(raised, type) and issubclass(raised, BaseException):
            kind = next((k for k in TABLE if issubclass(raised, k.worker_raises) and k.driver_raises), None)
            if kind is not None:
                return kind.driver_raises[0](first_line(message or name))
    return RAYS_OWN.driver_raises[0](last_line(error))


# ---------------------------------------------------------------- the command line: exit code, one line


def exit_code(exc: BaseException) -> int | None:
    """The exit code a command ends with for ``exc``: its row's at the driver; None for an exception the kit did
    not raise on purpose."""
    kind = kind_at_driver(type(exc))
    return None if kind is None else kind.exit_code


def one_line(exc: BaseException) -> str:
    """The line a command ends with on stderr for ``exc``: its row's at the driver, with ``exc``'s message."""
    kind = kind_at_driver(type(exc))
    return (AS_RAISED if kind is None else kind.line).format(exc)
