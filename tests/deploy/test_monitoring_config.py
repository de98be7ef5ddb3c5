"""The shipped Prometheus config, alert rules and Grafana dashboard are valid.

promtool (Debian's `prometheus` package) checks the config and the rules and
runs the rules' unit tests (monitoring/rules/ray-app.rules.test.yml), so the
alerts are shown to fire, and to stay quiet, on the series they are about.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.support.tools import promtool

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
RULES = MONITORING / "rules" / "ray-app.rules.yml"
DASHBOARD = MONITORING / "grafana" / "ray-app-dashboard.json"


def run_promtool(*args: str) -> str:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=MONITORING)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_promtool_check_config():
    out = run_promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out


def test_promtool_check_rules():
    out = run_promtool("check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_alert_rules_unit_tests_pass():
    out = run_promtool("test", "rules", str(MONITORING / "rules" / "ray-app.rules.test.yml"))
    assert "SUCCESS" in out


def test_prometheus_config_discovers_rank0_without_static_targets():
    """Rank 0 is found through its own file_sd announcement, never by listing every worker."""
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert "static_configs" not in jobs["ray-app"]
    files = jobs["ray-app"]["file_sd_configs"][0]["files"]
    assert files == ["/etc/prometheus/targets/ray-app-*.json"]
    assert cfg["rule_files"] == ["rules/ray-app.rules.yml"]


def test_every_alert_has_severity_and_summary():
    rules = yaml.safe_load(RULES.read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    names = {a["alert"] for a in alerts}
    assert {"RayAppTrainingStalled", "RayAppNoRecentCheckpoint", "RayAppLossNotFinite", "RayAppMetricsDown"} <= names
    for a in alerts:
        assert a["labels"]["severity"] in {"info", "warning", "critical"}, a["alert"]
        assert a["annotations"]["summary"], a["alert"]


def test_dashboard_datasource_is_a_template_variable():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for top in dash["panels"] for p in [top, *top.get("panels", [])] if p["type"] != "row"]
    assert panels
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    assert "__inputs" not in dash  # imports as-is, no data source mapping step


def test_dashboard_panels_do_not_overlap_and_ids_are_unique():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_dashboard_shows_what_operators_ask_for():
    dash = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for needle in ("ray_app_train_loss", "ray_app_eval_metric", "ray_app_samples_per_second",
                   "histogram_quantile(0.50, sum by (le) (rate(ray_app_step_seconds_bucket",
                   "histogram_quantile(0.95, sum by (le) (rate(ray_app_step_seconds_bucket",
                   "time() - max(ray_app_last_checkpoint_timestamp_seconds", "ray_app_checkpoint_blocked_seconds",
                   "ray_app_worker_group_starts", "ray_app_resumed_from_step", "ray_app_world_size",
                   "ray_app_learning_rate", "ray_app_gpu_memory_allocated_bytes"):
        assert needle in exprs, needle


def test_eval_panel_shows_every_task_metric_by_name():
    """One series per name the task reports (loss, accuracy, mse, perplexity, a user task's own), named in the legend."""
    dash = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dash["panels"] if any("ray_app_eval_" in t["expr"] for t in p.get("targets", []))]
    (target,) = panel["targets"]
    assert target["expr"] == 'ray_app_eval_metric{job=~"$job", instance=~"$instance"}'
    assert target["legendFormat"].startswith("{{name}}")
    (accuracy,) = [o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["id"] == "byRegexp"]
    assert re.fullmatch(accuracy["matcher"]["options"], "accuracy w1:9500")  # Grafana anchors a plain pattern
    assert not re.fullmatch(accuracy["matcher"]["options"], "top5_accuracy w1:9500")
