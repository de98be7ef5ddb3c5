"""The SIGTERM handler of ray_app.worker.preemption: a notice while the loop trains, Ray's exit otherwise."""

from __future__ import annotations

import os
import signal
import time

import ray

from ray_app.worker import preemption


def deliver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # Python runs the handler in the main thread at its next instruction


def test_sigterm_is_a_notice_only_while_training_and_a_second_one_exits():
    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("ray's exit"))
    try:
        watcher = preemption.install()
        watcher.join(timeout=5)  # outside Ray the watch ends at once, and starts no Ray of its own
        assert not watcher.is_alive() and not ray.is_initialized()
        deliver()  # start-up or teardown: Ray's handler, as without the kit
        assert seen == ["ray's exit"] and not preemption.NOTICE.is_set()
        preemption.TRAINING.set()
        deliver()  # the loop runs: a notice, the worker goes on to the next step boundary
        assert preemption.NOTICE.is_set() and seen == ["ray's exit"]
        deliver()  # a second SIGTERM: exit now
        assert seen == ["ray's exit", "ray's exit"]
    finally:
        signal.signal(signal.SIGTERM, before)
        preemption.NOTICE.clear()
        preemption.TRAINING.clear()


def test_the_agreement_answers_one_step_late_with_the_highest_kind_noticed(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        agreement = preemption.Agreement()
        assert [agreement.poll(), agreement.poll()] == [0, 0]
        preemption.notify("a test's preemption")
        assert agreement.poll() == 0  # posted now, read at the next step: the all-reduce overlaps a step
        assert agreement.poll() == preemption.PREEMPT
        preemption.notify("a test's stop", preemption.STOP)  # a stop outranks a preemption: the run ends
        agreement.poll()
        assert agreement.poll() == preemption.STOP
        agreement.close()
        assert preemption.Agreement(enabled=False).poll() == 0
    finally:
        dist.destroy_process_group()
        preemption.NOTICE.clear()
        preemption._KIND[0] = 0
