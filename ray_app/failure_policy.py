"""How the kit tells a bug from a fault when a worker group fails (runs in Ray Train's controller).

- Bad input found by a worker (a ``ConfigError``, e.g. a plug-in that breaks its contract or a
  data folder laid out wrongly) ends the run at once: it would fail the same way on every restart.
- An exception raised in the user's code (``UserCodeError``) is retried once, like a fault: data on a
  network file system may be back a moment later. If the next attempt fails with the same
  exception, message, place in the user's code and global step, it is a bug: the run ends there
  instead of burning the remaining ``failure.max_failures`` restarts.
- Preemption (every rank raised ``Preempted`` after the checkpoint it agreed on was committed)
  restarts the group from that checkpoint without counting against ``failure.max_failures``, as Ray
  Train counts its own preemptions separately.
- Divergence (``Diverged``: a non-finite loss or gradient with ``train.nonfinite: stop``) ends the run: a
  restart from the newest checkpoint would diverge again the same way.
- A stop (every rank raised ``Stopped`` after the checkpoint of the driver's stop request was
  committed) ends the run: the driver was told to stop.
- Everything else (a killed or lost worker, a collective that failed, storage errors) follows Ray
  Train's default policy: restart from the newest checkpoint up to ``failure.max_failures``.
- A store that did not answer within ``failure.storage_retry_s`` (``StorageUnavailable``, an expected
  fault) is shown as one line per restart, here, where the decision is made; the workers do not log it.
- Every other restart is one line too, naming its cause: a worker's own error (a killed process, a lost
  node) before the ranks that only lost a peer in a collective (``PeerLost``, whose tracebacks the workers
  do not log), or the controller's (a group that did not start in time).
"""

from __future__ import annotations

from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure
from ray.train.v2.api.exceptions import ControllerError

from ray_app.errors import ConfigError, Diverged, PeerLost, Preempted, Stopped, StorageUnavailable, UserCodeError, first_line


class KitFailurePolicy(DefaultFailurePolicy):
    def __init__(self, failure_config):
        super().__init__(failure_config)
        self._last_fingerprints: set[str] = set()

    def make_decision(self, training_failed_error) -> FailureDecision:
        errors = list((getattr(training_failed_error, "worker_failures", None) or {}).values())
        if any(isinstance(e, (ConfigError, Stopped, Diverged)) for e in errors):
            return FailureDecision.RAISE
        if errors and all(isinstance(e, Preempted) for e in errors):
            return FailureDecision.RETRY
        fingerprints = {e.fingerprint for e in errors if isinstance(e, UserCodeError)}
        recurring = bool(fingerprints & self._last_fingerprints)
        self._last_fingerprints = fingerprints
        if recurring:
            return FailureDecision.RAISE
        decision = super().make_decision(training_failed_error)
        if decision != FailureDecision.RETRY or fingerprints:  # the user's error: shown once, by the driver
            return decision
        limit = self.failure_config.max_failures
        restart = f"restart {self._worker_group_failures} of {'unlimited' if limit == -1 else limit}: failure.max_failures"
        storage = [e for e in errors if isinstance(e, StorageUnavailable)]
        if storage:
            print(f"ray-app: {first_line(storage[0])} ({restart})", flush=True)
            return decision
        cause = _cause(training_failed_error, errors)
        if cause:
            if _is_preemption_failure(training_failed_error):
                restart = "a preemption: not counted against failure.max_failures"
            elif isinstance(training_failed_error, ControllerError):
                restart = f"{self._controller_failures} of the controller's retries"
            print(f"ray-app: {cause}; the worker group restarts from the newest committed checkpoint ({restart})",
                  flush=True)
        return decision


def _cause(training_failed_error, errors: list) -> str:
    """One line naming why a worker group failed: a worker's own error before a rank that only lost its
    peers (``PeerLost``), or the controller's (a group that did not start in time)."""
    if isinstance(training_failed_error, ControllerError):
        failure = getattr(training_failed_error, "controller_failure", training_failed_error)
        return f"{type(failure).__name__}: {first_line(failure).split('. ')[0]}"  # Ray's hints left out
    ranked = sorted((getattr(training_failed_error, "worker_failures", None) or {}).items(),
                    key=lambda item: isinstance(item[1], PeerLost))
    if not ranked:
        return ""
    rank, error = ranked[0]
    return first_line(error) if isinstance(error, PeerLost) else f"rank {rank}: {type(error).__name__}: {first_line(error)}"
