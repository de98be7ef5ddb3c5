"""The driver's own SIGTERM or SIGINT (``ray job stop``, ``docker stop`` of the driver's container, Ctrl-C):
a request to the workers to checkpoint at the next step boundary and stop (``ray_app.worker.preemption`` acts
on it)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


@contextlib.contextmanager
def stop_on_sigterm(enabled: bool = True):
    """Driver side, around the trainer's ``fit``: the first SIGTERM or SIGINT (Ctrl-C) asks the workers
    (through Ray's key-value store) to checkpoint at the next step boundary and stop; a second one does
    what that signal did before (the CLI's: interrupt). Yields the list of signals received (the first
    one says how the run ended: 143 for SIGTERM, 130 for SIGINT)."""
    received: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield received
        return
    import ray

    from ray_app.shared import ray_seam

    key = ray_seam.stop_key(ray.get_runtime_context().get_job_id())
    previous = {}

    def give_up(signum):
        signal.signal(signum, previous[signum])
        signal.raise_signal(signum)

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if received:
            give_up(signum)
            return
        received.append(signum)
        try:
            ray_seam.kv_put(key, b"1")
        except Exception as exc:  # Ray is going away: nothing left to ask
            print(f"ray-app: {name}: could not ask the workers to stop ({exc})", file=sys.stderr, flush=True)
            give_up(signum)
            return
        print(f"ray-app: {name}: the workers checkpoint at the next step boundary, then the run stops "
              f"(a second {name} stops it now)", file=sys.stderr, flush=True)

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, on_signal)
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            with contextlib.suppress(Exception):
                ray_seam.kv_del(key)
