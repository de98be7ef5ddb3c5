"""The failure table's rows end as they say, the tests generated from the rows themselves: what a worker raises
for each, what the policy decides, what the driver raises, the exit code and the line; the table's prose is its
rows; one row changed changes the command line's exit code. The real runs of each row are the tests named in
``PROVEN_BY`` (integration and e2e tests, a unit's real gloo group, an in-process command)."""

from __future__ import annotations

import dataclasses
import errno
import inspect
import re
import shutil
import signal
from pathlib import Path

import pytest

from ray_app.shared import errors, failures
from ray_app.shared.errors import (
    PeerLost,
    RunInterrupted,
    Stopped,
    StorageError,
    TrainingFailed,
    UserCodeError,
)
from ray_app.shared.storage import LocalStorage

REPO = Path(__file__).resolve().parents[2]
LOCAL_YAML = str(REPO / "configs" / "local.yaml")

# each row through the real wiring once (Ray, a store, a signal; no new Ray run here): checked to exist below
PROVEN_BY = {
    "bad input": ["integration/test_user_project.py::test_what_only_a_worker_finds_ends_the_run_at_once_shown_once",
                  "unit/test_cli.py::test_bad_config_exits_2_with_one_line_and_creates_nothing"],
    "the user's error": ["integration/test_run_faults.py::"
                         "test_a_bug_in_the_users_data_is_shown_once_and_ends_the_run_after_at_most_two_attempts",
                         "integration/test_run_faults.py::test_the_users_error_at_two_steps_is_retried_and_the_run_finishes"],
    "divergence": ["integration/test_train_local.py::test_a_diverging_run_ends_with_one_line_and_exit_1"],
    "a stop": ["integration/test_faults.py::"
               "test_a_sigterm_to_the_driver_stops_the_run_at_a_checkpoint_and_a_resubmit_loses_no_step"],
    "an interrupt": ["integration/test_run_faults.py::"
                     "test_one_writer_per_run_and_ctrl_c_exits_130_with_the_command_that_resumes"],
    "preemption": ["integration/test_chaos.py::"
                   "test_a_kill_a_preemption_and_an_s3_outage_in_one_run_end_on_the_uninterrupted_runs_parameters"],
    "storage unavailable": ["integration/test_storage_outage.py::"
                            "test_an_outage_longer_than_the_budget_restarts_from_the_newest_committed_checkpoint",
                            # Ray Train's controller dying of it (controller_died)
                            "integration/test_run_faults.py::test_storage_refused_for_20_s_just_after_the_preflight"],
    "a lost peer": ["unit/test_training_faults.py::test_the_error_of_a_collective_whose_peer_died_is_a_lost_peer",
                    "integration/test_chaos.py::"
                    "test_a_kill_a_preemption_and_an_s3_outage_in_one_run_end_on_the_uninterrupted_runs_parameters"],
    "a killed worker, a hang": ["integration/test_faults.py::"
                                "test_a_stopped_rank_is_detected_within_the_hang_timeout_and_the_run_ends_bit_identical",
                                "e2e/test_cluster.py::test_killed_worker_container_resumes_from_newest_checkpoint"],
    "a group that did not start": ["unit/test_driver.py::"
                                   "test_an_elastic_group_that_did_not_start_is_asked_for_one_fewer_until_the_view_changes",
                                   "e2e/test_cluster.py::"
                                   "test_a_lost_worker_shrinks_the_world_to_min_workers_and_a_new_one_grows_it_back"],
    "storage at a command's start": ["integration/test_storage_outage.py::"
                                     "test_eval_and_a_warm_start_ride_out_an_outage_at_their_start_and_a_longer_one_is_one_line",
                                     "unit/test_cli.py::test_an_unreachable_s3_endpoint_is_one_line_and_exit_2"],
    "an interrupt elsewhere": ["unit/test_failures.py::test_each_row_ends_a_command_with_its_exit_code_and_line"],
}


class _GroupError(Exception):
    def __init__(self, failures_by_rank):
        super().__init__("Training failed due to worker errors")
        self.worker_failures = failures_by_rank


class _ControllerError(Exception):
    """Ray Train's error for a failure of its controller (a group that did not start in time)."""

    def __init__(self, failure: BaseException):
        super().__init__(str(failure))
        self.controller_failure = failure


def _user(step: int) -> UserCodeError:
    return UserCodeError("OSError: a flaky read", "Traceback ...\nOSError: a flaky read\n",
                         f"OSError|a flaky read|task.py:9|step {step}", rank=0, step=step)


def _raised(cls: type[BaseException]) -> BaseException:
    """An exception of ``cls`` as the kit raises it, with a message."""
    return _user(7) if issubclass(cls, UserCodeError) else cls(f"{cls.__name__} at step 7; the fix")


