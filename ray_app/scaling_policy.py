"""Ray Train's fixed-size scaling policy without its autoscaling coordinator (runs in Ray Train's controller).

Ray Train's scaling policies send the run's resource needs to Ray's autoscaling coordinator, a detached
actor that passes them on to an autoscaler. Starting that actor is one more Python process importing
Ray between the controller's start and the worker group's: ~2.4 s of every run's start-up on 2 cores.
A local Ray the kit started itself has no autoscaler to tell, and a fixed-size group asks for exactly
the placement group it then waits on, so there the kit hands the controller this policy instead.
Clusters (``RAY_ADDRESS``: KubeRay, the cluster of containers) keep Ray's own.

An elastic run (``scaling.min_workers``) gets ``ElasticPolicyThatLearns``: Ray's elastic policy sizes a
new group to the nodes its view of the cluster counts, and just after a node is lost that view still
counts it (until Ray's health checks find the node dead and the coordinator's next look, every 20 s).
A group of N placed on that view never starts; Ray Train waits its start timeout and asks for N again,
as long as the view lags (twice in a row, 40 s, in the e2e cluster of containers). After a group of N
did not start, this policy asks for N - 1 (never below ``min_workers``) while the view shows the same
nodes, for at most ``FEWER_FOR_S``: a node that leaves or joins the view ends that, and so does time (a
group can also miss its start timeout on nodes that are all alive, a fresh node slow to start its first
worker: the view was right, and the group grows back to it at the next resize check after that).
"""

from __future__ import annotations

import time

from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy


class _NoCoordinator:
    """Stands where Ray Train's coordinator client would: sends nothing (no autoscaler would read it)."""

    def maybe_send_resource_request(self, *args, **kwargs) -> None:
        pass

    def send_resource_request(self, *args, **kwargs) -> None:
        pass

    def cancel_resource_request(self) -> None:
        pass


class FixedPolicyWithoutAutoscaler(FixedScalingPolicy):
    def after_controller_start(self, train_run_context) -> None:
        self._coordinator_client = _NoCoordinator()


class ElasticPolicyThatLearns(ElasticScalingPolicy):
    # A lost node leaves the view within ~45 s (Ray's health checks, then the coordinator's next look):
    # past that, the same view is no longer a lagging one.
    FEWER_FOR_S = 60.0

    def __init__(self, scaling_config, clock=time.monotonic):
        super().__init__(scaling_config)
        self._clock = clock
        # (the nodes in view, the most workers to ask for there, until when)
        self._fewer: tuple[frozenset, int, float] | None = None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        super().after_controller_state_update(previous_state, current_state)
        failed = getattr(getattr(current_state, "training_failed_error", None), "controller_failure", None)
        if isinstance(failed, WorkerGroupStartupTimeoutError) and self._latest_reserved_resources:
            most = max(self.scaling_config.min_workers, failed.num_workers - 1)
            self._fewer = (frozenset(self._latest_reserved_resources), most, self._clock() + self.FEWER_FOR_S)

    def _count_possible_workers(self, reserved_resources) -> int:
        count = super()._count_possible_workers(reserved_resources)
        if self._fewer is not None:
            nodes, most, until = self._fewer
            if frozenset(reserved_resources) == nodes and self._clock() < until:
                return min(count, most)
            self._fewer = None  # the view changed (a node gone or joined), or long enough: it counts again
        return count


def elastic_that_learns(policy):
    """``policy`` as an ``ElasticPolicyThatLearns`` when it is Ray's elastic policy; else unchanged."""
    if type(policy) is not ElasticScalingPolicy:
        return policy
    return ElasticPolicyThatLearns(policy.scaling_config)


def without_autoscaler(policy):
    """``policy`` as a ``FixedPolicyWithoutAutoscaler`` when it is Ray's fixed-size policy; else unchanged
    (an elastic policy reads the coordinator's reservations)."""
    if type(policy) is not FixedScalingPolicy:
        return policy
    return FixedPolicyWithoutAutoscaler(policy.scaling_config)
