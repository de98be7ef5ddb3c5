"""The manifests agree with the rest of the kit: the image `make image` builds,
the exporter's metrics port and path, a run config that `ray-app` accepts,
the copies kustomize reads, the documented Secrets; and nothing secret is
committed under k8s/."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ray_app.shared.config import MetricsSection, load_config
from ray_app.worker import podlabel
from tests.support.k8s import (
    DEPLOYABLE,
    K8S,
    KUSTOMIZATIONS,
    REPO,
    all_containers,
    make_env,
    make_var,
    one,
    pod_specs,
    rayjob_templates,
    render,
)

ENTRYPOINT = "ray-app train --config /etc/ray-app/config.yaml"
OVERLAY_CONFIG = {"base": "configs/kind.yaml", "overlays/kind-cpu": "configs/kind.yaml", "overlays/gpu": "configs/gpu.yaml"}
DOCS = REPO / "docs" / "kubernetes.md"


def rayjob(rel: str) -> dict:
    return one(render(rel), "RayJob")


def containers_of(rel: str, template_name: str) -> dict:
    return rayjob_templates(rayjob(rel))[template_name]["spec"]["containers"][0]


def config_of(rel: str) -> dict:
    cm = one(render(rel), "ConfigMap", "ray-app-config")
    return yaml.safe_load(cm["data"]["config.yaml"])


def images(rel: str) -> set[str]:
    return {c["image"] for o in render(rel) for _, spec in pod_specs(o) for _, c in all_containers(spec)}


# ---- the image -----------------------------------------------------------

def test_image_is_the_one_make_image_builds():
    image = make_var("IMAGE")
    assert image == "ray-app:0.1.0"
    for rel in ("base", "overlays/kind-cpu"):
        assert images(rel) == {image}, rel
    assert images("kind/minio") >= {image}  # the bucket Job reuses the kit's image
    gpu_image = make_var("IMAGE_GPU") or f"{image}-gpu"  # the gpu target (docs/CONTRACTS.md)
    assert images("overlays/gpu") == {gpu_image} == {f"{image}-gpu"}


def test_make_render_sets_the_image_given_on_the_command_line():
    if not shutil.which("make"):
        pytest.skip("make not installed")
    cmd = ["make", "-s", "--no-print-directory", "-C", str(REPO), "render", "OVERLAY=gpu",
           "IMAGE=registry.example.com:5000/team/ray-app:0.1.0-gpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=make_env())
    assert out.returncode == 0, out.stderr
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    found = {c["image"] for o in objs for _, s in pod_specs(o) for _, c in all_containers(s)}
    assert found == {"registry.example.com:5000/team/ray-app:0.1.0-gpu"}


# ---- the job ---------------------------------------------------------------

@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_rayjob_runs_the_kit_and_cleans_up(rel):
    spec = rayjob(rel)["spec"]
    assert spec["entrypoint"] == ENTRYPOINT
    assert spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0
    # Cleanup through shutdownAfterJobFinishes + TTL; KubeRay rejects deletionRules beside it.
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert "deletionStrategy" not in spec
    assert spec["submitterPodTemplate"]["spec"]["restartPolicy"] == "Never"
    assert len(spec["rayClusterSpec"]["workerGroupSpecs"]) == 1


def test_ray_version_matches_the_ray_the_package_pins():
    pin = re.search(r'"ray\[[^\]]*\]==([0-9.]+)', (REPO / "pyproject.toml").read_text()).group(1).rstrip(".*")
    for rel in DEPLOYABLE:
        version = rayjob(rel)["spec"]["rayClusterSpec"]["rayVersion"]
        assert version.startswith(pin), f"{rel}: rayVersion {version}, pyproject pins ray=={pin}.*"
        assert tuple(map(int, version.split(".")[:2])) >= (2, 52), "token auth needs Ray >= 2.52"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_entrypoint_config_is_the_configmap_and_ray_app_accepts_it(rel, tmp_path):
    config_path = ENTRYPOINT.split("--config ")[1].split()[0]
    head = rayjob_templates(rayjob(rel))["head"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["mountPath"] == str(Path(config_path).parent))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    cm = one(render(rel), "ConfigMap", volume["configMap"]["name"])
    text = cm["data"][Path(config_path).name]
    # What `ray-app train --config` does first: load and validate the whole tree.
    (tmp_path / "config.yaml").write_text(text)
    cfg = load_config(tmp_path / "config.yaml")
    assert text == (REPO / OVERLAY_CONFIG[rel]).read_text()
    # Resume across RayJob retries needs storage that outlives the cluster and a fixed run name.
    assert cfg.run.storage.startswith("s3://"), "a RayJob retry gets new pods: checkpoints must be in S3"
    assert "name" in (yaml.safe_load(text).get("run") or {}), "set run.name explicitly: retries resume it"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_worker_group_fits_the_configs_scaling(rel, tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config_of(rel)))
    scaling = load_config(tmp_path / "c.yaml").scaling
    group = rayjob(rel)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    # elastic (scaling.min_workers) runs on as few pods as min_workers and grows back to num_workers
    assert group["replicas"] == group["maxReplicas"] == scaling.num_workers
    assert group["minReplicas"] == (scaling.min_workers or scaling.num_workers)
    container = group["template"]["spec"]["containers"][0]
    assert float(group["rayStartParams"]["num-cpus"]) >= scaling.cpus_per_worker
    gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    if scaling.use_gpu:
        assert gpus >= scaling.gpus_per_worker, "each worker pod needs its GPU"
    else:
        assert gpus == 0


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_workers_know_their_pod_through_the_downward_api(rel):
    env = {e["name"]: e for e in containers_of(rel, "workers/workers")["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_gpu_overlay_requests_gpus_and_sets_nccl_and_shm():
    cfg = config_of("overlays/gpu")
    assert cfg["scaling"]["use_gpu"] is True and cfg["train"]["precision"] == "bf16-mixed"
    worker = rayjob_templates(rayjob("overlays/gpu"))["workers/workers"]["spec"]
    c = worker["containers"][0]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NCCL_SOCKET_IFNAME"] and env["NCCL_DEBUG"]
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in worker["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
    assert any(t["key"] == "nvidia.com/gpu" for t in worker["tolerations"])
    assert worker["nodeSelector"]
    head = rayjob_templates(rayjob("overlays/gpu"))["head"]["spec"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"].get("limits", {})


def test_kind_overlay_points_s3_at_the_minio_of_kind_up():
    minio = render("kind/minio")
    svc = one(minio, "Service", "minio")
    endpoint = f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    for name in ("head", "workers/workers"):
        env = {e["name"]: e.get("value") for e in containers_of("overlays/kind-cpu", name)["env"]}
        assert env["AWS_ENDPOINT_URL_S3"] == endpoint
    bucket = config_of("overlays/kind-cpu")["run"]["storage"].removeprefix("s3://").split("/")[0]
    job = one(minio, "Job")["spec"]["template"]["spec"]["containers"][0]
    assert f'Bucket="{bucket}"' in " ".join(job["command"])
    egress = [r for o in render("overlays/kind-cpu") if o["kind"] == "NetworkPolicy" for r in o["spec"].get("egress", [])]
    assert any(p["port"] == svc["spec"]["ports"][0]["port"] for r in egress for p in r.get("ports", []))
    assert yaml.safe_load((K8S / "kind" / "cluster.yaml").read_text())["kind"] == "Cluster"


# ---- metrics ---------------------------------------------------------------

def test_metrics_port_and_path_match_the_exporter_and_the_podmonitor():
    port = MetricsSection().port
    assert port == 9500
    monitor = one(render("monitoring"), "PodMonitor", "ray-app-rank0")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert endpoint["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"][podlabel.METRICS_LABEL] == "true"
    for rel in DEPLOYABLE:
        ports = {p["name"]: p["containerPort"] for p in containers_of(rel, "workers/workers")["ports"]}
        assert ports[endpoint["port"]] == port == config_of(rel)["metrics"]["port"], rel
        assert ports["metrics"] == 8080  # Ray's own metrics, KubeRay's port name


def test_ray_metrics_podmonitor_scrapes_kuberays_metrics_port():
    monitor = one(render("monitoring"), "PodMonitor", "ray-app-ray-nodes")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for rel in DEPLOYABLE:
        for name in ("head", "workers/workers"):
            assert "metrics" in {p["name"] for p in containers_of(rel, name)["ports"]}


# ---- copies kustomize reads ------------------------------------------------

@pytest.mark.parametrize("src, copy", [
    ("configs/kind.yaml", "k8s/base/config.yaml"),
    ("configs/gpu.yaml", "k8s/overlays/gpu/config.yaml"),
    ("monitoring/grafana/ray-app-dashboard.json", "k8s/monitoring/ray-app-dashboard.json"),
])
def test_copies_under_k8s_are_identical(src, copy):
    assert (REPO / src).is_file(), f"{src} is missing: it is the source of {copy} (make k8s-sync copies it)"
    assert (REPO / copy).is_file(), f"{copy} is missing: run make k8s-sync"
    assert (REPO / copy).read_bytes() == (REPO / src).read_bytes(), f"{copy} differs from {src}: run make k8s-sync"


def test_prometheus_rule_carries_the_alert_rules_file():
    src = REPO / "monitoring" / "rules" / "ray-app.rules.yml"
    assert src.is_file(), "monitoring/rules/ray-app.rules.yml is missing: the PrometheusRule is made from it"
    rule = one(render("monitoring"), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(src.read_text())["groups"], "run make k8s-sync"


def test_dashboard_configmap_is_loaded_by_grafanas_sidecar():
    cm = one(render("monitoring"), "ConfigMap", "ray-app-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    assert '"ray_app_' in text


# ---- secrets -----------------------------------------------------------------

def referenced_secret_keys() -> set[tuple[str, str]]:
    """(Secret, key) for every secretKeyRef / authOptions.secretName in every render."""
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                refs.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            if "secretRef" in node and "name" in node["secretRef"]:
                refs.add((node["secretRef"]["name"], "*"))
            if "mode" in node and node.get("secretName"):  # KubeRay authOptions
                refs.add((node["secretName"], "auth_token"))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for rel in KUSTOMIZATIONS:
        walk(render(rel))
    return refs


def test_every_referenced_secret_key_is_documented():
    refs = referenced_secret_keys()
    assert ("ray-app-s3", "AWS_ACCESS_KEY_ID") in refs and ("ray-app-auth-token", "auth_token") in refs
    docs = DOCS.read_text()
    missing = [f"{name}/{key}" for name, key in sorted(refs) if name not in docs or (key != "*" and key not in docs)]
    assert not missing, f"document these Secrets / keys in docs/kubernetes.md: {missing}"


def test_no_secret_objects_or_literal_secret_env_in_manifests():
    for rel in KUSTOMIZATIONS:
        for obj in render(rel):
            assert obj["kind"] != "Secret", f"{rel}: a Secret is committed; users create it (docs/kubernetes.md)"
            for _, spec in pod_specs(obj):
                for _, c in all_containers(spec):
                    for e in c.get("env") or []:
                        if re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL", e["name"]):
                            assert "value" not in e, f"{rel}: {c['name']} sets {e['name']} literally; use a secretKeyRef"


CREDENTIAL_PATTERNS = {
    "AWS access key id": re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    "AWS secret key": re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{30,}"),
    "password value": re.compile(r"(?i)password\s*[:=]\s*['\"]?[A-Za-z0-9][^\s'\"#]{2,}"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "MinIO default credentials": re.compile(r"(?i)minioadmin"),
    "token value": re.compile(r"(?i)\b(auth_token|bearer)\s*[:=]\s*['\"]?[A-Za-z0-9._-]{16,}"),
    "Secret manifest": re.compile(r"(?m)^kind:\s*Secret\s*$"),
}


def credential_findings(text: str) -> list[str]:
    return [name for name, pattern in CREDENTIAL_PATTERNS.items() if pattern.search(text)]


def test_no_plaintext_credential_anywhere_in_k8s():
    files = [p for p in K8S.rglob("*") if p.is_file()] + [REPO / "mk" / "k8s.mk", REPO / "configs" / "kind.yaml", REPO / "configs" / "gpu.yaml"]
    findings = {}
    for path in files:
        hits = credential_findings(path.read_text(errors="replace"))
        if hits:
            findings[str(path.relative_to(REPO))] = hits
    assert not findings, f"plaintext credentials committed: {findings}"


def test_the_credential_scan_catches_the_usual_leaks():
    leaks = [
        "AWS_ACCESS_KEY_ID: AKIAIOSFODNN7EXAMPLE",
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "  MINIO_ROOT_PASSWORD: hunter2hunter2",
        "-----BEGIN RSA PRIVATE KEY-----",
        "--from-literal=MINIO_ROOT_USER=minioadmin",
        "auth_token: 9f8e7d6c5b4a39281706f5e4d3c2b1a0",
        "kind: Secret",
    ]
    for leak in leaks:
        assert credential_findings(leak), leak
    for fine in ["key: MINIO_ROOT_PASSWORD", "name: AWS_SECRET_ACCESS_KEY", 'printf "MINIO_ROOT_PASSWORD=%s"']:
        assert not credential_findings(fine), fine


# ---- make targets and scripts ----------------------------------------------

def test_make_targets_the_docs_name_exist():
    if not shutil.which("make"):
        pytest.skip("make not installed")
    text = DOCS.read_text()
    code = re.findall(r"```.*?```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    named = [m for chunk in code for m in re.findall(r"\bmake ((?:[A-Za-z0-9_.=/:-]+ ?)+)", chunk)]
    targets = {t for group in named for t in group.split() if "=" not in t and not t.startswith("-")}
    assert {"kind-up", "deploy", "status", "k8s-logs", "kind-down", "render"} <= targets
    for target in sorted(targets):
        out = subprocess.run(["make", "-n", "-C", str(REPO), target],
                             capture_output=True, text=True, timeout=60, env=make_env())
        assert out.returncode == 0 and "No rule to make target" not in out.stderr, f"make {target}: {out.stderr}"


def test_scripts_parse():
    for script in (K8S / "scripts").glob("*.sh"):
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, f"{script.name}: {out.stderr}"