def _row_id(kind: failures.Kind) -> str:
    return kind.name.replace(" ", "-")


def _run_main(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``ray-app ARGV`` in this process; returns (exit code, stderr)."""
    from ray_app.driver import cli

    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main() would leave its SIGTERM handler here
    capsys.readouterr()
    return cli.main(argv), capsys.readouterr().err


# ---------------------------------------------------------------- generated from the rows


@pytest.mark.parametrize("kind", failures.TABLE, ids=_row_id)
def test_each_row_ends_a_command_with_its_exit_code_and_line(kind, monkeypatch, capsys):
    """An exception of each driver class of the row, raised by a command: the CLI's real ``main`` ends with the
    row's exit code and its one line."""
    from ray_app.driver import cli

    assert kind.driver_raises or (kind.exit_code is None and kind.line == "" and kind.decision != failures.STOP)
    for cls in kind.driver_raises:
        exc = _raised(cls)

        def command(args, exc=exc):
            raise exc

        monkeypatch.setitem(cli.COMMANDS, "config", command)
        code, err = _run_main(["config", "keys"], monkeypatch, capsys)
        prefix = kind.line.partition("{}")[0]
        assert code == kind.exit_code == failures.exit_code(exc), (cls, code)
        assert err == failures.one_line(exc) + "\n" and err.startswith(prefix) and err.count("\n") == 1, (cls, err)


@pytest.mark.parametrize("kind", [k for k in failures.TABLE if k.worker_raises], ids=_row_id)
def test_each_rows_worker_error_is_decided_and_raised_at_the_driver_as_the_row_says(kind, capsys):
    for cls in kind.worker_raises:
        exc = _raised(cls)
        assert failures.wrap(exc, rank=0, step=7, roots=(), leaving=False) is exc  # a row already: as it is
        first = failures.kind_of(exc)
        assert first is kind or (cls in first.worker_raises and first.decision == kind.decision), (cls, first)
        history = failures.FailureHistory()
        action = history.decide({0: exc}).action
        if kind.decision == failures.RETRY_ONCE:  # a restart, then the same again ends the run
            assert (action, history.decide({0: exc}).action) == (failures.RETRY, failures.STOP)
        else:
            assert action == kind.decision
        if kind.driver_raises:  # a run that ended on it
            at_driver = failures.at_driver(_GroupError({0: exc}), interrupted=kind is failures.INTERRUPTED,
                                           resume_command="ray-app train")
            assert type(at_driver) is kind.driver_raises[0]
            assert failures.exit_code(at_driver) == kind.exit_code and "\n" not in failures.one_line(at_driver)


@pytest.mark.parametrize("kind, failed, controller", [
    (failures.RAYS_OWN, {0: RuntimeError("The actor died unexpectedly")}, None),
    (failures.NOT_STARTED, {}, _ControllerError(TimeoutError("the worker group did not start within 30 s. Hint"))),
], ids=["rays-own", "not-started"])
def test_rays_own_failures_are_decided_and_end_as_their_row_says(kind, failed, controller):
    decision = failures.FailureHistory().decide(failed, controller)
    assert decision.action == kind.decision and decision.line  # a restart is one line naming its cause
    at_driver = failures.at_driver(_GroupError(failed), interrupted=False, resume_command="")
    assert type(at_driver) is kind.driver_raises[0] and failures.exit_code(at_driver) == kind.exit_code


@pytest.mark.parametrize("kind", failures.TABLE, ids=_row_id)
def test_rows_that_share_a_class_agree_on_what_that_side_decides(kind):
    """The first row a class matches is the one read: a later row sharing it must not say otherwise."""
    for cls in kind.driver_raises:
        read = failures.kind_at_driver(cls)
        assert (read.exit_code, read.line) == (kind.exit_code, kind.line), (cls, read.name)
    for cls in kind.worker_raises:
        read = failures.kind_of(_raised(cls))
        assert read.decision == kind.decision, (cls, read.name)


def _prose_rows() -> list[list[str]]:
    """The docstring's table: each row's cells, a cell's lines joined."""
    lines = failures.__doc__.splitlines()
    rules = [i for i, ln in enumerate(lines) if ln.startswith("====")]
    starts = [m.start() for m in re.finditer(r"=+", lines[rules[0]])]
    rows: list[list[str]] = []
    for ln in lines[rules[1] + 1:rules[2]]:
        cells = [ln[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        if cells[0] and not cells[0].startswith("("):
            rows.append(cells)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
    return rows


def _named_exceptions(text: str) -> set[type]:
    known = {**vars(errors), "KeyboardInterrupt": KeyboardInterrupt}
    return {known[w] for w in re.findall(r"\b[A-Z]\w+\b", text) if isinstance(known.get(w), type)}


def test_the_prose_table_is_the_rows():
    prose = _prose_rows()
    assert len(prose) == len(failures.TABLE)
    for cells, kind in zip(prose, failures.TABLE):
        name, worker, policy, driver, code, line = cells
        assert name.startswith(kind.name), (name, kind.name)
        named = _named_exceptions(worker)
        assert set(kind.worker_raises) <= named and all(issubclass(c, kind.worker_raises) for c in named), (name, worker)
        assert policy == (kind.decision or "-") or policy.startswith(f"{kind.decision} ("), (name, policy)
        assert _named_exceptions(driver) == set(kind.driver_raises), (name, driver)
        assert code == ("-" if kind.exit_code is None else str(kind.exit_code)), (name, code)
        assert line == ("-" if not kind.line else kind.line.removeprefix("ray-app: ")), (name, line)


def test_every_exit_code_an_errors_docstring_names_is_the_tables():
    for cls in vars(errors).values():
        if not (isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__):
            continue
        said = re.findall(r"exit(?: code)? (\d+)", inspect.getdoc(cls) or "")
        kind = failures.kind_at_driver(cls) or failures.kind_of(_raised(cls))
        assert all(int(code) == kind.exit_code for code in said), (cls.__name__, said, kind.name)


def test_each_row_names_the_tests_that_prove_it_through_the_real_wiring():
    assert set(PROVEN_BY) == {kind.name for kind in failures.TABLE}
    for tests in PROVEN_BY.values():
        for test in tests:
            path, _, name = test.partition("::")
            assert f"def {name}(" in (REPO / "tests" / path).read_text(), test


# ---------------------------------------------------------------- one row changed, the command line follows


def test_a_changed_row_changes_the_exit_code_of_the_real_command_line(monkeypatch, capsys, tmp_path):
    """Bad input's exit code 2 -> 3 in the table: a bad config key, and a usage error, end with 3."""
    changed = dataclasses.replace(failures.BAD_INPUT_KIND, exit_code=3)
    monkeypatch.setattr(failures, "TABLE", tuple(changed if k is failures.BAD_INPUT_KIND else k for k in failures.TABLE))
    monkeypatch.setattr(failures, "BAD_INPUT_KIND", changed)
    monkeypatch.chdir(tmp_path)
    code, err = _run_main(["train", "--config", LOCAL_YAML, "--set", "bogus.key=1"], monkeypatch, capsys)
    assert code == 3 and err.startswith("ray-app: error:") and "bogus" in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as usage:  # argparse's error, ended by the parser
        _run_main(["train", "--epochs", "3"], monkeypatch, capsys)
    err = capsys.readouterr().err
    assert usage.value.code == 3 and err.splitlines()[-1].startswith("ray-app: error: unrecognized arguments"), err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the paths between the rows


def test_a_stop_after_sigint_is_an_interrupt_with_the_command_that_resumes():
    at_driver = failures.at_driver(_GroupError({0: Stopped("stopped at step 7; checkpoint c")}), interrupted=True,
                                   resume_command="ray-app train --set run.name=x")
    assert type(at_driver) is RunInterrupted and failures.exit_code(at_driver) == failures.INTERRUPTED.exit_code
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


def test_the_controllers_death_is_read_by_the_row_of_the_kits_error_in_it():
    """Ray's text of Ray Train's controller dying: the kit's error named in it is its row's at the driver (its
    storage set-up past failure.storage_retry_s: a failed training, one line); else Ray's last line."""
    text = ("The actor died because of an error raised in its creation task, ray::TrainController.__init__()\n"
            "  File \"s3fs.py\", line 9, in put\n"
            "ray_app.shared.errors.StorageUnavailable: storage s3://b/r: no answer for 3 s; check the endpoint\n\n")
    died = failures.controller_died(RuntimeError(text))
    assert type(died) is TrainingFailed and str(died) == "storage s3://b/r: no answer for 3 s; check the endpoint"
    other = failures.controller_died(RuntimeError("The actor died unexpectedly\n  File \"x.py\"\nOSError: gone\n"))
    assert type(other) is TrainingFailed and str(other) == "OSError: gone"


def test_an_errors_line_is_cut_at_one_limit_everywhere():
    long = ValueError("\n  " + "x" * 2000 + "\nsecond")
    assert errors.first_line(long) == "x" * errors.LINE_LIMIT
    assert errors.last_line(long) == "second" and errors.first_line(ValueError("")) == "ValueError"
    assert errors.first_line("") == errors.last_line("  \n") == ""  # a blank text (a run that ended well: no line)
    peer = PeerLost.of(RuntimeError("Connection closed by peer " + "y" * 2000), rank=1, leaving=False)
    assert str(peer).endswith("y" * 10) and len(str(peer)) <= errors.LINE_LIMIT + 60


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
    assert failures.kind_of(StorageError("x")) is failures.BAD_INPUT_KIND  # not retried
