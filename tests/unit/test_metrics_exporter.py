"""The rank-0 exporter as Prometheus sees it: real HTTP, real promtool, no Ray.

Each test starts a `PrometheusMetrics` on a free loopback port, feeds it the
calls the train loop makes, and reads http://127.0.0.1:PORT/metrics.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import socket
import stat
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ray_app import __version__
from ray_app.worker.metrics import ADVERTISE_HOST_ENV, LEGACY_EVAL_GAUGES, METRIC_LABELS, METRICS, SD_DIR_ENV, NullMetrics, PrometheusMetrics
from ray_app.worker.pace import RankPace
from tests.support.ports import free_port
from tests.support.tools import promtool

GPU_METRICS = {"ray_app_gpu_memory_allocated_bytes", "ray_app_gpu_memory_max_allocated_bytes"}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


START = dict(model="mlp", dataset="digits", task="classification", version=__version__, world_size=2, resumed_from_step=40,
             global_step=40, epoch=1)


def drive(m: PrometheusMetrics, use_gpu: bool = True, run: str = "unit-run", evals=({"loss": 0.3, "accuracy": 0.91},),
          **start) -> None:
    """The calls one short run makes, in the loop's order (by default a classification task)."""
    m.start(run=run, **{**START, **start}, use_gpu=use_gpu)
    for step in range(41, 61):
        m.on_step(0.012)
        if step % 10 == 0:
            m.on_progress(epoch=1, global_step=step, lr=0.05, train_loss=0.7, samples=640, samples_per_second=5120.0)
            m.on_rank_pace([RankPace(rank=r, host=f"w{r}", step_seconds=0.01 + 0.1 * r, data_wait_seconds=0.1 * r,
                                     wall_seconds=0.12, samples_per_second=266.0) for r in range(2)])
    if use_gpu:
        m.on_gpu_memory(allocated=123_456_789, max_allocated=234_567_890)
    for values in evals:
        m.on_eval(values)
    m.on_checkpoint(blocked_seconds=0.08)


@pytest.fixture(autouse=True)
def no_final_scrape_window(monkeypatch):
    """Close at once unless a test sets the window itself: no Prometheus here comes for the last values."""
    monkeypatch.setenv("RAY_APP_METRICS_FINAL_SCRAPE_S", "0")


