"""Rank processes for the tests that run the loop on real gloo groups without Ray.

A ``spawn`` child starts a fresh interpreter and imports torch, the kit and the test module again: about
3 CPU-seconds before it does anything, for each rank of each group. A ``forkserver`` child is forked from one
server process that imported them once, when the first group started; it runs the same code, in a process of
its own, with this process's working directory and ``sys.path`` (not its environment as it is now: a test
whose ranks read a variable at process start, such as glibc's ``MALLOC_*``, asks for ``spawn``).
"""

from __future__ import annotations

import torch.multiprocessing as mp

# what every rank imports; the server imports them once, before its first child (an import error is ignored)
PRELOAD = ["torch", "torch.distributed", "ray_app.worker.loop", "tests.unit.test_loop_ddp"]


def rank_context(start_method: str = "forkserver"):
    """A multiprocessing context for rank processes: ``forkserver`` with the kit preloaded, or ``spawn``."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it has them already
    return ctx
