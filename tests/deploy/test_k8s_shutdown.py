"""How the Ray pods stop: the SIGTERM reaches `ray start`, and each pod's
grace period outlasts what it waits for.

KubeRay (ray-operator/controllers/ray/common/pod.go, 1.6 to 1.7) runs a Ray
container that has no command of its own as
    /bin/bash -c -- "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ... --block"
(`-cl` where the operator sets ENABLE_LOGIN_SHELL=true) and adds no preStop
hook. bash (5.1+; the images have 5.2) execs the last command, so `ray start`
is PID 1 and the kubelet's SIGTERM reaches its handler, which drains the node
for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S and then stops its processes. On the
head, Ray's job supervisor gives a stopped driver RAY_JOB_STOP_WAIT_TIME_S
before its SIGKILL (`ray job stop`, and KubeRay's stop on RayJob deletion)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.k8s import (
    DEPLOYABLE,
    OVERLAYS,
    REPO,
    one,
    rayjob_templates,
    render,
    render_user_overlay,
    validate_crd,
)

DRAIN = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
STOP_WAIT = "RAY_JOB_STOP_WAIT_TIME_S"
RAY_DEFAULT_DRAIN_S = 30.0  # ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
# After its drain, `ray start` stops its processes one by one: SIGTERM, up to 1 s, SIGKILL
# (node.py, _kill_process_impl). The grace period must leave it that long past the drain.
MARGIN_S = 15
DOCS = REPO / "docs" / "kubernetes.md"


def env_values(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


def stop_windows(rayjob: dict) -> dict[str, dict]:
    """{'head' | 'workers/<group>': {grace, drain, stop_wait}} as the pods would read them."""
    out = {}
    for name, template in rayjob_templates(rayjob).items():
        if name == "submitter":
            continue
        env = env_values(template["spec"]["containers"][0])  # the Ray container: KubeRay's index 0
        out[name] = {
            "grace": template["spec"].get("terminationGracePeriodSeconds", 30),  # Kubernetes' default
            "drain": float(env.get(DRAIN, RAY_DEFAULT_DRAIN_S)),
            # the job supervisor parses it with int(): a "60.0" would fail the stop
            "stop_wait": int(env[STOP_WAIT]) if STOP_WAIT in env else None,
        }
    return out


def check_windows(windows: dict[str, dict]) -> None:
    workers = {k: w for k, w in windows.items() if k.startswith("workers/")}
    head = windows["head"]
    assert workers, "no worker group"
    for name, w in workers.items():
        assert w["drain"] > RAY_DEFAULT_DRAIN_S, f"{name}: {DRAIN} not raised above Ray's 30 s"
        assert w["grace"] >= w["drain"] + MARGIN_S, (
            f"{name}: grace period {w['grace']} s leaves `ray start` less than {MARGIN_S} s after its "
            f"{w['drain']} s drain: the kubelet's SIGKILL would cut the checkpoint or the shutdown")
    assert head["stop_wait"] is not None, f"head: no {STOP_WAIT}: Ray SIGKILLs a stopped driver after 3 s"
    slowest_worker = max(w["drain"] for w in workers.values())
    assert head["stop_wait"] >= slowest_worker, (
        f"head: {STOP_WAIT}={head['stop_wait']} is shorter than the workers' drain ({slowest_worker} s): "
        "a stop would SIGKILL the driver before the checkpoint a drain gets time for")
    assert head["drain"] > head["stop_wait"] and head["drain"] > slowest_worker, (
        f"head: {DRAIN}={head['drain']} must outlast the driver's stop and the workers' drain, "
        "or GCS and the driver go first")
    assert head["grace"] >= head["drain"] + MARGIN_S, f"head: grace period {head['grace']} s vs drain {head['drain']} s"
    assert head["stop_wait"] < head["grace"], f"head: {STOP_WAIT} outlasts the pod's grace period"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_every_pod_outlasts_what_it_waits_for(rel):
    check_windows(stop_windows(one(render(rel), "RayJob")))


def test_the_window_check_catches_each_broken_rule():
    good = stop_windows(one(render("base"), "RayJob"))
    check_windows(good)
    broken = {
        "worker grace": ("workers/workers", "grace", good["workers/workers"]["drain"] + MARGIN_S - 1),
        "worker drain": ("workers/workers", "drain", RAY_DEFAULT_DRAIN_S),
        "stop wait": ("head", "stop_wait", int(good["workers/workers"]["drain"]) - 1),
        "head drain": ("head", "drain", good["head"]["stop_wait"]),
        "head grace": ("head", "grace", good["head"]["drain"]),
        "no stop wait": ("head", "stop_wait", None),
    }
    for what, (pod, key, value) in broken.items():
        windows = yaml.safe_load(yaml.safe_dump(good))
        windows[pod][key] = value
        try:
            check_windows(windows)
        except AssertionError:
            continue
        pytest.fail(f"{what}: not caught")


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_ray_containers_leave_their_command_to_kuberay(rel):
    """The SIGTERM reaches `ray start` only through KubeRay's own command line:
    a container command or args of ours (KubeRay would put them before
    `ray start` with `&&`) or the overwrite annotation could keep bash as PID 1,
    and PID 1 without a handler never sees a SIGTERM. No preStop hook either:
    it would run before the SIGTERM, on the grace period's clock."""
    for name, template in rayjob_templates(one(render(rel), "RayJob")).items():
        if name == "submitter":
            continue
        container = template["spec"]["containers"][0]
        assert "command" not in container and "args" not in container, f"{rel} {name}: {container.get('command')}"
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        assert annotations.get("ray.io/overwrite-container-cmd", "false").lower() != "true", f"{rel} {name}"
        assert "preStop" not in (container.get("lifecycle") or {}), f"{rel} {name}: a preStop hook"


