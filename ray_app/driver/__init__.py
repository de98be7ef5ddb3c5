"""The driver's room: the ``ray-app`` process, before and around Ray (CLI commands, preflight, the lease,
Ray and the TorchTrainer, the summary, sweeps, runs). Nothing in the controller's, the workers' or the
shared rooms imports from here.

``ray_app.driver`` was one module; its names (``launch``, ``run_training``, ...) are now
``ray_app.driver.launcher``'s and still read from here."""

from ray_app import former_module

__getattr__ = former_module(__name__, "launcher")
