"""End to end: a Ray cluster of containers, `ray job submit` from the host, a killed worker.

One cluster (head + 2 workers, moto S3, host Prometheus) serves the tests of
this module, in order: a 2-worker DDP job across the two worker containers, a
torchrun-style script under `ray-app run` across them, a submission without the
token (refused), then jobs with a fault mid-training: rank 0's worker container
killed and started again; stopped with a grace period (a preemption) and
started again; the driver stopped (`ray job stop`) and the job submitted again.
Each of these ends on the uninterrupted job's parameters, bit for bit. Last, with a third worker
container, an elastic job (`scaling.min_workers: 2`) loses a container for good and gains a new one.
"""

from __future__ import annotations

import re
import secrets
import textwrap
import time

import pytest
import torch

from tests.e2e.e2e_cluster import LOG_DIR, ContainerCluster, docker, rank_placements, summary_of, wait_until, world_sizes
from tests.support.checkpoints import checkpoint_model
from tests.support.ddp_script import TRAIN, lines_of, write_scripts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Every job's rank 0 loader sleeps PACE_S per batch (tests/support/faulty_data.py, from the uploaded working dir)
# and the other ranks wait for it in the all-reduce: an epoch of digits takes at least 23 x PACE_S at 2 workers,
# and what a job costs is its steps' compute, not the seconds the tests wait through. 12 epochs (about 1.5 s
# each): long enough for Prometheus to discover and scrape rank 0 (its SD updates every 5 s) and to put a
# fault in after the first checkpoint with seconds of training left; every job trains as many, so the faulted
# ones can be compared with the uninterrupted one
PACE_S = 0.05
PACE = ["--set", "data.name=tests.support.faulty_data:slow_rank",
        "--set", f"data.args={{name: digits, rank: 0, delay_s: {PACE_S}, batch_size: 32}}"]
EPOCHS = 12
JOB = ["--set", f"train.epochs={EPOCHS}", *PACE]
# the elastic job: more epochs than the test waits for: the test stops it once the group has
# shrunk, grown back and finished an epoch at 3; a job that could end first made the test a race with the
# join (one local run grew back in epoch 76 of 80)
ELASTIC_EPOCHS = 2000
ELASTIC_RESIZE_S = 5
ELASTIC_ACCURACY = 0.9   # digits: an uninterrupted run passes 0.95 within its first epochs


@pytest.fixture(scope="module")
def cluster(image, test_secrets, tmp_path_factory):
    c = ContainerCluster(image, test_secrets, tmp_path_factory.mktemp("cluster"))
    t0 = time.monotonic()
    try:
        c.start()
        print(f"\n[e2e] cluster of containers up in {time.monotonic() - t0:.1f}s")
        yield c
    finally:
        c.stop()


def run_name(kind: str) -> str:
    return f"e2e-{kind}-{secrets.token_hex(3)}"


def final_parameters(cluster, summary: dict) -> dict:
    """The model of the summary's (newest) checkpoint, every rank's share read from the S3 store."""
    return checkpoint_model(summary["checkpoint"], cluster.s3.env())


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


@pytest.fixture(scope="module")
def uninterrupted(cluster):
    """Job 1: `ray job submit` of the cluster config, no fault. (run, submission id, its result, logs, seconds)."""
    run, sid = run_name("ddp"), run_name("job")
    t0 = time.monotonic()
    out = cluster.submit(sid, ["--set", f"run.name={run}", *JOB], timeout=600)
    logs = cluster.job_logs(sid) or out.stdout
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    return run, sid, out, logs, time.monotonic() - t0


@pytest.fixture(scope="module")
def reference(cluster, uninterrupted) -> dict:
    """The uninterrupted job's final parameters."""
    _, _, out, logs, _ = uninterrupted
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    return final_parameters(cluster, summary_of(logs))


