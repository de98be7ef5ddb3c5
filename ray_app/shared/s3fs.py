"""The pyarrow S3 filesystem the kit hands to Ray Train (``pyarrow_s3``), with the kit's retry budget
(``failure.storage_retry_s``) kept through pickling: each request's connect and request timeouts derive from
the budget (``ray_app.shared.retry.call_timeouts``), pyarrow's own retries are off, and the calls retry in
``ray_app.shared.retry``'s ``Retrying``, so an endpoint that never answers ends within the budget plus one
timeout, with a line while it waits. Streams are pyarrow's own (a small file Ray Train writes is uploaded
whole when closed, and retried).

Ray Train's controller writes its run state (``checkpoint_manager_snapshot.json``) after each reported
checkpoint and, keeping ``checkpoint.keep``, looks up the checkpoints it deletes. An error there ends the
whole run (a worker's error only restarts the group), so those calls are patient: ``ray_app.shared.retry``'s
``Retrying`` waits an outage out for up to ``CONTROLLER_PATIENCE`` x the retry budget (at least
``CONTROLLER_MIN_S``), one line when it starts waiting and one when storage answers again.
"""

from __future__ import annotations

import io
from urllib.parse import urlparse

import pyarrow
import pyarrow.fs

from ray_app.shared.retry import BUDGET_KEY, Retrying, attempt_s, call_timeouts, sdk_attempts

RUN_STATE_FILES = ("checkpoint_manager_snapshot.json",)  # what Ray Train's controller writes itself
# Ray Train's StorageContext, built by the controller at the run's start (and by each worker), creates the
# run's folder and writes and looks up this marker: an error there ends the whole run, so these calls wait
# an outage out for failure.storage_retry_s, as the workers' own calls do
VALIDATION_MARKER = ".validate_storage_marker"
CONTROLLER_PATIENCE, CONTROLLER_MIN_S = 10, 300.0


def pyarrow_s3(endpoint: str | None, region: str, budget_s: float = 0.0):
    """The filesystem Ray Train writes its own files with (run state, deletion of old checkpoints): the
    kit's endpoint and region; credentials from the AWS chain on each node (never serialized into Ray's
    run state); with a retry budget, requests time out and retry as the kit's own do."""
    kwargs = {"region": region}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    if not budget_s:
        return pyarrow.fs.S3FileSystem(**kwargs, **_timeouts(0.0))
    return pyarrow.fs.PyFileSystem(RetryingS3Handler(kwargs, sdk_attempts(budget_s), budget_s))


def _timeouts(budget_s: float) -> dict:
    connect, read = call_timeouts(budget_s)
    return {"connect_timeout": connect, "request_timeout": read}


class _UploadOnClose(io.RawIOBase):
    """A small file written in one piece when closed, the whole upload retried (``retry``: the handler's
    ``patiently`` or ``steadily``)."""

    def __init__(self, handler, path: str, metadata, retry=None, what="Ray Train's controller saving its run state"):
        self.handler, self.path, self.metadata, self.buffer = handler, path, metadata, bytearray()
        self.retry, self.what = retry or handler.patiently, what

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.buffer += b
        return len(b)

    def close(self) -> None:
        if self.closed:
            return
        data = bytes(self.buffer)

        def upload():
            with self.handler.fs.open_output_stream(self.path, metadata=self.metadata) as out:
                out.write(data)

        try:
            self.retry(self.what, upload)
        finally:
            super().close()


