"""Preemption: a notice to leave becomes a checkpoint at the next step boundary, agreed by every rank.

A notice is a SIGTERM to a worker's process (a node drain, ``kill``, a container stopped with a
grace period) or Ray's drain notice for the worker's node (``ray drain-node``, the autoscaler, a
``ray start --block`` node sent SIGTERM, as ``docker stop`` and a pod's deletion do), which
``watch`` polls every 2 s. Either sets this process's ``NOTICE`` (kind ``PREEMPT``). The driver's
own SIGTERM (``ray job stop``, ``docker stop`` of the driver's container) or SIGINT (Ctrl-C) is a request to stop
(kind ``STOP``): the driver's ``ray_app.driver.signals.stop_on_sigterm`` writes it into Ray's key-value store under the job's id, and
``watch`` reads that key every 0.5 s. The training loop's ``Agreement`` carries one flag per optimizer step on an all-reduce
(MAX) that is started after a step and read after the next, so it overlaps a whole step of work and
every rank reads the same answer at the same step (the highest kind any rank posted). When it
says yes, the loop checkpoints there, waits until the checkpoint is committed, and every rank
raises ``Preempted`` (the kit's failure policy restarts the worker group without using up
``failure.max_failures``, and the new group resumes from that checkpoint: no completed step is
lost) or, on a stop, ``Stopped`` (the run ends; submitting it again resumes there).

``failure.preemption_checkpoint: false`` keeps Ray's behaviour: a SIGTERM ends the worker at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from ray_app.worker.collectives import entered

PREEMPT, STOP = 1, 2  # the kinds of notice, in the order the agreement's MAX ranks them
NOTICE = threading.Event()
_KIND = [0]  # the highest kind noticed by this process
TRAINING = threading.Event()  # set while the training loop runs: only there can a notice be acted on
_RAYS_HANDLER: list = []  # what SIGTERM did before install(): Ray's exit
_UNSAID: list[str] = []  # a notice's line, said once the ranks agree to act on it


def notify(why: str, kind: int = PREEMPT, say_now: bool = True) -> None:
    """Set the notice. Its line is said now, or (``say_now=False``: a SIGTERM, which is also how Ray tears a
    group down after another rank failed) only once every rank has agreed to act on it."""
    first = not NOTICE.is_set()
    _KIND[0] = max(_KIND[0], kind)
    NOTICE.set()
    if first:
        then = "then stopping" if kind == STOP else "then leaving"
        line = f"ray-app: {why}: checkpointing at the next step boundary, {then}"
        if say_now:
            print(line, file=sys.stderr, flush=True)
        else:
            _UNSAID[:] = [line]


def say_agreed() -> None:
    """The notice's line, if it was kept until the ranks agreed."""
    if _UNSAID:
        print(_UNSAID.pop(), file=sys.stderr, flush=True)


def _on_sigterm(signum, frame) -> None:
    """While the loop trains, the first SIGTERM is a notice (a flag the training thread acts on at a step
    boundary). Outside it (start-up, a group Ray tears down after an error or the end) and on a second
    SIGTERM, Ray's own handler runs: the worker exits."""
    if TRAINING.is_set() and not NOTICE.is_set():
        notify("SIGTERM", say_now=False)
        return
    previous = _RAYS_HANDLER[0] if _RAYS_HANDLER else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def install() -> threading.Thread:
    """In the worker process's main thread (Python runs signal handlers there): replaces Ray's
    exit-on-SIGTERM with the notice, and starts (and returns) the thread that watches Ray."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    if previous is not _on_sigterm:
        _RAYS_HANDLER[:] = [previous]
    watcher = threading.Thread(target=watch, name="ray-app-notice-watch", daemon=True)
    watcher.start()
    return watcher


def watch(interval_s: float = 0.5, drain_every: int = 4) -> None:
    """Poll Ray (GCS) for the driver's stop request (every ``interval_s``: one key read) and for a drain
    notice of this worker's node (every ``drain_every`` polls: a list of nodes); stop quietly where Ray
    is not initialized in this process or cannot answer. Never starts Ray."""
    try:
        import ray

        from ray_app.shared import ray_seam

        if not ray.is_initialized():
            return
        ctx = ray.get_runtime_context()
        node, key = ctx.get_node_id(), ray_seam.stop_key(ctx.get_job_id())
        polls = 0
        while not NOTICE.is_set():
            if ray_seam.kv_get(key) is not None:
                notify("the driver was told to stop", STOP)
                return
            if polls % drain_every == 0 and node in ray_seam.draining_nodes():
                notify("Ray's drain notice for this node")
                return
            polls += 1
            time.sleep(interval_s)
    except Exception:  # internal APIs of Ray: their absence must never stop training
        return



def worker_callback():
    """A Ray Train WorkerCallback that installs the notice in every worker's main thread, each start."""
    from ray_app.shared import ray_seam

    base = ray_seam.worker_callback_base()
    if base is None:  # without Ray's worker callbacks a SIGTERM ends a worker at once, as Ray does
        return None

    class PreemptionNotice(base):
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

    def poll(self) -> int:
        """0, or the kind of notice (``PREEMPT``, ``STOP``) every rank agrees to act on now."""
        if not self.enabled:
            return 0
        import torch.distributed as dist

        agreed = 0
        if self.work is not None:
            with entered("preemption flag (all_reduce)"):
                self.work.wait()  # sync point: the flags every rank posted one step earlier
            agreed = int(self.flag.item())
            if agreed:
                say_agreed()
        self.flag.fill_(float(_KIND[0]) if NOTICE.is_set() else 0.0)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def close(self) -> None:
        if self.work is not None:
            with entered("preemption flag (all_reduce)"):
                self.work.wait()
            self.work = None