def test_ddp_job_across_worker_containers(cluster, uninterrupted):
    """`ray job submit` with the token: 2 ranks on 2 containers, checkpoints in S3, metrics in Prometheus."""
    run, sid, out, logs, seconds = uninterrupted
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert cluster.job_status(sid) == "SUCCEEDED"
    print(f"\n[e2e] job 1 ({EPOCHS} epochs) submitted and finished in {seconds:.1f}s")

    # Ranks on different worker containers (the loop prints one line per rank at start).
    placed = rank_placements(logs)
    assert set(placed) == {0, 1}, logs[-3000:]
    worker_ips = {cluster.ip_of(w) for w in cluster.workers}
    ips = {ip for _, ip in placed.values()}
    assert len(ips) == 2 and ips == worker_ips, (placed, worker_ips)
    assert cluster.ip_of(cluster.head) not in ips  # the head does no training work

    summary = summary_of(logs)
    assert summary["run"] == run and summary["epochs"] == EPOCHS and summary["resumed_from_step"] == 0
    assert summary["checkpoint"].startswith(f"s3://ray-app/runs/{run}/ckpt-s")

    # Checkpoints in the S3 store, each committed by its manifest; the summary names the newest.
    steps = cluster.s3.committed_steps(run)
    assert steps and steps[-1] == summary["global_step"], (steps, summary)
    assert f"s3://ray-app/runs/{run}/" + summary["checkpoint"].rsplit("/", 1)[1] + "/manifest.json" in \
        {f"s3://ray-app/{k}" for k in cluster.s3.keys(f"runs/{run}/")}

    # Prometheus scraped rank 0's exporter on its worker container.
    rank0_ip = placed[0][1]
    info = wait_until(lambda: cluster.prometheus.query(f'last_over_time(ray_app_info{{run="{run}"}}[10m])'), 30, what="ray_app_info in Prometheus")
    assert info[0]["metric"]["instance"] == f"{rank0_ip}:9500"
    world = cluster.prometheus.query(f'max_over_time(ray_app_world_size{{instance="{rank0_ip}:9500"}}[10m])')
    assert float(world[0]["value"][1]) == 2
    step = cluster.prometheus.query(f'max_over_time(ray_app_global_step{{instance="{rank0_ip}:9500"}}[10m])')
    assert float(step[0]["value"][1]) > 0


def test_torchrun_style_script_runs_unchanged_across_worker_containers(cluster, tmp_path):
    """`ray job submit --working-dir . -- ray-app run train.py`: the script's ranks on the two worker
    containers print the losses the same script prints under torchrun in one container of the image."""
    project = write_scripts(tmp_path)
    args = ["--epochs", "3", "--where"]
    ref = cluster.exec(cluster.head, "sh", "-c", "mkdir -p /tmp/ddp && cat > /tmp/ddp/train.py", stdin=textwrap.dedent(TRAIN))
    assert ref.returncode == 0, ref.stderr
    ref = cluster.exec(cluster.head, "env", "OMP_NUM_THREADS=1", "torchrun", "--standalone", "--nproc-per-node", "2",
                       "train.py", "--epochs", "3", workdir="/tmp/ddp")
    reference = lines_of(ref.stdout + ref.stderr)  # torch 2.13 on CPU may SIGABRT a rank at exit: lines, not rc
    assert reference and reference[-1].startswith("final parameters"), (ref.stdout + ref.stderr)[-3000:]

    run, sid = run_name("script"), run_name("job")
    out = cluster.submit(sid, ["--set", f"run.name={run}", "train.py", *args], config="/app/configs/cluster.yaml",
                         working_dir=project, command="run", timeout=600)
    logs = cluster.job_logs(sid) or out.stdout
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert cluster.job_status(sid) == "SUCCEEDED"
    placed = rank_placements(logs)  # the script's own "rank R/W on host H ip I" line, on every rank
    assert set(placed) == {0, 1}, logs[-3000:]
    assert {ip for _, ip in placed.values()} == {cluster.ip_of(w) for w in cluster.workers}, placed
    assert lines_of(logs) == reference  # every logged step, every eval, the final parameters
    summary = summary_of(logs)
    assert summary["run"] == run and summary["script"] == "train.py" and summary["world_size"] == 2


def test_submit_without_token_is_refused(cluster):
    before = cluster.job_ids()
    for kw in ({"token": None, "auth_mode": False}, {"token": None}, {"token": "0" * 64}):
        out = cluster.submit(run_name("denied"), ["--set", "train.epochs=1"], timeout=120, **kw)
        text = out.stdout + out.stderr
        assert out.returncode != 0, f"{kw}: submission accepted:\n{text[-2000:]}"
        assert re.search(r"unauthori[sz]ed|authentication|token", text, flags=re.I), text[-2000:]
    assert cluster.job_ids() == before  # no job was created


