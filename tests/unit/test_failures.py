"""The failure table's rows end as it says: what a worker raises for each, what the policy decides, what the
driver raises and the exit code (the real runs of each row are the integration tests named in
tests/README.md; these pin the table itself)."""

from __future__ import annotations

import errno
import shutil

import pytest

from ray_app.shared import failures
from ray_app.shared.errors import (
    ConfigError,
    Diverged,
    PeerLost,
    Preempted,
    RunHeld,
    RunInterrupted,
    RunStopped,
    Stopped,
    StorageError,
    StorageUnavailable,
    TrainingFailed,
    UserCodeError,
    UserError,
)
from ray_app.shared.storage import LocalStorage


class _GroupError(Exception):
    def __init__(self, failures_by_rank):
        super().__init__("Training failed due to worker errors")
        self.worker_failures = failures_by_rank


def _user(step: int) -> UserCodeError:
    return UserCodeError("OSError: a flaky read", "Traceback ...\nOSError: a flaky read\n",
                         f"OSError|a flaky read|task.py:9|step {step}", rank=0, step=step)


@pytest.mark.parametrize("error, action, raised, code", [
    (ConfigError("config key model.args.x: no such argument"), failures.STOP, UserError, 2),
    (StorageError("run.storage /x: No space left on device writing r/ckpt/model.pt"), failures.STOP, UserError, 2),
    (RunHeld("run /x is no longer held by this worker group's driver"), failures.STOP, UserError, 2),
    (Diverged("training diverged at step 7"), failures.STOP, TrainingFailed, 1),
    (Stopped("stopped at step 7; checkpoint c"), failures.STOP, RunStopped, 143),
    (Preempted("preempted at step 7"), failures.RETRY_FREE, TrainingFailed, 1),
    (StorageUnavailable("storage s3://b: no answer for 120 s"), failures.RETRY, TrainingFailed, 1),
    (PeerLost("rank 1 lost a peer: RuntimeError: Connection closed by peer"), failures.RETRY, TrainingFailed, 1),
    (RuntimeError("The actor died unexpectedly"), failures.RETRY, TrainingFailed, 1),
])
def test_each_row_decides_raises_and_exits_as_the_table_says(error, action, raised, code):
    assert failures.wrap(error, rank=0, step=7, roots=(), leaving=False) in (error, None)
    assert failures.FailureHistory().decide({0: error}).action == action
    at_driver = failures.at_driver(_GroupError({0: error}), interrupted=False, resume_command="ray-app train")
    assert type(at_driver) is raised and failures.exit_code(at_driver) == code
    assert "\n" not in failures.one_line(at_driver)


def test_a_stop_after_sigint_is_an_interrupt_with_the_command_that_resumes():
    at_driver = failures.at_driver(_GroupError({0: Stopped("stopped at step 7; checkpoint c")}), interrupted=True,
                                   resume_command="ray-app train --set run.name=x")
    assert type(at_driver) is RunInterrupted and failures.exit_code(at_driver) == 130
    assert str(at_driver).endswith("resume with: ray-app train --set run.name=x")


def test_the_users_error_is_retried_at_another_step_and_stops_at_the_same_step(capsys):
    history = failures.FailureHistory()
    first = history.decide({0: _user(20)})
    assert first.action == failures.RETRY and "at step 20: OSError: a flaky read" in first.line
    assert history.decide({0: _user(50)}).action == failures.RETRY  # another step: a fault
    assert history.decide({0: _user(50)}).action == failures.STOP  # the same step again: a bug
    at_driver = failures.at_driver(_GroupError({0: _user(50)}), interrupted=False, resume_command="")
    assert str(at_driver) == "OSError: a flaky read (rank 0, at step 50; traceback above)"
    assert capsys.readouterr().err.count("Traceback") == 1


def _raised_in(filename: str, exc: BaseException) -> BaseException:
    """``exc`` as raised by a function of the file ``filename`` (its traceback's last frame there)."""
    namespace: dict = {}
    exec(compile("def call(exc):\n    raise exc\n", filename, "exec"), namespace)
    try:
        namespace["call"](exc)
    except BaseException as raised:  # noqa: B036 - the exception under test
        return raised
    raise AssertionError("not raised")


def test_ray_trains_own_call_failing_as_the_group_is_torn_down_is_a_lost_peer_not_the_users_error(tmp_path):
    """A rank in a report's sync when another rank dies: Ray Train kills the group's SynchronizationActor and
    the report raises ActorDiedError from Ray Train's code. That is a consequence (shown by no traceback); the
    same error from the user's own actor call is the user's."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.execution import context

    torn = failures.wrap(_raised_in(context.__file__, ActorDiedError()), rank=1, step=16, roots=(), leaving=False)
    assert isinstance(torn, PeerLost) and str(torn).startswith("rank 1 lost a peer: ActorDiedError"), torn
    assert failures.FailureHistory().decide({1: torn}).action == failures.RETRY
    user_file = str(tmp_path / "task.py")
    own = failures.wrap(_raised_in(user_file, ActorDiedError()), rank=1, step=16, roots=(str(tmp_path),),
                        leaving=False)
    assert isinstance(own, UserCodeError) and own.step == 16, own


def test_a_full_disk_is_one_line_naming_the_fix_and_leaves_no_partial_file(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "runs"))
    src = tmp_path / "model.pt"
    src.write_bytes(b"x" * 100)

    def full(a, b):
        with open(b, "wb") as f:
            f.write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    with pytest.raises(StorageError, match="No space left on device writing r/ckpt/model.pt; free space there"):
        storage.upload_file(str(src), "r/ckpt/model.pt")
    assert list((tmp_path / "runs" / "r" / "ckpt").iterdir()) == []  # no .tmp left behind
