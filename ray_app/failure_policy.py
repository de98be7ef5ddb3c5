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
"""

from __future__ import annotations

from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

from ray_app.errors import ConfigError, Diverged, Preempted, Stopped, StorageUnavailable, UserCodeError


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
        storage = [e for e in errors if isinstance(e, StorageUnavailable)]
        if storage and decision == FailureDecision.RETRY:
            limit = self.failure_config.max_failures
            print(f"ray-app: {str(storage[0]).strip().splitlines()[0]} (restart {self._worker_group_failures} of "
                  f"{'unlimited' if limit == -1 else limit}: failure.max_failures)", flush=True)
        return decision
