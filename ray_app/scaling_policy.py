"""Ray Train's fixed-size scaling policy without its autoscaling coordinator (runs in Ray Train's controller).

Ray Train's scaling policies send the run's resource needs to Ray's autoscaling coordinator, a detached
actor that passes them on to an autoscaler. Starting that actor is one more Python process importing
Ray between the controller's start and the worker group's: ~2.4 s of every run's start-up on 2 cores.
A local Ray the kit started itself has no autoscaler to tell, and a fixed-size group asks for exactly
the placement group it then waits on, so there the kit hands the controller this policy instead.
Clusters (``RAY_ADDRESS``: KubeRay, the cluster of containers) and elastic runs keep Ray's own.
"""

from __future__ import annotations

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


def without_autoscaler(policy):
    """``policy`` as a ``FixedPolicyWithoutAutoscaler`` when it is Ray's fixed-size policy; else unchanged
    (an elastic policy reads the coordinator's reservations)."""
    if type(policy) is not FixedScalingPolicy:
        return policy
    return FixedPolicyWithoutAutoscaler(policy.scaling_config)
