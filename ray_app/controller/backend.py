"""The torch process group under Ray Train, set up without importing torch in Ray Train's controller.

Ray Train's ``TorchConfig`` lives in a module that imports torch at its top, and the controller (a
process of its own, on the critical path before any worker exists) unpickles the backend config: every
run paid a torch import there before it asked for its workers. ``KitTorchConfig`` does what
``TorchConfig`` does for the kit's two backends (gloo, nccl; ``env://`` rendezvous): rank 0's address
and a free port for ``MASTER_ADDR``/``MASTER_PORT``, torchrun's variables (``RANK``, ``LOCAL_RANK``,
...), one ``init_process_group`` per worker with ``failure.hang_timeout_s`` as its timeout, the group
destroyed at the end; torch is imported in the workers only, inside the functions they run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

from ray_app.shared import ray_seam


@dataclass
class KitTorchConfig(BackendConfig):
    """``backend``: ``gloo`` or ``nccl``; ``timeout_s``: every collective's timeout; ``shutdown_timeout_s``:
    how long tearing the group down waits for its ranks to destroy their process group. A rank stuck in
    a collective with a lost or stopped peer never answers, and the restart waits this long for it (Ray's
    ``TorchConfig`` waits ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S``, 30 s, read where its controller
    runs: on a cluster, an environment the job does not set). A healthy rank answers in milliseconds."""

    backend: str = "gloo"
    timeout_s: int = 1800
    shutdown_timeout_s: float = 5.0

    @property
    def backend_cls(self):
        return KitTorchBackend

    @property
    def train_func_context(self):
        return CudaDeviceContext

    @property
    def framework(self):
        return ray_seam.torch_framework()

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class CudaDeviceContext:
    """Around the train function on each worker: its GPU (when it has one) is torch's current device."""

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            from ray.train.torch import get_device

            device = get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc):
        return False


def _set_rendezvous(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


def _set_torchrun_variables() -> None:
    """torchrun's variables, so user code written for torchrun finds its rank where it looks."""
    from ray.train.torch import get_device

    context = ray.train.get_context()
    os.environ["LOCAL_RANK"] = str(context.get_local_rank())
    os.environ["LOCAL_WORLD_SIZE"] = str(context.get_local_world_size())
    os.environ["NODE_RANK"] = str(context.get_node_rank())
    os.environ["RANK"] = str(context.get_world_rank())
    os.environ["WORLD_SIZE"] = str(context.get_world_size())
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(get_device())


def _init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        # a collective that times out raises instead of hanging the process
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(backend=backend, init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _shut_down(destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class KitTorchBackend(Backend):
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: KitTorchConfig):
        addr, port = worker_group.execute_single(0, ray_seam.address_and_port)
        worker_group.execute(_set_rendezvous, addr=addr, port=port)
        worker_group.execute(_set_torchrun_variables)
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(i, _init_process_group, backend=backend_config.backend,
                                                   world_rank=i, world_size=size, timeout_s=backend_config.timeout_s)
                 for i in range(size)])

    def on_shutdown(self, worker_group, backend_config: KitTorchConfig):
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(worker_group.execute_async(_shut_down, destroy=len(worker_group) > 1),
                    timeout=backend_config.shutdown_timeout_s)
        except (GetTimeoutError, ray.exceptions.RayError):
            # a rank that does not answer, or one already dead (a killed worker), is torn down with its
            # group anyway; Ray Train would log the error as a failed graceful shutdown, a traceback for nothing
            pass
