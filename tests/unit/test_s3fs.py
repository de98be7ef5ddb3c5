"""The filesystem handed to Ray Train: its controller's run-state writes and checkpoint look-ups wait an
outage out (an error there would end the run), other calls keep the workers' budget."""

from __future__ import annotations

import pyarrow.fs
import pytest

from ray_app.shared import s3fs
from ray_app.shared.errors import StorageUnavailable
from ray_app.shared.retry import transient


class Flaky:
    """A local filesystem whose first ``failures`` calls of each kind raise as an unreachable S3 does."""

    def __init__(self, root, failures: int):
        self.local = pyarrow.fs.SubTreeFileSystem(str(root), pyarrow.fs.LocalFileSystem())
        self.failures, self.calls = failures, 0

    def _maybe_fail(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("AWS Error NETWORK_CONNECTION: curlCode: 7, Could not connect to server")

    def open_output_stream(self, path, metadata=None):
        self._maybe_fail()
        return self.local.open_output_stream(path, metadata=metadata)

    def get_file_info(self, paths):
        self._maybe_fail()
        return self.local.get_file_info(paths)


def handler_on(fs) -> s3fs.RetryingS3Handler:
    h = s3fs.RetryingS3Handler({"region": "us-east-1"}, attempts=2, budget_s=1.0)
    h._fs = fs
    return h


def test_the_run_state_write_waits_the_outage_out(tmp_path, capsys):
    (tmp_path / "exp").mkdir()
    flaky = Flaky(tmp_path, failures=2)
    fs = pyarrow.fs.PyFileSystem(handler_on(flaky))
    with fs.open_output_stream("exp/checkpoint_manager_snapshot.json") as f:  # as Ray Train's controller does
        f.write(b'{"checkpoints": []}')
    assert (tmp_path / "exp" / "checkpoint_manager_snapshot.json").read_bytes() == b'{"checkpoints": []}'
    assert flaky.calls == 3
    err = capsys.readouterr().err
    assert "unreachable (OSError) during Ray Train's controller saving its run state" in err
    assert "up to 300 s (10 x failure.storage_retry_s, at least 300 s, for Ray Train's controller)" in err
    assert "answers again after" in err


def test_a_checkpoint_look_up_waits_and_other_calls_keep_the_budget(tmp_path):
    (tmp_path / "ckpt-s000000008-x").mkdir()
    flaky = Flaky(tmp_path, failures=10 ** 6)
    handler = handler_on(flaky)
    fs = pyarrow.fs.PyFileSystem(handler)
    with pytest.raises(StorageUnavailable, match=r"during a look-up of elsewhere .*up to 1 s \(failure\.storage_retry_s\)"):
        fs.get_file_info("elsewhere")  # a worker's listing: its own retry budget, then the group restarts
    flaky.calls, flaky.failures = 0, 1
    assert fs.get_file_info("ckpt-s000000008-x").type == pyarrow.fs.FileType.Directory
    with pytest.raises(OSError, match="NETWORK_CONNECTION"):  # a stream's own requests: pyarrow's, one attempt
        pyarrow.fs.PyFileSystem(handler_on(Flaky(tmp_path, failures=1))).open_output_stream("ckpt/model.pt")


def test_pyarrows_outage_errors_are_transient_and_its_other_errors_are_not():
    assert transient(OSError("When initiating multiple part upload for key 'k': AWS Error NETWORK_CONNECTION "
                             "during CreateMultipartUpload operation: curlCode: 7, Could not connect to server"))
    assert transient(OSError("AWS Error SLOW_DOWN during PutObject operation"))
    assert not transient(FileNotFoundError("Path does not exist 'b/k'"))  # a missing bucket: at once
    assert not transient(OSError("AWS Error ACCESS_DENIED during PutObject operation"))


def test_the_patience_is_pickled_with_the_handler():
    import pickle

    h = pickle.loads(pickle.dumps(s3fs.RetryingS3Handler({"region": "r"}, 5, 30.0)))
    assert h.budget_s == 30.0 and h.controller_budget_s == max(10 * 30.0, s3fs.CONTROLLER_MIN_S)


class FlakyDirs(Flaky):
    def create_dir(self, path, recursive=True):
        self._maybe_fail()
        return self.local.create_dir(path, recursive=recursive)


@pytest.mark.timeout(30)
def test_ray_trains_storage_context_set_up_waits_an_outage_out_within_the_budget(tmp_path, capsys):
    from ray.train.v2._internal.execution.storage import StorageContext

    flaky = FlakyDirs(tmp_path, failures=2)
    handler = handler_on(flaky)
    handler.budget_s = 5.0
    fs = pyarrow.fs.PyFileSystem(handler)
    StorageContext(storage_path="runs", experiment_dir_name="run", storage_filesystem=fs)  # as the controller does
    assert (tmp_path / "runs" / "run" / ".validate_storage_marker").exists()
    err = capsys.readouterr().err
    assert "unreachable (OSError) during creating runs/run" in err and "answers again" in err
    assert "Traceback" not in err


@pytest.mark.timeout(30)
def test_past_the_budget_the_set_up_ends_with_storage_unavailable(tmp_path):
    fs = pyarrow.fs.PyFileSystem(handler_on(FlakyDirs(tmp_path, failures=10**6)))
    with pytest.raises(StorageUnavailable, match="failure.storage_retry_s|no answer"):
        fs.create_dir("runs/run")
