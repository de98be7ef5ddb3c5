"""ray_app: PyTorch DDP training on Ray Train, from a laptop to a GPU cluster.

The folders say where code runs (the README's map names every module):

    ray_app/driver/       the ``ray-app`` process: CLI, preflight, the lease, Ray and the TorchTrainer, sweeps
    ray_app/controller/   Ray Train's controller actor: failure and scaling policies, backend, hang verdicts
    ray_app/worker/       each rank: the entry point, the loop, strategy, evaluation, pace, preemption
    ray_app/shared/       what every process imports: config, errors and the failure table, storage, the
                          checkpoint catalog, plug-ins, tasks, data, models, the Ray seam

A worker or controller module never imports a driver one; a shared one imports none of the three
(``tests/unit/test_import_graph.py``). The modules' names from before the rooms still import: ``MOVED``
says where each went, and ``import ray_app.config`` gives the module at its new home (the same module
object, so a patch of the old name patches the real one). Users' ``from ray_app import script`` is one of them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__version__ = "0.1.0"

# old name -> new home (a tuple: a module split along its processes; the old name finds each name in them)
MOVED: dict[str, str | tuple[str, ...]] = {
    "cli": "driver.cli", "config_reference": "driver.config_reference", "runs": "driver.runs",
    "sweep": "driver.sweep", "sweep_space": "driver.sweep_space",
    "failure_policy": "controller.failure_policy", "scaling_policy": "controller.scaling_policy",
    "backend": "controller.backend",
    "loop": "worker.loop", "parts": "worker.parts", "strategy": "worker.strategy", "ddp": "worker.ddp",
    "guards": "worker.guards", "evaluation": "worker.evaluation", "progress": "worker.progress",
    "pace": "worker.pace", "resume": "worker.resume", "checkpoint": "worker.checkpoint",
    "sharded": "worker.sharded", "collectives": "worker.collectives", "metrics": "worker.metrics",
    "podlabel": "worker.podlabel", "tracking": "worker.tracking",
    "script": "worker.script",  # users' save / load; the driver's check of SCRIPT is ray_app.driver.script
    "config": "shared.config", "modelnames": "shared.modelnames", "errors": "shared.errors",
    "failures": "shared.failures", "storage": "shared.storage", "retry": "shared.retry", "s3fs": "shared.s3fs",
    "catalog": "shared.catalog", "journal": "shared.journal", "lease": "shared.lease",
    "plugins": "shared.plugins", "tasks": "shared.tasks", "data": "shared.data", "models": "shared.models",
    "shards": "shared.shards", "ray_seam": "shared.ray_seam",
    "hang": ("shared.reports", "worker.watchdog", "controller.hang_verdict"),
    "preemption": ("worker.preemption", "driver.signals"),
}
# ray_app.driver and ray_app.worker were modules and are rooms now: their old names are the packages'
# (ray_app.driver.launcher's and ray_app.worker.entry's), see each package's __init__.


_REAL_SPECS: dict = {}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module at its new home (or, for a split module, a module whose
    attributes are looked up in each of its new homes)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.partition(".")
        if package != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        homes = MOVED[spec.name.split(".", 1)[1]]
        if isinstance(homes, str):
            module = importlib.import_module(f"{__name__}.{homes}")
            _REAL_SPECS[spec.name] = module.__spec__  # the import system sets __spec__ to ours: put it back
            return module
        parts = [importlib.import_module(f"{__name__}.{h}") for h in homes]
        split = types.ModuleType(spec.name, f"{spec.name} was split along its processes into "
                                 + ", ".join(p.__name__ for p in parts))

        def __getattr__(name):
            for part in parts:
                if hasattr(part, name):
                    return getattr(part, name)
            raise AttributeError(f"module {spec.name!r} has no attribute {name!r}")

        split.__getattr__ = __getattr__
        return split

    def exec_module(self, module):
        real = _REAL_SPECS.pop(module.__spec__.name, None)
        if real is not None:
            module.__spec__ = real


sys.meta_path.append(_MovedModules())


def former_module(package: str, module: str):
    """The ``__getattr__`` of a room that was one module (``ray_app.driver``, ``ray_app.worker``): a name the
    room's package does not have is read from ``module`` (where the old module's code went), except the
    room's own modules, which the import system imports."""
    import os

    folder = os.path.join(os.path.dirname(__file__), package.rsplit(".", 1)[-1])

    def __getattr__(name: str):
        if name.startswith("__") or os.path.exists(os.path.join(folder, f"{name}.py")):
            raise AttributeError(name)
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
