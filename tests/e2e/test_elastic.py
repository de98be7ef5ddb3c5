"""End to end, elastic: 3 worker containers, `scaling.min_workers: 2`.

One worker container is removed for good mid-run: Ray Train restarts the group with the 2 that are
left, without anyone acting, the loop re-shards the rest of the epoch over them and training goes on.
A new container joins: within `scaling.resize_interval_s` the group grows back to 3. The job succeeds
above the accuracy the test states.
"""

from __future__ import annotations

import re
import secrets
import time

import pytest
from e2e_cluster import LOG_DIR, ContainerCluster, summary_of, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EPOCHS = 40           # long enough for a loss, a restart at 2, a join and a restart at 3
RESIZE_INTERVAL_S = 5
ACCURACY_BOUND = 0.9  # digits, 40 epochs: an uninterrupted run ends near 0.97


@pytest.fixture(scope="module")
def cluster(image, test_secrets, tmp_path_factory):
    c = ContainerCluster(image, test_secrets, tmp_path_factory.mktemp("elastic"), workers=3, log_prefix="elastic-")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_a_lost_worker_shrinks_the_world_to_min_workers_and_a_new_one_grows_it_back(cluster):
    run, sid = f"e2e-elastic-{secrets.token_hex(3)}", f"e2e-job-{secrets.token_hex(3)}"
    args = ["--set", f"run.name={run}", "--set", f"train.epochs={EPOCHS}", "--set", "scaling.num_workers=3",
            "--set", "scaling.min_workers=2", "--set", f"scaling.resize_interval_s={RESIZE_INTERVAL_S}"]
    t0 = time.monotonic()
    out = cluster.submit(sid, args, wait=False, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until(lambda: cluster.s3.committed_steps(run), 300, interval=0.5, what="the first committed checkpoint")

    lost = cluster.workers[-1]
    cluster.remove_worker(lost)
    lost_at = time.monotonic()
    shrunk = wait_until(lambda: re.search(r"world size 3 -> 2: .*", cluster.job_logs(sid)), 240, interval=2,
                        what="the group restarted with 2 workers")
    shrunk_at = time.monotonic()
    assert cluster.job_status(sid) == "RUNNING", "the job ended before a worker joined; raise EPOCHS"

    joined = cluster.add_worker()
    joined_at = time.monotonic()
    wait_until(lambda: re.search(r"world size 2 -> 3: ", cluster.job_logs(sid)), 240, interval=2,
               what="the group grown back to 3 workers")
    grown_at = time.monotonic()

    status = cluster.wait_for_job(sid, timeout=600)
    logs = cluster.job_logs(sid)
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    assert status == "SUCCEEDED", logs[-5000:]
    summary = summary_of(logs)
    print(f"\n[e2e] elastic: {lost} removed {lost_at - t0:.1f}s in; training again at 2 workers "
          f"{shrunk_at - lost_at:.1f}s later ({shrunk.group(0)[:90]}); {joined} joined, the group at 3 "
          f"{grown_at - joined_at:.1f}s later (resize interval {RESIZE_INTERVAL_S}s); "
          f"eval_accuracy {summary['eval_accuracy']:.4f}; {time.monotonic() - t0:.1f}s in all")
    assert summary["world_size"] == 3 and summary["epochs"] == EPOCHS
    assert summary["num_eval_samples"] == 359  # every eval sample once, at each world size
    assert summary["eval_accuracy"] >= ACCURACY_BOUND, summary
