"""The workers' room: what every rank runs (the entry point, the loop, strategy, evaluation, pace,
checkpoints written, preemption agreed, script mode, rank 0's metrics and tracking). It never imports
from the driver's room.

``ray_app.worker`` was one module; its names (``worker_main``, ``ResultSlot``, ...) are now
``ray_app.worker.entry``'s and still read from here."""

from ray_app import former_module

__getattr__ = former_module(__name__, "entry")
