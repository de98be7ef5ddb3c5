"""Every rank counts the collectives it enters: a sequence number, the collective's name, the global step.

All ranks enter the same collectives in the same order, so after a hang the ranks' counters line up: the
ranks inside collective #K wait for the ranks whose counter stopped short of K (``ray_app.shared.reports`` reads them
and names those ranks). Counting costs one small object and a clock read per collective, no I/O and no lock:
the state is one frozen object, replaced whole, so the watchdog thread that reads it never sees half an
update.

The kit marks each of its sync points: the loop's gradient all-reduce in backward (counted once per
optimizer step: ``gradient all-reduce (backward)``), the global loss, the evaluation sums and gathers,
the preemption flag, the checkpoint's gather and Ray Train's report barrier.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """Where a rank is in the sequence of collectives."""

    seq: int = 0  # collectives entered so far (the one it is in, when ``inside``)
    name: str = ""  # the latest collective entered
    step: int = 0  # the global step then (the step being trained, during its backward)
    inside: bool = False  # still in it
    since: float = 0.0  # time.monotonic() when it entered or left it
    thread: int = 0  # the thread that entered it (Ray Train runs the train function on a thread of its own)

    def as_dict(self) -> dict:
        return {"seq": self.seq, "name": self.name, "step": self.step, "inside": self.inside}


class CollectiveCounter:
    """This process's count of collectives (``COUNTER``); ``entered(name)`` around each one."""

    def __init__(self):
        self.position = Position(since=time.monotonic())

    def reset(self, step: int = 0) -> None:
        """A new worker group: no collective entered yet."""
        self.position = Position(step=step, since=time.monotonic())

    def enter(self, name: str, step: int | None = None) -> None:
        p = self.position
        self.position = Position(p.seq + 1, name, p.step if step is None else step, True, time.monotonic(),
                                 threading.get_ident())

    def leave(self) -> None:
        p = self.position
        self.position = Position(p.seq, p.name, p.step, False, time.monotonic(), p.thread)

    @contextlib.contextmanager
    def entered(self, name: str, step: int | None = None):
        """Around one collective (every rank): counted as entered, left when it returns or raises."""
        self.enter(name, step)
        try:
            yield
        finally:
            self.leave()


COUNTER = CollectiveCounter()


def entered(name: str, step: int | None = None):
    """``COUNTER.entered(name, step)``: what the kit's sync points wrap their collective in."""
    return COUNTER.entered(name, step)
