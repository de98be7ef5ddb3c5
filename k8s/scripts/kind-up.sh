#!/usr/bin/env bash
# `make kind-up`: a kind cluster ready for `make deploy` (overlay kind-cpu).
#   1. the kind cluster of k8s/kind/cluster.yaml (kept if it exists)
#   2. the image IMAGE loaded into its nodes (no registry needed)
#   3. the KubeRay CRDs of KUBERAY_VERSION (server-side apply, so a re-run with
#      a newer version upgrades them), then its operator (Helm chart, pinned)
#   4. MinIO with the bucket ray-app (its Job runs IMAGE), random root keys in
#      Secrets (never printed); the namespace K8S_NAMESPACE and its ray-app-s3
#   5. with KIND_MONITORING=1: kube-prometheus-stack (pinned), then k8s/monitoring
#      in K8S_NAMESPACE
# Idempotent: run it again after `make image` to reload the image.
# K8S_TREE is the folder the manifests are rendered from: k8s/ by default;
# `make kind-up` passes build/k8s-tree (k8s/scripts/sync.sh).
set -euo pipefail

: "${KIND_CLUSTER:=ray-app}" "${IMAGE:=ray-app:0.1.0}" "${KUBERAY_VERSION:=1.7.0}"
: "${KUBE_PROMETHEUS_STACK_VERSION:=79.12.0}" "${KIND_MONITORING:=1}" "${K8S_NAMESPACE:=ray-app}" "${K8S_TREE:=k8s}"
KUBECTL="kubectl --context kind-${KIND_CLUSTER}"
cd "$(dirname "$0")/../.."  # the repository root

need() { command -v "$1" >/dev/null || { echo "kind-up: '$1' not found; install it ($2)" >&2; exit 2; }; }
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/"
need docker "https://docs.docker.com/engine/install/"
docker image inspect "$IMAGE" >/dev/null 2>&1 || {
  echo "kind-up: image $IMAGE not found in Docker; build it first: make image" >&2; exit 2; }

echo "==> kind cluster $KIND_CLUSTER"
if ! kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  kind create cluster --name "$KIND_CLUSTER" --config k8s/kind/cluster.yaml --wait 180s
fi

echo "==> loading $IMAGE into the kind nodes"
kind load docker-image "$IMAGE" --name "$KIND_CLUSTER"

echo "==> KubeRay operator $KUBERAY_VERSION"
helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update >/dev/null
# Helm installs a chart's crds/ only on the first install and never upgrades
# them: apply this version's CRDs first (server-side: they are too large for
# the last-applied annotation of a client-side apply).
helm show crds kuberay/kuberay-operator --version "$KUBERAY_VERSION" |
  $KUBECTL apply --server-side --force-conflicts -f - >/dev/null
helm upgrade --install kuberay-operator kuberay/kuberay-operator --skip-crds \
  --kube-context "kind-${KIND_CLUSTER}" --version "$KUBERAY_VERSION" \
  --namespace kuberay-system --create-namespace --wait --timeout 5m

echo "==> MinIO (S3 for checkpoints) and the bucket ray-app"
$KUBECTL apply -f k8s/kind/minio/namespace.yaml
KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/namespace" build/k8s/namespace "" "$K8S_NAMESPACE" | $KUBECTL apply -f -
secrets_dir=$(mktemp -d)
trap 'rm -rf "$secrets_dir"' EXIT
umask 077
random_hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
if ! $KUBECTL -n minio get secret minio-root >/dev/null 2>&1; then
  printf 'MINIO_ROOT_USER=%s\nMINIO_ROOT_PASSWORD=%s\n' "ray-app-$(random_hex 4)" "$(random_hex 24)" >"$secrets_dir/minio.env"
  $KUBECTL -n minio create secret generic minio-root --from-env-file="$secrets_dir/minio.env" >/dev/null
  echo "created Secret minio/minio-root (random keys, not printed)"
fi
if ! $KUBECTL -n "$K8S_NAMESPACE" get secret ray-app-s3 >/dev/null 2>&1; then
  # The same keys, under the names the AWS SDKs read, for the Ray pods.
  key() { $KUBECTL -n minio get secret minio-root -o "jsonpath={.data.$1}" | base64 -d; }
  printf 'AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\n' "$(key MINIO_ROOT_USER)" "$(key MINIO_ROOT_PASSWORD)" >"$secrets_dir/s3.env"
  $KUBECTL -n "$K8S_NAMESPACE" create secret generic ray-app-s3 --from-env-file="$secrets_dir/s3.env" >/dev/null
  echo "created Secret $K8S_NAMESPACE/ray-app-s3 (the MinIO keys, not printed)"
fi
# The bucket Job's pod spec is immutable: replace it on re-runs. It runs the
# image just loaded (IMAGE), not the tag k8s/kind/minio names.
$KUBECTL -n minio delete job create-bucket --ignore-not-found >/dev/null
KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/kind/minio" build/k8s/kind-minio "$IMAGE" "" | $KUBECTL apply -f -
$KUBECTL -n minio rollout status deployment/minio --timeout=180s
$KUBECTL -n minio wait --for=condition=complete job/create-bucket --timeout=180s

if [ "$KIND_MONITORING" = "1" ]; then
  echo "==> kube-prometheus-stack $KUBE_PROMETHEUS_STACK_VERSION (KIND_MONITORING=0 skips it)"
  helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update >/dev/null
  # *NilUsesHelmValues=false: select every PodMonitor / PrometheusRule, not
  # only those carrying the release label; the Grafana sidecar loads
  # dashboards (label grafana_dashboard=1) from every namespace.
  helm upgrade --install kube-prometheus-stack prometheus-community/kube-prometheus-stack \
    --kube-context "kind-${KIND_CLUSTER}" --version "$KUBE_PROMETHEUS_STACK_VERSION" \
    --namespace monitoring --create-namespace --wait --timeout 10m \
    --set prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues=false \
    --set prometheus.prometheusSpec.serviceMonitorSelectorNilUsesHelmValues=false \
    --set prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false \
    --set grafana.sidecar.dashboards.searchNamespace=ALL
  KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/monitoring" build/k8s/monitoring "" "$K8S_NAMESPACE" | $KUBECTL apply -f -
fi

deploy_args=""
[ "$IMAGE" = "ray-app:0.1.0" ] || deploy_args+=" IMAGE=$IMAGE"
[ "$K8S_NAMESPACE" = "ray-app" ] || deploy_args+=" K8S_NAMESPACE=$K8S_NAMESPACE"
echo "kind cluster $KIND_CLUSTER is ready: make deploy$deploy_args   (then: make status, make k8s-logs)"