# Stands in for `ray start --block`: a Python process with a SIGTERM handler that takes a moment
# (the drain) and exits 0. It writes its PID to a file (a login shell's profile may print).
RAY_START = """\
import os, signal, sys, time
def drain(signum, frame):
    time.sleep(0.3)
    print("drained", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
sys.exit(3)
"""


def kuberay_container_command(login: bool) -> list[str]:
    """utils.GetContainerCommand: /bin/bash -c -- (with "l" appended for ENABLE_LOGIN_SHELL=true)."""
    return ["/bin/bash", "-c" + ("l" if login else ""), "--"]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the container command exited with {proc.returncode}: {proc.communicate()}"
        assert time.monotonic() < deadline, "the stand-in for `ray start` never started"
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="no /bin/bash")
@pytest.mark.parametrize("login", [False, True], ids=["bash -c", "bash -cl"])
def test_kuberays_command_line_hands_the_sigterm_to_ray_start(tmp_path, login):
    """KubeRay's command line, with a Python stand-in for `ray`: bash must
    exec it (same PID, so in the container it is PID 1, the process the
    kubelet signals), and a SIGTERM to that PID must run its handler."""
    ray = tmp_path / "ray"
    ray.write_text(RAY_START)
    pid_file = tmp_path / "ray-start.pid"
    line = (f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; "
            f"{shlex.quote(sys.executable)} {shlex.quote(str(ray))} {shlex.quote(str(pid_file))} --block")
    proc = subprocess.Popen([*kuberay_container_command(login), line], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=dict(os.environ, HOME=str(tmp_path)))
    try:
        pid = int(wait_for_file(pid_file, proc))
        assert pid == proc.pid, (
            f"bash forked `ray start` (pid {pid}) instead of exec'ing it and stays pid {proc.pid}: "
            "as PID 1 it would swallow the kubelet's SIGTERM (needs a preStop hook then)")
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "drained" in out, (proc.returncode, out, err)


def documented_table() -> dict[str, dict]:
    text = DOCS.read_text()
    section = text.split("## Stopping: node drains, spot preemption, deletion", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (head|workers) \| (\d+) \| (\d+) \| (\d+|-) \|$", section, flags=re.M)
    assert {r[0] for r in rows} == {"head", "workers"}, "the table of stop windows is missing a row"
    return {r[0]: {"grace": int(r[1]), "drain": float(r[2]), "stop_wait": None if r[3] == "-" else int(r[3])} for r in rows}


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_the_docs_table_is_what_the_manifests_set(rel):
    windows = stop_windows(one(render(rel), "RayJob"))
    table = documented_table()
    assert windows["head"] == table["head"], f"{rel}: docs/kubernetes.md says {table['head']}"
    worker = dict(windows["workers/workers"], stop_wait=None)  # the supervisor reads it on the head only
    assert worker == table["workers"], f"{rel}: docs/kubernetes.md says {table['workers']}"


BIG_MODEL = "### A big model: raise them together"


def documented_big_model_overlay() -> dict:
    section = DOCS.read_text().split(BIG_MODEL, 1)[1].split("\n#", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one kustomization in {BIG_MODEL!r}, found {len(blocks)}"
    return yaml.safe_load(blocks[0])


@pytest.mark.parametrize("base", OVERLAYS)
def test_the_documented_big_model_overlay_raises_every_window_together(base, tmp_path):
    kustomization = documented_big_model_overlay()
    assert kustomization["resources"] == ["../gpu"]
    kustomization["resources"] = [f"../{base}"]
    job = one(render_user_overlay(kustomization, "big-model", tmp_path), "RayJob")
    validate_crd(job)
    windows = stop_windows(job)
    check_windows(windows)
    original = stop_windows(one(render(f"overlays/{base}"), "RayJob"))
    for pod in windows:
        for key, value in windows[pod].items():
            if value is not None:
                assert value > original[pod][key], f"{pod} {key}: still {value}: the overlay does not raise it"
