"""k8s/scripts/kind-up.sh and `make deploy` (deploy.sh) run against fake
kind / kubectl / helm / docker binaries that record every call and what was
piped into it; `kubectl kustomize` is the real one. So the tests see exactly
what the scripts would apply, in which order and in which namespace, without
a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.support.k8s import REPO, kubectl, make_env, pod_specs

OTHER_NS = "team-a"
DEV_IMAGE = "ray-app:dev"
KIT_SECRETS = {"ray-app-s3", "ray-app-auth-token", "ray-app-mlflow"}

FAKE_TOOL = r'''#!{python}
"""A stand-in for kind / kubectl / helm / docker: records the call, answers a few queries."""
import base64, json, os, subprocess, sys

tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
log = os.environ["FAKE_LOG"]
reads_stdin = ("-f" in args and args[args.index("-f") + 1] == "-") or any("/dev/stdin" in a for a in args)
stdin = sys.stdin.read() if reads_stdin else ""
with open(os.path.join(log, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"tool": tool, "args": args, "stdin": stdin}}) + "\n")

def drop_options(a):
    out, skip = [], False
    for i, x in enumerate(a):
        if skip:
            skip = False
        elif x in ("--context", "-n", "--namespace", "--kube-context"):
            skip = True
        else:
            out.append(x)
    return out

plain = drop_options(args)
if tool == "kubectl":
    if plain[:1] == ["kustomize"]:
        os.execv(os.environ["REAL_KUBECTL"], ["kubectl", *plain])
    if plain[:2] == ["config", "current-context"]:
        print("kind-ray-app")
    elif plain[:2] == ["get", "crd"]:
        sys.exit(0)
    elif plain[:2] == ["get", "secret"] and plain[2] == "minio-root":
        print(base64.b64encode(b"minio-key").decode(), end="")
    elif plain[:1] == ["get"]:
        sys.exit(1)  # no Secret, no RayJob yet
elif tool == "helm" and plain[:2] == ["show", "crds"]:
    print("apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: rayjobs.ray.io")
elif tool == "kind" and plain[:2] == ["get", "clusters"]:
    print("ray-app")
'''


@pytest.fixture
def fakes(tmp_path):
    """(env, read_calls): PATH with the fake tools first; read_calls() parses the log."""
    real = kubectl()
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for tool in ("kind", "kubectl", "helm", "docker"):
        path = bin_dir / tool
        path.write_text(FAKE_TOOL.format(python=sys.executable))
        path.chmod(0o755)
    env = dict(make_env(), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log), REAL_KUBECTL=real)

    def read_calls() -> list[dict]:
        path = log / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return env, read_calls


def run(cmd: list[str], env: dict, **extra_env) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, env=dict(env, **extra_env), capture_output=True, text=True, timeout=180)
    return out


def kind_up(env, **extra_env):
    out = run(["bash", "k8s/scripts/kind-up.sh"], env, **extra_env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def make_deploy(env, overlay: str, **make_vars):
    args = [f"{k}={v}" for k, v in make_vars.items()]
    out = run(["make", "-s", "--no-print-directory", "deploy", f"OVERLAY={overlay}", *args], env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def applied_text(call: dict) -> str:
    """What a `kubectl apply -f X` call applied ('' for any other call)."""
    if call["tool"] != "kubectl" or "apply" not in call["args"]:
        return ""
    source = call["args"][call["args"].index("-f") + 1]
    return call["stdin"] if source == "-" else (REPO / source).read_text()


def applied_objects(calls: list[dict]) -> list[dict]:
    """Every object the scripts applied: piped (`apply -f -`) or from a file."""
    return [d for c in calls for d in yaml.safe_load_all(applied_text(c)) if d]


def created_secrets(calls: list[dict]) -> list[tuple[str, str]]:
    """(namespace, name) of every `kubectl -n NS create secret generic NAME`."""
    out = []
    for c in calls:
        a = c["args"]
        if c["tool"] == "kubectl" and "create" in a and "secret" in a:
            out.append((a[a.index("-n") + 1], a[a.index("generic") + 1]))
    return out


def secret_refs(obj: dict) -> list[tuple[str, bool]]:
    """(Secret name, optional) referenced by an object's pods, and a RayJob's auth Secret."""
    refs = []
    for _, spec in pod_specs(obj):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    refs.append((ref["name"], bool(ref.get("optional"))))
            for src in c.get("envFrom") or []:
                if "secretRef" in src:
                    refs.append((src["secretRef"]["name"], bool(src["secretRef"].get("optional"))))
        for v in spec.get("volumes") or []:
            if "secret" in v:
                refs.append((v["secret"]["secretName"], bool(v["secret"].get("optional"))))
    secret_name = ((obj.get("spec") or {}).get("rayClusterSpec") or {}).get("authOptions", {}).get("secretName")
    if secret_name:
        refs.append((secret_name, False))
    return refs


def index_of(calls, predicate, what: str = "the call") -> int:
    found = [i for i, c in enumerate(calls) if predicate(c)]
    assert found, f"no {what} in the scripts' calls"
    return found[0]


# --- kind-up: CRDs first ----------------------------------------------------------------------


def test_kind_up_applies_the_charts_crds_before_installing_or_upgrading_the_operator(fakes):
    """`helm upgrade --install` installs a chart's crds/ only the first time:
    a re-run with a newer KUBERAY_VERSION would keep the old RayJob CRD
    (which rejects authOptions.secretName). kind-up applies the chart's CRDs
    itself, every run, before the operator."""
    env, calls = fakes
    kind_up(env, KUBERAY_VERSION="1.7.0")
    kind_up(env, KUBERAY_VERSION="1.8.0")  # a re-run with a newer operator
    log = calls()
    for version in ("1.7.0", "1.8.0"):
        show = index_of(log, lambda c, v=version: c["tool"] == "helm" and c["args"][:2] == ["show", "crds"] and v in c["args"],
                        f"`helm show crds` of {version}")
        crd_apply = index_of(log[show:], lambda c: c["tool"] == "kubectl" and "apply" in c["args"]
                             and "CustomResourceDefinition" in c["stdin"]) + show
        assert "--server-side" in log[crd_apply]["args"], "CRDs this large need a server-side apply"
        install = index_of(log, lambda c, v=version: c["tool"] == "helm" and "upgrade" in c["args"] and v in c["args"])
        assert show < crd_apply < install, f"{version}: CRDs must be applied before the operator is installed"


# --- kind-up: one image -----------------------------------------------------------------------


def kit_images(objs: list[dict]) -> set[str]:
    images = set()
    for obj in objs:
        for _, spec in pod_specs(obj):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if c["image"].rsplit("/", 1)[-1].split(":")[0].split("@")[0] == "ray-app":
                    images.add(c["image"])
    return images


def test_kind_up_runs_the_image_it_loaded_in_every_pod(fakes):
    env, calls = fakes
    kind_up(env, IMAGE=DEV_IMAGE)
    log = calls()
    loaded = [c["args"][c["args"].index("docker-image") + 1] for c in log if c["tool"] == "kind" and "load" in c["args"]]
    assert loaded == [DEV_IMAGE]
    objs = applied_objects(log)
    assert any(o["kind"] == "Job" and o["metadata"]["name"] == "create-bucket" for o in objs)
    assert kit_images(objs) == {DEV_IMAGE}, "a pod of kind-up would pull a tag that was never loaded"


def test_make_kind_up_passes_the_image_and_the_namespace_to_the_script():
    out = subprocess.run(["make", "-n", "-C", str(REPO), "kind-up", f"IMAGE={DEV_IMAGE}", f"K8S_NAMESPACE={OTHER_NS}"],
                         capture_output=True, text=True, timeout=30, env=make_env())
    assert out.returncode == 0, out.stderr
    assert f"IMAGE={DEV_IMAGE}" in out.stdout and f"K8S_NAMESPACE={OTHER_NS}" in out.stdout


def test_make_deploy_after_kind_up_runs_the_same_image(fakes):
    env, calls = fakes
    make_deploy(env, "kind-cpu", IMAGE=DEV_IMAGE, KUBECTL=f"{env['PATH'].split(os.pathsep)[0]}/kubectl")
    assert kit_images(applied_objects(calls())) == {DEV_IMAGE}


# --- K8S_NAMESPACE ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", ["kind-cpu", "gpu"])
def test_another_namespace_reaches_every_object_and_every_secret(fakes, overlay):
    """K8S_NAMESPACE=team-a: every object of the kit lands in team-a (none in
    ray-app), the scripts create the Secrets there, and every Secret a pod or
    the RayJob references is one of them (or optional and documented)."""
    env, calls = fakes
    fake_kubectl = f"{env['PATH'].split(os.pathsep)[0]}/kubectl"
    if overlay == "kind-cpu":
        kind_up(env, K8S_NAMESPACE=OTHER_NS)
    out = make_deploy(env, overlay, K8S_NAMESPACE=OTHER_NS, KUBECTL=fake_kubectl)
    log = calls()
    objs = applied_objects(log)
    kit = [o for o in objs if o["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "ray-app"]
    namespaces = {o["metadata"]["name"] for o in kit if o["kind"] == "Namespace"}
    assert namespaces == {OTHER_NS}
    cluster_scoped = {"Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert {o["metadata"].get("namespace") for o in kit if o["kind"] not in cluster_scoped} == {OTHER_NS}
    assert not [o for o in kit if o["kind"] in cluster_scoped and o["metadata"].get("namespace")]
    assert "ValidatingAdmissionPolicy" in {o["kind"] for o in kit}
    assert {"RayJob", "PodMonitor", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy"} <= {o["kind"] for o in kit}
    for o in kit:
        if o["kind"] == "RoleBinding":
            assert {s["namespace"] for s in o["subjects"]} == {OTHER_NS}
        if o["kind"] == "PodMonitor":  # its own namespace, or team-a by name
            assert o["spec"].get("namespaceSelector", {}).get("matchNames", [OTHER_NS]) == [OTHER_NS]
    created = created_secrets(log)
    assert {ns for ns, _ in created} <= {OTHER_NS, "minio"}
    rayjob = next(o for o in kit if o["kind"] == "RayJob")
    rayjob_applied = index_of(log, lambda c: "kind: RayJob" in applied_text(c))
    for name, optional in secret_refs(rayjob):
        assert name in KIT_SECRETS, f"undocumented Secret {name}"
        if (OTHER_NS, name) in created:
            made = index_of(log, lambda c, n=name: c["tool"] == "kubectl" and "create" in c["args"] and n in c["args"])
            assert made < rayjob_applied, f"Secret {name} created after the RayJob"
        else:
            assert optional, f"{overlay}: the pods need Secret {OTHER_NS}/{name}, and nothing creates it"
            assert f"{OTHER_NS}/{name}" in out.stdout, "deploy says which optional Secret is missing, and where"
    if overlay == "kind-cpu":
        assert (OTHER_NS, "ray-app-s3") in created and (OTHER_NS, "ray-app-auth-token") in created


def test_deploy_refuses_manifests_rendered_for_another_namespace(fakes):
    env, _ = fakes
    render = run(["make", "-s", "--no-print-directory", "render", "OVERLAY=gpu"], env)
    assert render.returncode == 0, render.stderr
    out = run(["bash", "k8s/scripts/deploy.sh", "build/k8s/gpu/manifests.yaml"], env, K8S_NAMESPACE=OTHER_NS)
    assert out.returncode == 2 and "K8S_NAMESPACE" in out.stderr
