"""How the kit tells a bug from a fault when a worker group fails (runs in Ray Train's controller).

The decision for each kind of failure is the table's (``ray_app.shared.failures``): bad input, divergence and a
stop end the run; preemption restarts without counting against ``failure.max_failures``; the user's own
error restarts once, and ends the run when the same error recurs at the same global step (a bug, not a
fault); everything else (a killed or lost worker, a hang, a lost peer, storage that did not answer within
``failure.storage_retry_s``) follows Ray Train's default policy: a restart from the newest checkpoint up
to ``failure.max_failures``. Every restart is one line, here, where the decision is made, naming its
cause; the workers do not log the errors this line names. Each restart, preemption and divergence is
also an event of the run journal (``ray_app.shared.journal``), with the cause as the line names it, the rank
and the step (``where_failed``): the driver's summary lists them (``restarts``).
"""

from __future__ import annotations

from ray_app.shared import failures, journal, ray_seam
from ray_app.shared.errors import Diverged, first_line

DefaultFailurePolicy, FailureDecision, is_preemption_failure = ray_seam.failure_policy_base()


class KitFailurePolicy(DefaultFailurePolicy):
    def __init__(self, failure_config, journal_of: tuple[str, str, str] | None = None, hang_reports=None):
        super().__init__(failure_config)
        self.history = failures.FailureHistory()
        self.journal_of = journal_of  # (run.storage, run.name, the launch's id): where its events go
        self.hang_reports = hang_reports  # ray_app.controller.hang_verdict.HangReports: the ranks' reports of a hang, if any

    def make_decision(self, training_failed_error) -> FailureDecision:
        failed = dict(getattr(training_failed_error, "worker_failures", None) or {})
        hang_step = None
        if self.hang_reports is not None:  # before the restart's line: who did not arrive, where the stacks are
            hang_line = self.hang_reports.line(failed)
            if hang_line:
                print(f"ray-app: {hang_line}", flush=True)
                self._journal("hang_report", cause=hang_line)
                hang_step = self.hang_reports.step
        controller = training_failed_error if not failed and hasattr(training_failed_error, "controller_failure") \
            else None
        decision = self.history.decide(failed, controller)
        if decision.action == failures.STOP:
            diverged = [e for e in failed.values() if isinstance(e, Diverged)]
            if diverged:
                self._journal("diverged", cause=first_line(diverged[0]))
            return FailureDecision.RAISE
        if decision.action == failures.RETRY_FREE:
            self._journal("preemption", cause=failures.restart_cause(failed, controller), **where_failed(failed))
            return FailureDecision.RETRY
        ray_decision = super().make_decision(training_failed_error)
        if ray_decision == FailureDecision.RETRY and decision.line:
            count = self._count(training_failed_error, controller)
            print(failures.restart_line(decision.line, count), flush=True)
            self._journal("restart", cause=decision.line, count=count, **where_failed(failed, hang_step))
        return ray_decision

    def _journal(self, kind: str, **fields) -> None:
        """One event of the run journal, written before the next attempt starts (at most a few seconds)."""
        if self.journal_of is None:
            return
        try:
            from ray_app.shared.storage import open_storage

            uri, run, launch = self.journal_of
            w = journal.writer(open_storage(uri), run, source="policy")
            if w is not None:
                w.record(kind, launch=launch, **fields)
                w.flush(5.0)
        except Exception:  # the journal never changes a decision
            pass

    def _count(self, training_failed_error, controller) -> str:
        worker_group, controller_failures = ray_seam.restarts_so_far(self)
        if is_preemption_failure(training_failed_error):
            return "a preemption: not counted against failure.max_failures"
        if controller is not None:
            return f"{controller_failures} of the controller's retries"
        limit = self.failure_config.max_failures
        return f"restart {worker_group} of {'unlimited' if limit == -1 else limit}: failure.max_failures"


def where_failed(failed: dict, hang_step: int | None = None) -> dict:
    """The rank a restart's line names and the global step where it failed, as far as known: its own error's
    step (the workers give every error they raise the step they were at: ``ray_app.worker.entry``), else the
    step of the collective a hang's line names (``hang_step``), else the furthest step another failed rank
    had reached (a killed worker says nothing; the ranks that lost it do); None where unknown (a group that
    did not start, a worker killed with no other rank's error or report)."""
    first = failures.failed_first(failed)
    if first is None:
        return {"rank": None, "step": None}
    rank, error = first
    if _step_of(error) is not None:
        return {"rank": rank, "step": _step_of(error)}
    if hang_step is not None:
        return {"rank": rank, "step": hang_step}
    others = [s for s in map(_step_of, failed.values()) if s is not None]
    return {"rank": rank, "step": max(others, default=None)}


def _step_of(error: BaseException) -> int | None:
    step = getattr(error, "step", None)  # -1: raised before training started
    return step if isinstance(step, int) and step >= 0 else None