@pytest.fixture
def exporter():
    """A started exporter with every metric (GPU gauges included) and its /metrics text."""
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m)
    yield m, scrape(m.serving_port)
    m.close()


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def sample_values(text: str) -> dict:
    """{(sample name, sorted label pairs): value} of one scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def eval_series(text: str) -> dict[str, float]:
    """{name label: value} of the ray_app_eval_metric series."""
    return {dict(labels)["name"]: v for (n, labels), v in sample_values(text).items() if n == "ray_app_eval_metric"}


def test_promtool_check_metrics_reports_no_problems(exporter):
    _, text = exporter
    out = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_every_contract_metric_is_served_with_help_and_type(exporter):
    _, text = exporter
    for name, (kind, help_text) in METRICS.items():
        assert name.startswith("ray_app_")
        assert f"# HELP {name} {help_text}" in text, f"{name}: no HELP line"
        assert f"# TYPE {name} {kind}" in text, f"{name}: no TYPE {kind} line"


def test_values_follow_the_calls(exporter):
    m, text = exporter
    values = sample_values(text)
    v = lambda name: values[(name, ())]  # noqa: E731
    assert v("ray_app_global_step") == 60 and v("ray_app_epoch") == 1
    assert v("ray_app_train_loss") == 0.7 and v("ray_app_samples_per_second") == 5120.0
    assert v("ray_app_samples_processed_total") == 2 * 640
    assert v("ray_app_step_seconds_count") == 20
    assert eval_series(text) == {"loss": 0.3, "accuracy": 0.91}
    assert v("ray_app_eval_accuracy") == 0.91 and v("ray_app_eval_loss") == 0.3
    assert v("ray_app_checkpoint_blocked_seconds_count") == 1
    assert v("ray_app_last_checkpoint_timestamp_seconds") > 1.6e9
    assert v("ray_app_world_size") == 2 and v("ray_app_resumed_from_step") == 40
    assert v("ray_app_worker_group_starts_total") == 1
    assert v("ray_app_gpu_memory_allocated_bytes") == 123_456_789
    info = [k for k in values if k[0] == "ray_app_info"]
    assert info == [("ray_app_info", (("dataset", "digits"), ("model", "mlp"), ("run", "unit-run"), ("task", "classification"),
                                      ("version", __version__)))]


def test_tokens_per_second_and_mfu_are_gauges_nan_until_the_loop_has_them():
    """A token task's tokens/s and, once FLOPs are counted against a known peak, MFU: a gap before (and for a task
    that counts samples), never a fake 0."""
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    m.start(run="r", model="hf", dataset="text", task="causal_lm", version=__version__, world_size=2, resumed_from_step=0)
    try:
        before = sample_values(scrape(m.serving_port))
        assert math.isnan(before[("ray_app_tokens_per_second", ())]) and math.isnan(before[("ray_app_mfu", ())])
        m.on_progress(epoch=0, global_step=20, lr=0.01, train_loss=2.5, samples=64, samples_per_second=32.0)
        assert math.isnan(sample_values(scrape(m.serving_port))[("ray_app_mfu", ())])
        m.on_progress(epoch=0, global_step=40, lr=0.01, train_loss=2.4, samples=64, samples_per_second=32.0,
                      tokens=64 * 511, tokens_per_second=32.0 * 511, mfu=0.4125)
        values = sample_values(scrape(m.serving_port))
        assert values[("ray_app_tokens_per_second", ())] == 32.0 * 511 and values[("ray_app_mfu", ())] == 0.4125
        assert values[("ray_app_samples_per_second", ())] == 32.0
    finally:
        m.close()


def test_eval_gauges_are_nan_until_the_first_eval():
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    m.start(run="r", model="mlp", dataset="digits", task="classification", version=__version__, world_size=2, resumed_from_step=0)
    try:
        text = scrape(m.serving_port)
        assert "ray_app_eval_accuracy NaN" in text and "ray_app_eval_loss NaN" in text
        assert "# TYPE ray_app_eval_metric gauge" in text and eval_series(text) == {}  # no names before the first eval
    finally:
        m.close()


def served_after(evals, **start) -> str:
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m, use_gpu=False, evals=evals, **start)
    try:
        return scrape(m.serving_port)
    finally:
        m.close()


def test_eval_metric_has_one_series_per_name_the_task_reports():
    """A regression task: mse and mae as ray_app_eval_metric{name=...}; no loss/accuracy, so those gauges stay NaN."""
    text = served_after([{"mse": 0.5, "mae": 0.75}, {"mse": 0.25, "mae": 0.4}], task="regression")
    assert 'ray_app_eval_metric{name="mse"} 0.25' in text and 'ray_app_eval_metric{name="mae"} 0.4' in text
    assert eval_series(text) == {"mse": 0.25, "mae": 0.4}  # the last eval's values, nothing else
    values = sample_values(text)
    assert math.isnan(values[("ray_app_eval_loss", ())]) and math.isnan(values[("ray_app_eval_accuracy", ())])
    out = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_a_reported_loss_also_sets_the_legacy_eval_loss_gauge():
    """A language model: loss (kept in ray_app_eval_loss for old dashboards and rules) and perplexity."""
    text = served_after([{"loss": 2.0, "perplexity": math.exp(2.0)}], task="language_model")
    values = sample_values(text)
    assert eval_series(text) == {"loss": 2.0, "perplexity": math.exp(2.0)}
    assert values[("ray_app_eval_loss", ())] == 2.0 and math.isnan(values[("ray_app_eval_accuracy", ())])
    assert LEGACY_EVAL_GAUGES == {"loss": "ray_app_eval_loss", "accuracy": "ray_app_eval_accuracy"}


def test_user_task_metric_names_and_import_paths_are_served_as_label_values():
    text = served_after([{"f1_macro": 0.8, "top5_accuracy": 0.99, "loss": 0.1, "accuracy": 0.95}],
                        model="acme.model:Net", dataset="acme.data:build", task="acme.task:MyTask")
    assert eval_series(text) == {"f1_macro": 0.8, "top5_accuracy": 0.99, "loss": 0.1, "accuracy": 0.95}
    values = sample_values(text)
    assert values[("ray_app_eval_accuracy", ())] == 0.95 and values[("ray_app_eval_loss", ())] == 0.1
    (info,) = [dict(labels) for n, labels in values if n == "ray_app_info"]
    assert (info["model"], info["dataset"], info["task"]) == ("acme.model:Net", "acme.data:build", "acme.task:MyTask")


@pytest.mark.parametrize("method", ["start", "on_step", "on_progress", "on_eval", "on_checkpoint", "on_gpu_memory",
                                    "on_rank_pace", "close"])
def test_null_sink_takes_the_same_calls_as_the_exporter(method):
    """Other ranks get NullMetrics: a call the exporter would reject must fail there too, not only on rank 0."""
    def params(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, method)).parameters.values()]

    assert params(NullMetrics) == params(PrometheusMetrics)


# Non-base units Prometheus' naming guide and promtool reject.
NON_BASE_UNITS = {"ms", "millis", "milliseconds", "us", "microseconds", "ns", "nanoseconds", "minutes", "hours", "days",
                  "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "gigabytes", "bits", "percent"}


@pytest.mark.parametrize("name", sorted(METRICS))
def test_names_use_base_units(name):
    kind = METRICS[name][0]
    words = name.split("_")
    assert not NON_BASE_UNITS & set(words), f"{name}: use seconds / bytes / ratios"
    if kind == "counter":
        assert name.endswith("_total"), f"{name}: counters end in _total"
    else:
        assert not name.endswith("_total"), f"{name}: only counters end in _total"
    if {"time", "timestamp", "duration", "age"} & set(words) or kind == "histogram":
        assert name.endswith("_seconds"), f"{name}: times are in seconds"
    if "memory" in words:
        assert name.endswith("_bytes"), f"{name}: memory is in bytes"
    assert re.fullmatch(r"ray_app_[a-z0-9_]+", name)


def test_gpu_gauges_only_on_gpu_runs():
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m, use_gpu=False)
    try:
        served = sample_names(scrape(m.serving_port))
    finally:
        m.close()
    assert not GPU_METRICS & served
    for name, (kind, _) in METRICS.items():
        if name not in GPU_METRICS:
            assert (name + "_count" if kind == "histogram" else name) in served, name


def test_two_exporters_in_one_process_do_not_collide():
    """A restarted worker group in the same process builds a new exporter: no 'Duplicated timeseries'."""
    first = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(first, run="first")
    second = PrometheusMetrics(port=free_port(), bind="127.0.0.1")  # would raise ValueError on a shared registry
    drive(second, run="second")
    try:
        assert 'run="first"' in scrape(first.serving_port)
        assert 'run="second"' in scrape(second.serving_port)
    finally:
        first.close()
        second.close()


def test_close_frees_the_port_for_the_next_worker_group():
    port = free_port()
    m = PrometheusMetrics(port=port, bind="127.0.0.1")
    drive(m)
    assert m.serving_port == port and "ray_app_global_step" in scrape(port)
    m.close()
    assert m.serving_port is None
    with pytest.raises(OSError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    again = PrometheusMetrics(port=port, bind="127.0.0.1")
    drive(again, run="after-restart")
    try:
        assert again.serving_port == port
        assert 'run="after-restart"' in scrape(port)
    finally:
        again.close()


def test_rank0_announces_itself_in_a_file_sd_target(tmp_path, monkeypatch):
    """Compose discovery: $RAY_APP_METRICS_SD_DIR gets one target while rank 0 serves, none after a clean close."""
    monkeypatch.setenv(SD_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(ADVERTISE_HOST_ENV, "10.0.0.7")
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m, run="sd-run")
    target = tmp_path / "ray-app-sd-run.json"
    assert json.loads(target.read_text()) == [{"targets": [f"10.0.0.7:{m.serving_port}"], "labels": {}}]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # readable by Prometheus' own user
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temp files left behind
    m.close()
    assert not target.exists()


def test_close_keeps_a_newer_rank0s_target(tmp_path, monkeypatch):
    monkeypatch.setenv(SD_DIR_ENV, str(tmp_path))
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m, run="moved")
    target = tmp_path / "ray-app-moved.json"
    newer = json.dumps([{"targets": ["10.0.0.9:9500"], "labels": {}}])
    target.write_text(newer)  # the restarted group's rank 0, on another container
    m.close()
    assert target.read_text() == newer


def test_no_target_file_without_the_env(tmp_path, monkeypatch):
    monkeypatch.delenv(SD_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m)
    m.close()
    assert list(tmp_path.iterdir()) == []


# --- the dashboard and the alert rules use only names the exporter serves ---

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
NAME = re.compile(r"(?<![\w:])ray_app_[A-Za-z0-9_]*")  # ray_app:... are recording rules, not exporter names


def dashboard_queries() -> list[str]:
    dash = json.loads((MONITORING / "grafana" / "ray-app-dashboard.json").read_text())
    panels = [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]
    queries = [t["expr"] for p in panels for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        queries.append(q.get("query", "") if isinstance(q, dict) else q or "")
    return queries


def rule_queries() -> list[str]:
    rules = yaml.safe_load((MONITORING / "rules" / "ray-app.rules.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_queries_use_only_names_the_exporter_serves(exporter, source):
    _, text = exporter
    served = sample_names(text)
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    used = {name for q in queries for name in NAME.findall(q)}
    assert used, "no ray_app_ names found: the parser is broken"
    assert sorted(used - served) == [], f"{source} uses names the exporter does not serve"


def test_dashboard_covers_the_contract():
    """Every metric in METRICS has a panel (directly or via its _bucket/_sum/_count/_created series), except the
    legacy eval gauges: the dashboard shows them as ray_app_eval_metric{name="loss"/"accuracy"}."""
    used = {name for q in dashboard_queries() for name in NAME.findall(q)}
    base = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in used}
    legacy = set(LEGACY_EVAL_GAUGES.values())
    assert "ray_app_eval_metric" in used and not legacy & used  # one eval panel, no doubled loss/accuracy lines
    assert sorted(set(METRICS) - used - base - {b + "_total" for b in base} - legacy) == []


# The README and docs/metrics.md tables are checked against METRICS in test_docs_metrics.py.


def contract_name(sample: str) -> str:
    """The METRICS name a served sample belongs to (``_bucket`` of a histogram, ``_created`` of a counter, ...)."""
    if sample in METRICS:
        return sample
    base = re.sub(r"_(bucket|sum|count|created|total)$", "", sample)
    return base if base in METRICS else f"{base}_total"


def test_served_series_carry_exactly_the_documented_labels(exporter):
    _, text = exporter
    labels: dict[str, set] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(contract_name(sample.name), set()).update(set(sample.labels) - {"le"})
    assert labels.keys() <= METRICS.keys()
    assert {name: tuple(sorted(names)) for name, names in labels.items()} == \
        {name: tuple(sorted(METRIC_LABELS.get(name, ()))) for name in labels}


# ---------------------------------------------------------------- the final scrape

def test_a_watched_exporter_closes_only_after_a_scrape_read_its_last_values(monkeypatch):
    """A short job's last values (its resumed step, its final loss) reach Prometheus before the exporter goes."""
    import threading
    import time

    monkeypatch.setenv("RAY_APP_METRICS_FINAL_SCRAPE_S", "30")
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m)
    scrape(m.serving_port)  # Prometheus watches this exporter
    m.on_progress(epoch=1, global_step=77, lr=0.05, train_loss=0.25, samples=64, samples_per_second=5120.0)
    closer = threading.Thread(target=m.close)
    closer.start()
    time.sleep(1.0)
    assert closer.is_alive(), "closed before any scrape read the last update"
    text = scrape(m.serving_port)
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert re.search(r"^ray_app_global_step 77\.0$", text, flags=re.M), text
    with pytest.raises(OSError):
        scrape(m.port)


def test_an_exporter_nobody_scrapes_closes_at_once_and_a_watched_one_within_its_window(monkeypatch, tmp_path):
    import time

    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m)
    t0 = time.monotonic()
    m.close()  # no scrape, no file_sd target: no one to wait for
    assert time.monotonic() - t0 < 1

    monkeypatch.setenv(SD_DIR_ENV, str(tmp_path))  # announced, but Prometheus never comes
    monkeypatch.setenv("RAY_APP_METRICS_FINAL_SCRAPE_S", "1.5")
    m = PrometheusMetrics(port=free_port(), bind="127.0.0.1")
    drive(m)
    assert list(tmp_path.glob("*.json"))
    t0 = time.monotonic()
    m.close()
    assert 1.4 <= time.monotonic() - t0 < 5
    assert not list(tmp_path.glob("*.json"))  # the target withdrawn after the window
