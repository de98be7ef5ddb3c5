#!/usr/bin/env bash
# `make deploy`: apply the manifests `make render` prints to the current
# kubectl context. Usage: deploy.sh MANIFESTS_FILE
#   1. checks that the KubeRay CRDs are installed
#   2. the namespace K8S_NAMESPACE (k8s/namespace, renamed), which must be the
#      namespace the manifests were rendered for (`make deploy` does both)
#   3. the Ray auth-token Secret in it when the manifests use one
#      (authOptions.secretName) and it is missing: random, never printed
#   4. k8s/admission (cluster-scoped: the ServiceAccount may change no pod
#      but for the metrics label), then the manifests; then k8s/monitoring in
#      the same namespace when the prometheus-operator CRDs exist
# K8S_TREE is the folder these are rendered from: k8s/ by default; `make
# deploy` passes build/k8s-tree, k8s/ with the files made from configs/ and
# monitoring/ fresh (k8s/scripts/sync.sh).
set -euo pipefail

manifests=${1:?usage: deploy.sh MANIFESTS_FILE}
: "${K8S_NAMESPACE:=ray-app}" "${KUBECTL:=kubectl}" "${K8S_TREE:=k8s}"
cd "$(dirname "$0")/../.."  # the repository root
RAYJOB=ray-app-train
AUTH_SECRET=ray-app-auth-token

command -v "${KUBECTL%% *}" >/dev/null || { echo "deploy: kubectl not found" >&2; exit 2; }
echo "==> context $($KUBECTL config current-context 2>/dev/null || echo '?'), namespace $K8S_NAMESPACE"
if ! $KUBECTL get crd rayjobs.ray.io >/dev/null 2>&1; then
  echo "deploy: the KubeRay CRDs are not installed in this cluster; on kind run 'make kind-up'," \
       "elsewhere install the KubeRay operator >= 1.6.0 (docs/kubernetes.md)" >&2
  exit 2
fi

rendered_ns=$(sed -n 's/^  namespace: //p' "$manifests" | sort -u)
if [ "$rendered_ns" != "$K8S_NAMESPACE" ]; then
  echo "deploy: $manifests is rendered for namespace(s) '$(echo $rendered_ns)', not K8S_NAMESPACE=$K8S_NAMESPACE;" \
       "render and deploy with the same K8S_NAMESPACE (make deploy K8S_NAMESPACE=...)" >&2
  exit 2
fi
KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/namespace" build/k8s/namespace "" "$K8S_NAMESPACE" | $KUBECTL apply -f -

if grep -q "secretName: $AUTH_SECRET" "$manifests" &&
   ! $KUBECTL -n "$K8S_NAMESPACE" get secret "$AUTH_SECRET" >/dev/null 2>&1; then
  od -An -tx1 -N32 /dev/urandom | tr -d ' \n' |
    $KUBECTL -n "$K8S_NAMESPACE" create secret generic "$AUTH_SECRET" --from-file=auth_token=/dev/stdin >/dev/null
  echo "created Secret $K8S_NAMESPACE/$AUTH_SECRET (a random Ray auth token, not printed)"
fi
if ! $KUBECTL -n "$K8S_NAMESPACE" get secret ray-app-s3 >/dev/null 2>&1; then
  echo "note: no Secret $K8S_NAMESPACE/ray-app-s3; the pods need IRSA, EKS Pod Identity or an EC2" \
       "instance role for S3, the last two with their egress component (docs/kubernetes.md, \"S3 credentials\")"
fi
if ! $KUBECTL -n "$K8S_NAMESPACE" get secret ray-app-mlflow >/dev/null 2>&1; then
  echo "note: no Secret $K8S_NAMESPACE/ray-app-mlflow; MLflow tracking is off unless the config sets" \
       "tracking.mlflow_uri (docs/kubernetes.md, \"Experiment tracking\")"
fi
if $KUBECTL -n "$K8S_NAMESPACE" get rayjob "$RAYJOB" >/dev/null 2>&1; then
  echo "note: RayJob $RAYJOB already exists; a finished job does not start again." \
       "'make undeploy deploy' starts a new attempt (the same run.name resumes from S3)"
fi

KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/admission" build/k8s/admission "" "" | $KUBECTL apply -f -
$KUBECTL apply -f "$manifests"

if $KUBECTL get crd podmonitors.monitoring.coreos.com prometheusrules.monitoring.coreos.com >/dev/null 2>&1; then
  KUBECTL="$KUBECTL" k8s/scripts/render.sh "$K8S_TREE/monitoring" build/k8s/monitoring "" "$K8S_NAMESPACE" | $KUBECTL apply -f -
else
  echo "note: no prometheus-operator CRDs: PodMonitors, rules and dashboard (k8s/monitoring) skipped"
fi
echo "deployed; follow it with: make status, make k8s-logs"
