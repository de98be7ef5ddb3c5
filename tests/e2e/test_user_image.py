"""End to end: a user's own code in an image built FROM the kit's, on a cluster of containers.

The Dockerfiles are the ones docs/containers.md shows ("Your own code in an image built FROM the
kit's"), read from the docs, so the docs stay true to what works. The project is the one of the
integration tests (tests/support/user_project.py: package ``acme`` and ``my.yaml``).

- the PYTHONPATH variant is built FROM the kit's image; a head and two workers of that image
  (the harness of test_cluster.py, a cluster of its own) run ``ray job submit`` with no
  ``--working-dir``: the driver (the head's WORKDIR) and both ranks, one per worker container,
  import ``acme`` from the image, and checkpoints go to the S3 store;
- the ``pip install`` variant (a project with a pyproject.toml) is built and imports ``acme`` from
  the image's virtualenv, as the numeric non-root user.
"""

from __future__ import annotations

import math
import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_cluster import LOG_DIR, REPO, ContainerCluster, docker, rank_placements, summary_of
from tests.support.tools import venv_tool
from tests.support.user_project import N_EVAL, N_TRAIN, write_project

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DOCS = REPO / "docs" / "containers.md"
SECTION = "## Your own code in an image built FROM the kit's"
PROJECT = "/home/ray/project"  # where the documented Dockerfiles put the project
EPOCHS, BATCH = 3, 16          # my.yaml's; 2 ranks -> ceil(ceil(301 / 2) / 16) = 10 steps per epoch

PYPROJECT = """
    [build-system]
    requires = ["setuptools"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "acme"
    version = "1.0"

    [tool.setuptools]
    packages = ["acme"]
"""


def documented_dockerfiles() -> list[str]:
    """The ```Dockerfile blocks of the docs' section, in order."""
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```Dockerfile\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, f"expected the PYTHONPATH and the pip variant in {SECTION!r}, found {len(blocks)}"
    return blocks


def from_kit(dockerfile: str, kit_image: str) -> str:
    """The documented Dockerfile built FROM the image under test (IMAGE may name another tag)."""
    assert re.search(r"^FROM ray-app:0\.1\.0$", dockerfile, flags=re.M), dockerfile
    return re.sub(r"^FROM ray-app:0\.1\.0$", f"FROM {kit_image}", dockerfile, flags=re.M)


def build_user_image(kit_image: str, dockerfile: str, context: Path, tag: str) -> None:
    (context / "Dockerfile").write_text(from_kit(dockerfile, kit_image))
    t0 = time.monotonic()
    out = docker("build", "-t", tag, str(context), check=False, timeout=600)
    (LOG_DIR / f"build-{tag.split(':')[0]}.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"\n[e2e] user image {tag} built in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------ no Docker needed

def test_documented_dockerfiles_lint_clean():
    for dockerfile in documented_dockerfiles():
        out = subprocess.run([venv_tool("hadolint"), "-"], input=dockerfile, capture_output=True, text=True)
        assert out.returncode == 0, dockerfile + out.stdout + out.stderr


# ------------------------------------------------------------ the PYTHONPATH variant on a cluster

@pytest.fixture(scope="module")
def user_image(image, tmp_path_factory):
    tag = f"ray-app-e2e-acme:{secrets.token_hex(3)}"
    context = write_project(tmp_path_factory.mktemp("acme-image"))
    build_user_image(image, documented_dockerfiles()[0], context, tag)
    try:
        yield tag
    finally:
        docker("rmi", "-f", tag, check=False)


@pytest.fixture(scope="module")
def cluster(user_image, test_secrets, tmp_path_factory):
    c = ContainerCluster(user_image, test_secrets, tmp_path_factory.mktemp("user-cluster"), log_prefix="user-")
    t0 = time.monotonic()
    try:
        c.start()
        print(f"\n[e2e] cluster of {user_image} containers up in {time.monotonic() - t0:.1f}s")
        yield c
    finally:
        c.stop()


def test_user_image_keeps_the_kits_user_and_adds_only_the_project(image, user_image):
    assert docker("inspect", "-f", "{{.Config.User}} {{.Config.WorkingDir}}", user_image).stdout.split() == \
        ["1000:1000", "/app"]
    where = "import acme.data, acme.model, acme.task; print(acme.__file__)"
    assert docker("run", "--rm", user_image, "python", "-c", where).stdout.strip() == f"{PROJECT}/acme/__init__.py"
    kit = docker("run", "--rm", image, "python", "-c", where, check=False)  # the kit's own image has no acme
    assert kit.returncode != 0 and "No module named 'acme'" in kit.stderr


def test_job_without_working_dir_trains_the_code_in_the_image(cluster):
    """`ray job submit -- ray-app train --config /home/ray/project/my.yaml`: nothing uploaded."""
    run, sid = f"e2e-acme-{secrets.token_hex(3)}", f"e2e-job-{secrets.token_hex(3)}"
    t0 = time.monotonic()
    out = cluster.submit(sid, ["--set", "run.storage=s3://ray-app/runs", "--set", f"run.name={run}"],
                         config=f"{PROJECT}/my.yaml", working_dir=False, timeout=600)
    seconds = time.monotonic() - t0
    logs = cluster.job_logs(sid) or out.stdout
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert cluster.job_status(sid) == "SUCCEEDED"
    print(f"\n[e2e] acme job ({EPOCHS} epochs) from the user image submitted and finished in {seconds:.1f}s")

    # Both ranks imported acme from the image, each in its own worker container.
    placed = rank_placements(logs)
    assert set(placed) == {0, 1}, logs[-3000:]
    ips = {ip for _, ip in placed.values()}
    assert len(ips) == 2 and ips == {cluster.ip_of(w) for w in cluster.workers}, placed

    summary = summary_of(logs)  # the last JSON line: '{"run": ...'
    assert next(iter(summary)) == "run" and summary["run"] == run and summary["epochs"] == EPOCHS
    assert summary["global_step"] == EPOCHS * math.ceil(math.ceil(N_TRAIN / 2) / BATCH)
    assert {"eval_hits", "eval_nll"} <= summary.keys() and "eval_accuracy" not in summary
    assert summary["num_eval_samples"] == N_EVAL  # exact eval: the sampler's padding at 2 ranks dropped
    assert 0.5 < summary["eval_hits"] <= 1.0
    assert summary["checkpoint"].startswith(f"s3://ray-app/runs/{run}/ckpt-s")
    assert cluster.s3.committed_steps(run)[-1] == summary["global_step"]


# ------------------------------------------------------------ the pip variant

def test_pip_installed_project_imports_from_the_venv(image, tmp_path):
    tag = f"ray-app-e2e-acme-pip:{secrets.token_hex(3)}"
    context = write_project(tmp_path, {"pyproject.toml": PYPROJECT})
    build_user_image(image, documented_dockerfiles()[1], context, tag)
    try:
        assert docker("inspect", "-f", "{{.Config.User}}", tag).stdout.strip() == "1000:1000"
        out = docker("run", "--rm", "-w", "/", tag, "sh", "-c",
                     "id -u; python -c 'import acme.data, acme.model, acme.task; print(acme.__file__)'").stdout
        uid, path = out.split()
        assert uid == "1000" and path.startswith("/opt/venv/lib/") and path.endswith("/site-packages/acme/__init__.py")
    finally:
        docker("rmi", "-f", tag, check=False)
