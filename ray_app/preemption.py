"""Preemption: a notice to leave becomes a checkpoint at the next step boundary, agreed by every rank.

A notice is a SIGTERM to a worker's process (a node drain, ``kill``, a container stopped with a
grace period) or Ray's drain notice for the worker's node (``ray drain-node``, the autoscaler, a
``ray start`` node told to stop), which ``watch_drain`` polls every 2 s. Either sets this process's
``NOTICE``. The training loop's ``Agreement`` carries one flag per optimizer step on an all-reduce
(MAX) that is started after a step and read after the next, so it overlaps a whole step of work and
every rank reads the same answer at the same step. When it says yes, the loop checkpoints there,
waits until the checkpoint is committed, and every rank raises ``Preempted``; the kit's failure
policy restarts the worker group without using up ``failure.max_failures``, and the new group
resumes from that checkpoint: no completed step is lost.

``failure.preemption_checkpoint: false`` keeps Ray's behaviour: a SIGTERM ends the worker at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

NOTICE = threading.Event()
TRAINING = threading.Event()  # set while the training loop runs: only there can a notice be acted on
_RAYS_HANDLER: list = []  # what SIGTERM did before install(): Ray's exit


class Preempted(RuntimeError):
    """Every rank raises this after the preemption checkpoint is committed: restart the group from it."""


def notify(why: str) -> None:
    if not NOTICE.is_set():
        NOTICE.set()
        print(f"ray-app: {why}: checkpointing at the next step boundary, then leaving", file=sys.stderr, flush=True)


def _on_sigterm(signum, frame) -> None:
    """While the loop trains, the first SIGTERM is a notice (a flag the training thread acts on at a step
    boundary). Outside it (start-up, a group Ray tears down after an error or the end) and on a second
    SIGTERM, Ray's own handler runs: the worker exits."""
    if TRAINING.is_set() and not NOTICE.is_set():
        notify("SIGTERM")
        return
    previous = _RAYS_HANDLER[0] if _RAYS_HANDLER else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def install() -> None:
    """In the worker process's main thread (Python runs signal handlers there): replaces Ray's
    exit-on-SIGTERM with the notice, and starts the drain watch."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _RAYS_HANDLER[:] = [previous]
    threading.Thread(target=watch_drain, name="ray-app-drain-watch", daemon=True).start()


def watch_drain(interval_s: float = 2.0) -> None:
    """Poll Ray's draining nodes (GCS) for this worker's node; stop quietly where Ray cannot answer."""
    try:
        import ray
        from ray._private.state import state

        node = ray.get_runtime_context().get_node_id()
        while not NOTICE.is_set():
            if node in (state.get_draining_nodes() or {}):
                notify("Ray's drain notice for this node")
                return
            time.sleep(interval_s)
    except Exception:  # an internal API of Ray: its absence must never stop training
        return


def worker_callback():
    """A Ray Train WorkerCallback that installs the notice in every worker's main thread, each start."""
    from ray.train.v2._internal.execution.callback import WorkerCallback

    class PreemptionNotice(WorkerCallback):
        def after_init_train_context(self):
            install()

    return PreemptionNotice()


class Agreement:
    """Whether any rank has a notice, asked once per optimizer step on every rank. The answer is the
    flags posted one step earlier, so the all-reduce runs during a step; every rank gets the same
    answer at the same step. ``group``: a gloo group (the default one on CPU; one of its own with
    nccl, so the flag never waits on the GPU)."""

    def __init__(self, group=None, enabled: bool = True):
        import torch

        self.enabled, self.group = enabled, group
        self.flag = torch.zeros(1)
        self.work = None

    def poll(self) -> bool:
        if not self.enabled:
            return False
        import torch.distributed as dist

        agreed = False
        if self.work is not None:
            self.work.wait()
            agreed = bool(self.flag.item() > 0)
        self.flag.fill_(1.0 if NOTICE.is_set() else 0.0)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
