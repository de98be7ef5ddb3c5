"""Retries of the object store: which errors are transient, and the budget (a fake clock: no sleeping); each
request's timeouts derive from the budget (an endpoint that never answers, on loopback); the preflight waits
an outage out."""

from __future__ import annotations

import re

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from ray_app.shared.errors import StorageUnavailable
from ray_app.shared.retry import Retrying, transient
from tests.support.silent_server import SilentServer


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def wrapped(inner: Exception) -> S3UploadFailedError:
    """What boto3's upload_file raises: S3UploadFailedError from the transfer's error."""
    try:
        try:
            raise inner
        except Exception as exc:
            raise S3UploadFailedError("Failed to upload x to b/k: ...") from exc
    except S3UploadFailedError as outer:
        return outer


@pytest.mark.parametrize("exc", [
    EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
    ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
    ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
    client_error("SlowDown", 503), client_error("InternalError", 500), client_error("Weird", 502),
    wrapped(EndpointConnectionError(endpoint_url="http://127.0.0.1:1")), wrapped(client_error("SlowDown", 503)),
    ConnectionResetError(),
])
def test_outages_and_throttling_are_transient(exc):
    assert transient(exc)


@pytest.mark.parametrize("exc", [
    client_error("AccessDenied", 403), client_error("NoSuchBucket", 404), client_error("InvalidAccessKeyId", 403),
    wrapped(client_error("AccessDenied", 403)), FileNotFoundError("model.pt"), ValueError("x"),
])
def test_what_a_retry_cannot_fix_is_not(exc):
    assert not transient(exc)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def flaky(failures: int, exc: Exception):
    calls = []

    def op(x):
        calls.append(x)
        if len(calls) <= failures:
            raise exc
        return f"ok {x}"
    return op, calls


def test_a_short_outage_is_waited_out_with_backoff_and_two_lines():
    clock, said = Clock(), []
    retry = Retrying(30, "s3://b at http://proxy", say=said.append, sleep=clock.sleep, clock=clock)
    op, calls = flaky(4, EndpointConnectionError(endpoint_url="http://proxy"))
    assert retry("upload of run/ckpt/model.pt", op, 7) == "ok 7"
    assert len(calls) == 5 and 0.8 * (0.5 + 1 + 2 + 4) <= clock.now <= 1.2 * (0.5 + 1 + 2 + 4)
    assert len(said) == 2 and "unreachable (EndpointConnectionError) during upload of run/ckpt/model.pt" in said[0]
    assert "retrying for up to 30 s" in said[0] and "answers again after" in said[1]


def test_an_outage_longer_than_the_budget_gives_up_near_it():
    clock, said = Clock(), []
    retry = Retrying(20, "s3://b", say=said.append, sleep=clock.sleep, clock=clock)
    op, calls = flaky(10 ** 6, EndpointConnectionError(endpoint_url="http://proxy"))
    with pytest.raises(StorageUnavailable, match="no answer for .* during listing run/") as info:
        retry("listing run/", op, 1)
    assert clock.now <= 20 and clock.now >= 20 - 8 * 1.2  # stops before the next sleep would pass the budget
    assert isinstance(info.value.__cause__, EndpointConnectionError) and len(said) == 1


def test_a_permanent_error_is_raised_at_once():
    clock = Clock()
    retry = Retrying(60, "s3://b", say=lambda m: None, sleep=clock.sleep, clock=clock)
    op, calls = flaky(1, client_error("AccessDenied", 403))
    with pytest.raises(ClientError):
        retry("upload", op, 1)
    assert len(calls) == 1 and clock.now == 0


def test_the_filesystem_ray_train_gets_keeps_its_retry_budget_through_pickling():
    import pickle

    import pyarrow.fs

    from ray_app.shared.storage import S3Storage

    fs = S3Storage("s3://bucket/prefix", retry_s=120).pyarrow_fs()
    again = pickle.loads(pickle.dumps(fs))  # what Ray Train's controller and workers get
    assert isinstance(again, pyarrow.fs.PyFileSystem) and again.type_name == "py::s3"
    assert again.handler.budget_s == 120 and again.handler.attempts == 1 and again.equals(fs)  # Retrying retries
    assert isinstance(S3Storage("s3://bucket/prefix").pyarrow_fs(), pyarrow.fs.S3FileSystem)  # no budget: plain


def test_a_requests_timeouts_are_a_quarter_of_the_budget_between_1_s_and_the_defaults():
    from ray_app.shared.retry import call_timeouts

    assert call_timeouts(120) == (3, 30) and call_timeouts(0) == (3, 30)  # the default budget keeps 3 s / 30 s
    assert call_timeouts(20) == (3, 5) and call_timeouts(6) == (1.5, 1.5) and call_timeouts(2) == (1, 1)


