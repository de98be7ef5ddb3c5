"""What the integration tests share: one token-auth Ray head for every test that submits jobs to a cluster."""

from __future__ import annotations

import pytest

from tests.support.processes import token_ray_head


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory, port_picker):
    """``ray start --head`` with token auth, dashboard on 127.0.0.1 (2 CPUs), started once for the session and
    stopped by its own processes at the end. Jobs run one at a time, so tests can share it."""
    with token_ray_head(tmp_path_factory.mktemp("ray-home"), port_picker(), port_picker(), {"OMP_NUM_THREADS": "1"}) as head:
        yield head
