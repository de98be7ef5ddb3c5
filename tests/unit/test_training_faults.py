"""Faults of the user's data and model, seen where they happen: real DataLoaders (with and without loader
worker processes), a real gloo group around DDP, the kit's failure policy."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ray_app.shared.config import load_config
from ray_app.shared.errors import ConfigError, DataPipelineError, UserCodeError
from ray_app.shared.failures import unused_parameters_error
from ray_app.shared.plugins import guarded_data
from ray_app.worker.entry import ddp_options
from tests.support.ranks import rank_context


class RaggedSamples(torch.utils.data.Dataset):
    """Sample 5 is one element longer than the others: the default collate cannot stack them."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(4 if i != 5 else 5), i % 2


class BrokenSample(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 6:
            return self.decode(i)
        return torch.zeros(4), 0

    def decode(self, i):
        raise ValueError(f"cannot decode record {i}")


def _first_failure(dataset, workers: int) -> UserCodeError:
    train, _, info = guarded_data(dataset, dataset, {})
    loader = DataLoader(train, batch_size=4, num_workers=workers, collate_fn=info["collate_fn"])
    with pytest.raises(DataPipelineError) as raised:
        for _ in loader:
            pass
    return UserCodeError.from_data_pipeline(raised.value, rank=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_ragged_samples_are_reported_with_their_indices_and_shapes(workers):
    err = _first_failure(RaggedSamples(), workers)
    text = err.traceback_text
    assert "collating samples [4, 5, 6, 7]" in text and "sample 5: ((5,), int)" in text and "sample 4: ((4,), int)" in text
    assert "DataLoader worker" not in text and "torch/utils/data" not in text  # no torch plumbing shown
    assert err.summary.startswith("in the data pipeline:") and "\n" not in err.summary


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_exception_in_getitem_shows_the_users_frames_once(workers):
    err = _first_failure(BrokenSample(), workers)
    text = err.traceback_text
    assert text.count("Traceback (most recent call last)") == 1
    assert "sample 6" in text and "in decode" in text and "ValueError: cannot decode record 6" in text
    assert "dataloader.py" not in text and "worker.py" not in text


@pytest.mark.timeout(60)
def test_a_data_pipeline_error_is_retried_once_then_ends_the_run():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy

    policy = KitFailurePolicy(FailureConfig(max_failures=5))
    attempts = [{r: _first_failure(RaggedSamples(), 0) for r in range(2)} for _ in range(3)]
    decisions = [policy.make_decision(WorkerGroupError("x", a)) for a in attempts[:2]]
    assert decisions == [FailureDecision.RETRY, FailureDecision.RAISE]  # two attempts, not max_failures + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoHeads(nn.Module):
    """The loss uses one head: the other's parameters never receive a gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _two_steps(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TwoHeads(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_unused_parameters_train_with_the_key_and_name_it_without(gloo_group, tmp_path):
    cfg = load_config(None, ["train.find_unused_parameters=true"])
    _two_steps(ddp_options(cfg))  # trains

    with pytest.raises(RuntimeError) as ddp_error:
        _two_steps(ddp_options(load_config(None, [])))
    line = unused_parameters_error(ddp_error.value)
    assert isinstance(line, ConfigError)
    assert "train.find_unused_parameters=true" in str(line) and "\n" not in str(line)
    assert unused_parameters_error(RuntimeError("something else")) is None


@pytest.mark.timeout(60)
def test_static_graph_with_unused_parameters_trains(gloo_group):
    _two_steps(ddp_options(load_config(None, ["train.static_graph=true"])))


# ---------------------------------------------------------------- a rank whose peer is gone

def _rank_of_two(rank: int, port: int, out) -> None:
    from ray_app.shared.errors import PeerLost

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    if rank == 1:
        import os
        os._exit(0)  # a killed worker: its sockets close with no goodbye
    try:
        for _ in range(50):  # the first all-reduce may still reach the peer's socket buffer
            dist.all_reduce(torch.ones(1 << 16))
        out.put("no error")
    except Exception as exc:  # noqa: BLE001 - what the rank met is the answer
        lost = PeerLost.of(exc, 0, leaving=False)
        out.put(str(lost) if lost else f"not a lost peer: {type(exc).__name__}: {exc}")


@pytest.mark.timeout(60)
def test_the_error_of_a_collective_whose_peer_died_is_a_lost_peer():
    """Two real gloo ranks; rank 1's process exits: rank 0's all-reduce raises, and the kit reads that as
    a lost peer (a consequence: the restart line names the cause, not this rank's traceback)."""
    ctx = rank_context()
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_of_two, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        seen = out.get(timeout=50)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert seen.startswith("rank 0 lost a peer: "), seen


def test_a_restart_is_one_line_naming_the_rank_that_failed_not_the_ranks_that_lost_it(capsys):
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_app.controller.failure_policy import KitFailurePolicy
    from ray_app.shared.errors import PeerLost

    policy = KitFailurePolicy(FailureConfig(max_failures=3))
    lost = PeerLost("rank 0 lost a peer: RuntimeError: Connection closed by peer")
    killed = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker")
    assert policy.make_decision(WorkerGroupError("x", {0: lost, 1: killed})) == FailureDecision.RETRY
    assert policy.make_decision(WorkerGroupError("x", {0: lost})) == FailureDecision.RETRY
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "ray-app: rank 1: RuntimeError: The actor died unexpectedly before finishing this task.; the worker group "
        "restarts from the newest committed checkpoint (restart 1 of 3: failure.max_failures)",
        "ray-app: rank 0 lost a peer: RuntimeError: Connection closed by peer; the worker group restarts from the "
        "newest committed checkpoint (restart 2 of 3: failure.max_failures)"]
    # the user's error: retried once to tell a fault from a bug, the restart one line naming it (not the lost
    # peer's); its traceback is shown once, by the driver, if the run ends on it
    policy.make_decision(WorkerGroupError("x", {0: lost, 1: _first_failure(RaggedSamples(), 0)}))
    line, = capsys.readouterr().out.splitlines()
    assert line.startswith("ray-app: rank 0 raised in your code before training: in the data pipeline: RuntimeError: "
                           "the samples of a batch must have equal shapes") and "Traceback" not in line
    assert line.endswith("(retried: the same error at the same step again ends the run); the worker group restarts "
                         "from the newest committed checkpoint (restart 3 of 3: failure.max_failures)")
