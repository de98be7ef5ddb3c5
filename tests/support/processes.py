"""The processes the tests start and stop: ``python -m ray_app``, a token-auth Ray head, Ray Train workers."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def run_cli(args: list[str], env: dict | None = None, timeout: float = 120, cwd: str | os.PathLike | None = None,
            console_script: bool = False):
    """Run ``python -m ray_app ARGS`` (or the ``ray-app`` console script, which unlike ``-m`` does not put
    the working directory on sys.path itself); returns (returncode, stdout, stderr).

    ``env`` entries are added to (not replacing) this process's environment;
    an entry whose value is None removes that variable (e.g. ``{"RAY_ADDRESS": None}``).
    ``cwd`` defaults to the repository root, where configs/local.yaml lives.
    """
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    command = [str(Path(sys.executable).parent / "ray-app")] if console_script else [sys.executable, "-m", "ray_app"]
    # a session of its own: a command past its timeout is ended with the local Ray it started
    with subprocess.Popen([*command, *args], cwd=str(cwd or REPO), env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # what it printed before it was killed: why it hung
            snapshot = busiest()
            _kill_group(proc)
            exc.stdout, exc.stderr = proc.communicate()
            raise CommandTimedOut(exc, "ray-app " + " ".join(args), snapshot) from None
    return proc.returncode, stdout, stderr


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


class CommandTimedOut(AssertionError):
    """A command run by ``run_cli`` past its timeout, with the tails of what it printed."""

    def __init__(self, exc: subprocess.TimeoutExpired, command: str, processes: str):
        def tail(text) -> str:
            if isinstance(text, bytes):
                text = text.decode(errors="replace")
            return (text or "")[-4000:]

        super().__init__(f"{command} timed out after {exc.timeout:g} s\n--- stdout (tail):\n{tail(exc.stdout)}"
                         f"\n--- stderr (tail):\n{tail(exc.stderr)}\n--- busiest processes:\n{processes}")


def busiest(n: int = 12) -> str:
    """This machine's processes by CPU time used, one line each: what a hung command's machine was doing."""
    import psutil

    rows = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times", "memory_info", "status"]):
        try:
            cpu = sum(p.info["cpu_times"][:2]) if p.info["cpu_times"] else 0.0
            rss = p.info["memory_info"].rss >> 20 if p.info["memory_info"] else 0
            cmd = " ".join(p.info["cmdline"] or [p.info["name"] or ""])[:160]
            rows.append((cpu, f"{p.info['pid']:>7} {cpu:8.1f}s {rss:6d}MB {p.info['status']:<9} {cmd}"))
        except (psutil.Error, TypeError):
            continue
    return "\n".join(line for _, line in sorted(rows, reverse=True)[:n])


def train_workers(pid: int) -> list:
    """The Ray Train worker processes under process ``pid`` (a driver that started its own Ray)."""
    import psutil

    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


MARKER = "RAY_APP_TEST_CLUSTER"  # in the environment of every process of a head a test started


def processes_marked(marker: str) -> list:
    """This user's processes whose environment holds ``RAY_APP_TEST_CLUSTER=marker``: the head's GCS,
    raylet, dashboard and monitors, its workers and job drivers (they inherit it), and nothing else."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == marker:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def stop_marked(marker: str, grace_s: float = 15) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, every process carrying ``marker``; the pids still there after."""
    import psutil

    for _ in range(3):  # a process may start another while the first ones stop
        procs = [p for p in marked_tree(marker) if p.pid != os.getpid()]
        if not procs:
            return []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in marked_tree(marker)]


def marked_tree(marker: str) -> list:
    """The processes carrying ``marker`` and every process under them: Ray's agents (the dashboard agent,
    the runtime-env agent) and its workers rename themselves, which can blank what ``/proc`` shows of
    their environment, but they stay the raylet's children."""
    import psutil

    found = {p.pid: p for p in processes_marked(marker)}
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in p.children(recursive=True)})
    return list(found.values())


@contextlib.contextmanager
def token_ray_head(home: Path, gcs: int, dashboard: int, extra_env: dict | None = None):
    """``ray start --head`` with token auth, dashboard on 127.0.0.1 (2 CPUs); yields its env and addresses.

    Stopped by its own processes (``stop_marked``), never ``ray stop``, which stops every Ray on the machine."""
    import secrets

    from tests.support.ports import free_port

    bin_dir = Path(sys.executable).parent
    marker = secrets.token_hex(8)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))},
           "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), MARKER: marker,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **(extra_env or {})}
    # free ports for the servers Ray gives fixed defaults: the dashboard agent's HTTP server (the job API's
    # agent: 52365) and Ray Client's (10001) would be taken by whichever Ray on the machine started first; a
    # temp dir of its own (short: it holds the sockets), since a job's driver finds its cluster through the
    # temp dir's `ray_current_cluster`, which the newest `ray start` on the machine writes into /tmp/ray's
    temp_dir = tempfile.mkdtemp(prefix="ray-head-", dir="/tmp")
    start = [str(bin_dir / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=2", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", "--disable-usage-stats", "--include-dashboard=true",
             f"--temp-dir={temp_dir}", f"--dashboard-agent-listen-port={free_port()}",
             f"--ray-client-server-port={free_port()}"]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, text=True, timeout=180)
        yield {"env": env, "marker": marker, "gcs": f"127.0.0.1:{gcs}", "jobs": f"http://127.0.0.1:{dashboard}"}
    finally:
        # 5 s: a raylet whose GCS goes with it waits for the GCS past 15 s of SIGTERM; the head's work is done
        left = stop_marked(marker, grace_s=5)
        assert not left, f"processes of the test's Ray head still running: {left}"
        shutil.rmtree(temp_dir, ignore_errors=True)
