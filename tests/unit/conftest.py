"""Fixtures the unit modules share."""

from __future__ import annotations

import pytest

from tests.integration.s3server import start_s3_server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 API server (moto_server over HTTP) for one module's tests."""
    server = start_s3_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()