class RetryingS3Handler(pyarrow.fs.FileSystemHandler):
    """pyarrow's S3 filesystem with a retry strategy that survives pickling: an S3FileSystem drops
    its ``retry_strategy`` when pickled, and Ray Train ships the filesystem to its controller and
    workers. Streams are pyarrow's own, so transfers run at native speed."""

    def __init__(self, kwargs: dict, attempts: int, budget_s: float = 0.0):
        self.kwargs, self.attempts, self.budget_s = dict(kwargs), attempts, budget_s
        self._fs = self._patient = self._steady = None

    def __reduce__(self):
        return RetryingS3Handler, (self.kwargs, self.attempts, self.budget_s)

    @property
    def controller_budget_s(self) -> float:
        return max(CONTROLLER_PATIENCE * self.budget_s, CONTROLLER_MIN_S)

    def patiently(self, what: str, fn):
        """``fn()`` retried as the kit's storage calls are, for the controller's longer budget."""
        if self._patient is None:
            self._patient = Retrying(self.controller_budget_s, self._where(),
                                     budget=f"{CONTROLLER_PATIENCE} x {BUDGET_KEY}, at least {CONTROLLER_MIN_S:g} s, "
                                            "for Ray Train's controller",
                                     then="the run ends; the same run again resumes from the newest committed checkpoint",
                                     timeout_s=attempt_s(self.budget_s))
        return self._patient(what, fn)

    def steadily(self, what: str, fn):
        """``fn()`` retried for ``failure.storage_retry_s``, as a worker's storage calls are."""
        if self._steady is None:
            self._steady = Retrying(self.budget_s, self._where(),
                                    then="the run ends; the same command again resumes from the newest "
                                         "committed checkpoint")
        return self._steady(what, fn)

    def _where(self) -> str:
        endpoint = self.kwargs.get("endpoint_override")
        return f"s3 at {self.kwargs.get('scheme', 'https')}://{endpoint}" if endpoint else "s3"

    @property
    def fs(self):
        if self._fs is None:  # one attempt per call: the retries are Retrying's, on the budget's clock
            self._fs = pyarrow.fs.S3FileSystem(
                **self.kwargs, **_timeouts(self.budget_s),
                retry_strategy=pyarrow.fs.AwsStandardS3RetryStrategy(max_attempts=self.attempts))
        return self._fs

    def __eq__(self, other):
        return isinstance(other, RetryingS3Handler) and \
            (self.kwargs, self.attempts, self.budget_s) == (other.kwargs, other.attempts, other.budget_s)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "s3"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def _retry(self, what: str, path: str, fn):
        """``fn()`` within the controller's patience for a checkpoint's folder (its look-up before a deletion,
        the deletion), else within the workers' budget."""
        if _is_checkpoint_dir(path):
            return self.patiently(f"{what} a checkpoint ({path})", fn)
        return self.steadily(f"{what} {path}", fn)

    def get_file_info(self, paths):
        if any(_is_validation_marker(p) for p in paths):
            return self.steadily("Ray Train's check of the run's folder", lambda: self.fs.get_file_info(paths))
        path = next((p for p in paths if _is_checkpoint_dir(p)), paths[0] if paths else "")
        return self._retry("a look-up of", path, lambda: self.fs.get_file_info(paths))

    def get_file_info_selector(self, selector):
        return self._retry("listing", selector.base_dir, lambda: self.fs.get_file_info(selector))

    def create_dir(self, path, recursive):
        self._retry("creating", path, lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path):
        self._retry("deleting", path, lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._retry("deleting the contents of", path,
                    lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self):
        self.steadily("deleting /", lambda: self.fs.delete_dir_contents("/", accept_root_dir=True))

    def delete_file(self, path):
        self._retry("deleting", path, lambda: self.fs.delete_file(path))

    def move(self, src, dest):
        self._retry("moving", src, lambda: self.fs.move(src, dest))

    def copy_file(self, src, dest):
        self._retry("copying", src, lambda: self.fs.copy_file(src, dest))

    def open_input_stream(self, path):
        return self._retry("opening", path, lambda: self.fs.open_input_stream(path))

    def open_input_file(self, path):
        return self._retry("opening", path, lambda: self.fs.open_input_file(path))

    def open_output_stream(self, path, metadata):
        if path.rsplit("/", 1)[-1] in RUN_STATE_FILES:
            return pyarrow.PythonFile(_UploadOnClose(self, path, metadata), mode="w")
        if _is_validation_marker(path):  # written when closed: the whole upload retried
            return pyarrow.PythonFile(_UploadOnClose(self, path, metadata, self.steadily,
                                                     "Ray Train's check of the run's folder"), mode="w")
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


def _is_validation_marker(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1] == VALIDATION_MARKER


def _is_checkpoint_dir(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith("ckpt-s")
