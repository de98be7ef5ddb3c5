"""The worker group's size as the kit asks for it (runs in Ray Train's controller).

Ray Train's scaling policies send the run's resource needs to Ray's autoscaling coordinator, a detached
actor that passes them on to an autoscaler. Starting that actor is one more Python process importing
Ray between the controller's start and the worker group's: ~2.4 s of every run's start-up on 2 cores.
A local Ray the kit started itself has no autoscaler to tell, and a fixed-size group asks for exactly
the placement group it then waits on, so there the kit hands the controller that policy without it.
Clusters (``RAY_ADDRESS``: KubeRay, the cluster of containers) keep Ray's own.

An elastic run (``scaling.min_workers``) gets Ray's elastic policy with ``FewerAfterStartTimeout``: Ray's elastic policy sizes a
new group to the nodes its view of the cluster counts, and just after a node is lost that view still
counts it (until Ray's health checks find the node dead and the coordinator's next look, every 20 s).
A group of N placed on that view never starts; Ray Train waits its start timeout and asks for N again,
as long as the view lags (twice in a row, 40 s, in the e2e cluster of containers). After a group of N
did not start, the rule asks for N - 1 (never below ``min_workers``) while the view shows the same
nodes, for at most ``FEWER_FOR_S``: a node that leaves or joins the view ends that, and so does time (a
group can also miss its start timeout on nodes that are all alive, a fresh node slow to start its first
worker: the view was right, and the group grows back to it at the next resize check after that).
"""

from __future__ import annotations

import time

from ray_app.shared import ray_seam


class FewerAfterStartTimeout:
    """The elastic rule: after a group of N did not start, at most N - 1 (never below ``min_workers``) while
    the view shows the same nodes, for at most ``FEWER_FOR_S``. Ray's elastic policy consults ``limit`` on
    each count and tells ``on_state`` each controller state (``ray_app.shared.ray_seam.elastic_with_limit``)."""

    # A lost node leaves the view within ~45 s (Ray's health checks, then the coordinator's next look):
    # past that, the same view is no longer a lagging one.
    FEWER_FOR_S = 60.0

    def __init__(self, scaling_config, clock=time.monotonic):
        self.min_workers = scaling_config.min_workers
        self._clock = clock
        # (the nodes in view, the most workers to ask for there, until when)
        self._fewer: tuple[frozenset, int, float] | None = None
        self._timeout = ray_seam.startup_timeout_error()

    def on_state(self, state, nodes) -> None:
        failed = getattr(getattr(state, "training_failed_error", None), "controller_failure", None)
        if isinstance(failed, self._timeout) and nodes:
            most = max(self.min_workers, failed.num_workers - 1)
            self._fewer = (frozenset(nodes), most, self._clock() + self.FEWER_FOR_S)

    def limit(self, count: int, nodes) -> int:
        if self._fewer is not None:
            seen, most, until = self._fewer
            if frozenset(nodes) == seen and self._clock() < until:
                return min(count, most)
            self._fewer = None  # the view changed (a node gone or joined), or long enough: it counts again
        return count


def controller_scaling_policy(policy, trainer):
    """The policy the controller gets: Ray's fixed-size one without the coordinator where the trainer runs
    on a Ray the kit started (``trainer.without_autoscaler``); Ray's elastic one with
    ``FewerAfterStartTimeout``; any other as it is."""
    if getattr(trainer, "without_autoscaler", False):
        policy = ray_seam.without_autoscaler(policy)
    return ray_seam.elastic_with_limit(policy, FewerAfterStartTimeout)