def test_a_smaller_budget_is_named_as_what_it_is_and_the_clock_counts_a_silent_attempt():
    """A call that hung for its timeout before failing: the budget's clock started when it was sent."""
    clock, said = Clock(), []
    retry = Retrying(5, "s3://b", say=said.append, sleep=clock.sleep, clock=clock, timeout_s=2,
                     budget="the hang report's: the lesser of failure.storage_retry_s and 5 s")

    def silent():
        clock.now += 2  # one read timeout
        raise ReadTimeoutError(endpoint_url="http://silent")

    with pytest.raises(StorageUnavailable) as info:
        retry("listing r/", silent)
    assert "no answer for 2 s, retrying for up to 5 s (the hang report's: the lesser of failure.storage_retry_s " \
           "and 5 s)" in said[0], said
    assert "retried for up to 5 s (the hang report's" in str(info.value)
    assert clock.now <= 5 + 2, clock.now  # the budget plus one timeout, not the budget after a first failure


@pytest.fixture
def silent_s3(monkeypatch):
    """AWS_ENDPOINT_URL_S3 at an endpoint that accepts connections and never answers."""
    with SilentServer() as server:
        for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE"):
            monkeypatch.delenv(key, raising=False)
        for key, value in dict(AWS_ENDPOINT_URL_S3=server.endpoint, AWS_ACCESS_KEY_ID="AKIAEXAMPLE",
                               AWS_SECRET_ACCESS_KEY="not-a-secret", AWS_REGION="us-east-1",
                               AWS_EC2_METADATA_DISABLED="true").items():
            monkeypatch.setenv(key, value)
        yield server


BUDGET_S = 6  # failure.storage_retry_s of these tests: requests time out after 1.5 s


# what a rank does with the store: restore's read, a checkpoint's upload, a commit's manifest
OPERATIONS = {"reading": lambda st, tmp: st.read_bytes("r/config.json"),
              "upload of": lambda st, tmp: st.upload_file(str(tmp), "r/ckpt/model.pt"),
              "writing": lambda st, tmp: st.write_bytes("r/ckpt/manifest.json", b"{}")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", list(OPERATIONS))
def test_an_endpoint_that_never_answers_ends_a_read_within_the_budget(silent_s3, capsys, tmp_path, what):
    import time

    from ray_app.shared.storage import open_storage

    storage = open_storage("s3://bucket-x/runs", retry_s=BUDGET_S)
    (tmp_path / "model.pt").write_bytes(b"x" * 1000)
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable, match=rf"no answer for \d+ s during {what} r/"):
        OPERATIONS[what](storage, tmp_path / "model.pt")
    elapsed = time.monotonic() - t0
    assert BUDGET_S - 2 <= elapsed <= BUDGET_S + 3, elapsed  # the budget plus one request's timeouts
    err = capsys.readouterr().err
    assert re.search(rf"unreachable \(\w+\) during {what} r/\S+; no answer for [1-3] s, retrying for up "
                     rf"to {BUDGET_S} s \(failure\.storage_retry_s\)", err), err


@pytest.mark.timeout(90)
def test_eval_against_an_endpoint_that_never_answers_is_one_line_and_exit_2_within_the_budget(silent_s3, run_cli):
    import time

    t0 = time.monotonic()  # the subprocess gets this environment (the fixture's AWS_ENDPOINT_URL_S3)
    rc, out, err = run_cli(["eval", "--checkpoint", "s3://bucket-x/runs/r1", "--set",
                            f"failure.storage_retry_s={BUDGET_S}"], timeout=80)
    elapsed = time.monotonic() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 2 and "no answer for" in lines[0] and f"up to {BUDGET_S} s (failure.storage_retry_s)" in lines[0], err
    assert lines[1].startswith("ray-app: error: storage s3://bucket-x") and "no answer for" in lines[1], lines
    assert elapsed <= BUDGET_S + 30, elapsed  # the interpreter's start-up, the budget and one timeout


class OutageThenAnswers:
    """A boto3 client whose first ``failures`` calls meet a refused connection (a store restarting)."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, []

    def _call(self, name, **kwargs):
        self.calls.append(name)
        if len(self.calls) <= self.failures:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
        return {}

    def head_bucket(self, **kwargs):
        return self._call("head_bucket", **kwargs)

    def put_object(self, **kwargs):
        return self._call("put_object", **kwargs)

    def delete_object(self, **kwargs):
        return self._call("delete_object", **kwargs)


@pytest.mark.timeout(30)
def test_the_preflight_waits_an_outage_out_within_the_budget_and_fails_at_once_without_one(capsys):
    """A resume's store in a short outage: the preflight waits (one line each way), as eval does."""
    from ray_app.shared.errors import StorageError
    from ray_app.shared.storage import S3Storage, preflight

    storage = S3Storage("s3://bucket-x/runs", retry_s=5)
    storage._client = OutageThenAnswers(failures=2)
    preflight(storage)
    assert storage._client.calls == ["head_bucket"] * 3 + ["put_object", "delete_object"]
    err = capsys.readouterr().err
    assert "unreachable (EndpointConnectionError) during checking the bucket" in err and "answers again" in err
    storage = S3Storage("s3://bucket-x/runs")  # no budget: at once
    storage._client = OutageThenAnswers(failures=1)
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
        preflight(storage)
