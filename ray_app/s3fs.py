"""pyarrow's S3 filesystem with a retry strategy that Ray Train keeps (``ray_app.storage`` uses it for
the filesystem it hands to Ray Train when ``failure.storage_retry_s`` is set)."""

from __future__ import annotations

import pyarrow.fs


class RetryingS3Handler(pyarrow.fs.FileSystemHandler):
    """pyarrow's S3 filesystem with a retry strategy that survives pickling: an S3FileSystem drops
    its ``retry_strategy`` when pickled, and Ray Train ships the filesystem to its controller and
    workers. Streams are pyarrow's own, so transfers run at native speed."""

    def __init__(self, kwargs: dict, attempts: int):
        self.kwargs, self.attempts = dict(kwargs), attempts
        self._fs = None

    def __reduce__(self):
        return RetryingS3Handler, (self.kwargs, self.attempts)

    @property
    def fs(self):
        if self._fs is None:
            self._fs = pyarrow.fs.S3FileSystem(
                **self.kwargs, retry_strategy=pyarrow.fs.AwsDefaultS3RetryStrategy(max_attempts=self.attempts))
        return self._fs

    def __eq__(self, other):
        return isinstance(other, RetryingS3Handler) and (self.kwargs, self.attempts) == (other.kwargs, other.attempts)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "s3"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.fs.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)