def start_faulted_job(cluster, kind: str) -> tuple[str, str, float, str]:
    """Submit a job without waiting; once its first checkpoint is committed, return (run, submission id,
    start time, the worker container rank 0 runs in: found from the target file rank 0 wrote for
    Prometheus, no log round trip)."""
    cluster.wait_for_exactly_the_workers()  # an earlier test's restarted container is back, its old node gone
    run, sid = run_name(kind), run_name("job")
    t0 = time.monotonic()
    out = cluster.submit(sid, ["--set", f"run.name={run}", *JOB],
                         wait=False, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    def committed_or_ended():
        steps = cluster.s3.committed_steps(run)
        if not steps and cluster.job_status(sid) not in {"RUNNING", "PENDING"}:
            logs = cluster.job_logs(sid)
            (LOG_DIR / f"job-{run}.log").write_text(logs)
            raise AssertionError(f"the job ended before its first checkpoint:\n{logs[-5000:]}")
        return steps

    wait_until(committed_or_ended, 300, interval=0.5, what="the first committed checkpoint", fail_fast=AssertionError)
    rank0_ip = wait_until(lambda: cluster.rank0_ip(run), 30, interval=0.2, what="rank 0's metrics target file")
    victim = cluster.container_by_ip(rank0_ip)
    assert victim in cluster.workers, rank0_ip
    return run, sid, t0, victim


def logged_steps(logs: str) -> list[int]:
    return [int(s) for s in re.findall(r"epoch \d+ step (\d+)/", logs)]


def test_killed_worker_container_resumes_from_newest_checkpoint(cluster, reference):
    """`docker kill` rank 0's container mid-run, start it again: the job resumes and succeeds."""
    run, sid, t0, victim = start_faulted_job(cluster, "kill")
    before_kill = cluster.s3.committed_steps(run)
    docker("kill", victim)
    killed_at = time.monotonic()
    try:
        after_kill = cluster.s3.committed_steps(run)
        assert cluster.job_status(sid) in {"RUNNING", "PENDING"}, "the job ended before the kill; raise EPOCHS"
        time.sleep(2)
    finally:
        docker("start", victim)  # the same container: same `ray start --address head:6379 --block`

    status = cluster.wait_for_job(sid, timeout=480)
    logs = cluster.job_logs(sid)
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    print(f"\n[e2e] job 2 ({EPOCHS} epochs, worker killed {killed_at - t0:.1f}s in) "
          f"finished {status} in {time.monotonic() - t0:.1f}s")
    assert status == "SUCCEEDED", logs[-5000:]
    summary = summary_of(logs)
    resumed = summary["resumed_from_step"]
    committed = cluster.s3.committed_steps(run)
    interval = committed[-1] - committed[-2]  # steps per checkpoint (every epoch)

    # Resumed from the newest checkpoint committed when the worker died: at most
    # one checkpoint interval of training was lost.
    assert resumed >= max(after_kill) >= max(before_kill) > 0, (resumed, before_kill, after_kill)
    assert resumed in committed or resumed < committed[0], (resumed, committed)  # older ones may be pruned (keep=3)
    assert summary["global_step"] == EPOCHS * interval and summary["epochs"] == EPOCHS
    assert re.search(rf"resumed from s3://ray-app/runs/{run}/ckpt-s0*{resumed}-", logs), logs[-5000:]

    # Prometheus saw the resumed worker group's rank 0 export the step it resumed from: the job may end
    # seconds after the resume, and its exporter waits for a scrape of its last values before it closes
    # (ray_app/worker/metrics.py, the final scrape), so they are there by the time the job has ended.
    window = int(time.monotonic() - killed_at) + 5
    seen = wait_until(lambda: cluster.prometheus.query(f"max_over_time(ray_app_resumed_from_step[{window}s]) > 0"),
                      30, what="ray_app_resumed_from_step > 0 in Prometheus")
    assert float(seen[0]["value"][1]) == resumed

    assert_bit_identical(final_parameters(cluster, summary), reference)


def test_stopped_worker_container_checkpoints_at_the_sigterm_and_no_step_is_lost(cluster, reference):
    """`docker stop -t 30` of rank 0's container mid-epoch (a preemption with a grace period): its
    `ray start` drains the node, every rank checkpoints at the next step boundary, the container exits
    on its own; started again, the group resumes from that step and ends bit-identical."""
    run, sid, t0, victim = start_faulted_job(cluster, "stop")
    before = logged_steps(cluster.job_logs(sid))
    committed_before = cluster.s3.committed_steps(run)
    stopped_at = time.monotonic()
    try:
        docker("stop", "-t", "30", victim, timeout=90)
        stop_seconds = time.monotonic() - stopped_at
        exit_code = int(docker("inspect", "-f", "{{.State.ExitCode}}", victim).stdout.strip())
        assert exit_code != 137, "the container was SIGKILLed at the end of its grace period"  # it left by itself
        assert cluster.job_status(sid) in {"RUNNING", "PENDING"}, "the job ended before the stop; raise EPOCHS"
    finally:
        docker("start", victim)  # the next tests need the cluster whole, whatever happened here

    status = cluster.wait_for_job(sid, timeout=480)
    logs = cluster.job_logs(sid)
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    assert status == "SUCCEEDED", logs[-5000:]
    assert "ray-app: Ray's drain notice for this node: checkpointing at the next step boundary" in logs, logs[-5000:]
    m = re.search(r"preempted: checkpoint (\S+) at step (\d+) committed", logs)
    assert m, logs[-5000:]
    step = int(m.group(2))
    assert step >= max(before + committed_before), (step, before, committed_before)  # after the last step seen
    summary = summary_of(logs)
    assert summary["resumed_from_step"] == step and summary["global_step"] > step
    resumed = re.search(rf"resumed from s3://ray-app/runs/{run}/ckpt-s0*{step}-\S+ at epoch \d+ batch (\d+)", logs)
    assert resumed, logs[-5000:]
    print(f"\n[e2e] docker stop -t 30 of rank 0's container: checkpoint at step {step} (batch "
          f"{resumed.group(1)} of its epoch), container gone in {stop_seconds:.1f}s (exit {exit_code}); "
          f"job finished in {time.monotonic() - t0:.1f}s")
    assert_bit_identical(final_parameters(cluster, summary), reference)


def test_stopped_driver_checkpoints_and_a_resubmit_resumes_with_no_step_lost(cluster, reference):
    """A job stop (the jobs API's, which `ray job stop` calls: SIGTERM to the driver): the workers checkpoint
    at the next step boundary and the job ends STOPPED; the same job submitted again resumes from that step
    and ends bit-identical."""
    run, sid, t0, _ = start_faulted_job(cluster, "driver")
    before = cluster.s3.committed_steps(run)  # no log round trip first: the job is only ~12 s long
    stopped_at = time.monotonic()
    assert cluster.jobs_api(f"{sid}/stop", method="POST")["stopped"]  # at once: no CLI to start first
    assert cluster.wait_for_job(sid, timeout=120) == "STOPPED"
    stop_seconds = time.monotonic() - stopped_at
    logs = cluster.job_logs(sid)
    (LOG_DIR / f"job-{run}-stopped.log").write_text(logs)
    m = re.search(r"stopped: checkpoint (\S+) at step (\d+) committed", logs)
    assert m, logs[-5000:]
    step = int(m.group(2))
    assert step >= max(before) and step in cluster.s3.committed_steps(run), (step, before)

    again = run_name("job")
    out = cluster.submit(again, ["--set", f"run.name={run}", *JOB], timeout=600)
    logs = cluster.job_logs(again) or out.stdout
    (LOG_DIR / f"job-{run}.log").write_text(logs)
    assert out.returncode == 0, logs[-5000:]
    summary = summary_of(logs)
    assert summary["resumed_from_step"] == step, (summary, step)
    print(f"\n[e2e] ray job stop: checkpoint at step {step}, job STOPPED {stop_seconds:.1f}s after the "
          f"stop; resubmitted, resumed there; {time.monotonic() - t0:.1f}s in all")
    assert_bit_identical(final_parameters(cluster, summary), reference)


def after(logs: str, line: str) -> str:
    """The job's output after the first occurrence of ``line`` (a restart's line is unique: a pid, a step)."""
    i = logs.find(line)
    return logs[i + len(line):] if i >= 0 else ""


def test_a_lost_worker_shrinks_the_world_to_min_workers_and_a_new_one_grows_it_back(cluster):
    """3 worker containers, `scaling.min_workers: 2`: one removed for good mid-run, Ray Train restarts
    the group with the 2 left without anyone acting (the loop re-shards the rest of the epoch); a new
    container joins and within `scaling.resize_interval_s` the group grows back to 3, and its first epoch
    evaluates above ELASTIC_ACCURACY. Then `ray job stop`: a committed checkpoint and the job STOPPED."""
    if len(cluster.workers) < 3:
        cluster.add_worker()
    cluster.wait_for_exactly_the_workers()  # no node an earlier test lost still counted: a group of 3 fits
    run, sid = run_name("elastic"), run_name("job")
    args = ["--set", f"run.name={run}", "--set", f"train.epochs={ELASTIC_EPOCHS}", "--set", "scaling.num_workers=3",
            "--set", "scaling.min_workers=2", "--set", f"scaling.resize_interval_s={ELASTIC_RESIZE_S}", *PACE]
    t0 = time.monotonic()
    out = cluster.submit(sid, args, wait=False, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        # the precondition: a group of 3 training, and a checkpoint of its own to shrink from (Ray's view of
        # a node that just joined lags: the group may start at 2 and grow)
        wait_until(lambda: world_sizes(cluster.job_logs(sid))[-1:] == [3], 240, interval=1,
                   what="the group training at 3 workers")
        at_three_line = [ln for ln in cluster.job_logs(sid).splitlines() if re.search(r"epochs, world size 3$", ln)][-1]
        at_three = max(cluster.s3.committed_steps(run), default=-1)
        wait_until(lambda: max(cluster.s3.committed_steps(run), default=-1) > at_three, 120, interval=0.5,
                   what="a checkpoint committed by the group of 3")

        lost = cluster.workers[-1]
        cluster.remove_worker(lost)
        lost_at = time.monotonic()
        shrunk = wait_until(lambda: re.search(r"world size 3 -> 2: .*", after(cluster.job_logs(sid), at_three_line)),
                            240, interval=2, what="the group restarted with 2 workers")
        shrunk_at = time.monotonic()

        joined = cluster.add_worker()
        joined_at = time.monotonic()
        grown = wait_until(lambda: re.search(r"world size 2 -> 3: [\s\S]*?epoch \d+ done: .* eval_accuracy ([\d.]+)",
                                             after(cluster.job_logs(sid), shrunk.group(0))), 240, interval=2,
                           what="the group grown back to 3 workers and an epoch done")
        grown_at = time.monotonic()
        assert world_sizes(cluster.job_logs(sid))[-1] == 3

        assert cluster.jobs_api(f"{sid}/stop", method="POST")["stopped"]
        status = cluster.wait_for_job(sid, timeout=180)
        logs = cluster.job_logs(sid)
        (LOG_DIR / f"job-{run}.log").write_text(logs)
        assert status == "STOPPED", logs[-5000:]
        stopped = re.search(r"stopped: checkpoint (\S+) at step (\d+) committed", logs)
        assert stopped and int(stopped.group(2)) in cluster.s3.committed_steps(run), logs[-5000:]
        print(f"\n[e2e] elastic: {lost} removed {lost_at - t0:.1f}s in; training again at 2 workers "
              f"{shrunk_at - lost_at:.1f}s later ({shrunk.group(0)[:90]}); {joined} joined, the group at 3 "
              f"{grown_at - joined_at:.1f}s later (resize interval {ELASTIC_RESIZE_S}s); its first epoch's "
              f"eval_accuracy {grown.group(1)}; stopped at step {stopped.group(2)}; {time.monotonic() - t0:.1f}s in all")
    except BaseException:  # what the controller decided, where CI shows only the failure's output
        logs = cluster.job_logs(sid)
        (LOG_DIR / f"job-{run}.log").write_text(logs)
        head = cluster.save_head_logs(f"head-{run}.log").read_text()
        said = [ln for ln in head.splitlines() if re.search(r"Detected|Deciding|Attempting|FailurePolicy|Error|dead|DEAD", ln)]
        kit = [ln for ln in logs.splitlines() if re.search(r"ray-app:|world size|resumed from|SIGTERM", ln)]
        print("\n[e2e] elastic failed; the job's restarts and world sizes:\n" + "\n".join(ln[:300] for ln in kit[-30:]) +
              "\n[e2e] its last lines:\n" + "\n".join(logs.splitlines()[-10:]) +
              "\n[e2e] the controller and GCS:\n" + "\n".join(ln[:300] for ln in said[-40:]))
        raise
    assert float(grown.group(1)) >= ELASTIC_ACCURACY, grown.group(0)[-300:]
