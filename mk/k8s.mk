# Kubernetes (KubeRay): kind on a laptop, and any cluster with KubeRay >= 1.6.0.
# Included by the Makefile, whose IMAGE it uses. docs/kubernetes.md walks
# through both paths. Manifests: k8s/ (kustomize base + overlays, monitoring).

OVERLAY ?= kind-cpu
K8S_NAMESPACE ?= ray-app
KIND_CLUSTER ?= ray-app
KUBERAY_VERSION ?= 1.7.0
KUBE_PROMETHEUS_STACK_VERSION ?= 79.12.0
KIND_MONITORING ?= 1
KUBECTL ?= kubectl
K8S_BUILD := build/k8s/$(OVERLAY)
K8S_MANIFESTS := $(K8S_BUILD)/manifests.yaml

# The image goes into the manifests only when IMAGE is given on the command
# line or in the environment; otherwise each overlay keeps its own
# (kind-cpu: ray-app:0.1.0 = IMAGE, gpu: ray-app:0.1.0-gpu).
K8S_IMAGE := $(if $(filter command line environment environment override,$(origin IMAGE)),$(IMAGE),)

# kustomize reads files under k8s/ only, so a few files there are made from
# configs/ and monitoring/ (k8s/scripts/sync.sh lists them). render, deploy
# and kind-up read K8S_TREE, a copy of k8s/ with those made fresh, and never
# write to k8s/; `make k8s-sync` refreshes the tracked files, a unit test
# checks they match.
K8S_TREE := build/k8s-tree

##@ Kubernetes (KubeRay)

.PHONY: kind-up
kind-up: k8s-tree ## Create the kind cluster, load IMAGE, install KubeRay (pinned), MinIO and Prometheus (KIND_MONITORING=0: none)
	KIND_CLUSTER=$(KIND_CLUSTER) IMAGE=$(IMAGE) KUBERAY_VERSION=$(KUBERAY_VERSION) \
	KUBE_PROMETHEUS_STACK_VERSION=$(KUBE_PROMETHEUS_STACK_VERSION) KIND_MONITORING=$(KIND_MONITORING) \
	K8S_NAMESPACE=$(K8S_NAMESPACE) K8S_TREE=$(K8S_TREE) k8s/scripts/kind-up.sh

.PHONY: kind-load
kind-load: ## Load a rebuilt IMAGE into the kind cluster's nodes
	kind load docker-image $(IMAGE) --name $(KIND_CLUSTER)

.PHONY: render
render: $(K8S_MANIFESTS) ## Print the RayJob manifests of OVERLAY (kind-cpu|gpu) with IMAGE and K8S_NAMESPACE, as deploy applies them (deploy also applies the namespace, admission policy and monitoring)
	@cat $(K8S_MANIFESTS)

.PHONY: deploy
deploy: $(K8S_MANIFESTS) ## Apply OVERLAY to the current kubectl context (default kind-cpu; OVERLAY=gpu IMAGE=... for GPUs)
	K8S_NAMESPACE=$(K8S_NAMESPACE) K8S_TREE=$(K8S_TREE) KUBECTL="$(KUBECTL)" k8s/scripts/deploy.sh $(K8S_MANIFESTS)

.PHONY: undeploy
undeploy: ## Delete the RayJob (and its RayCluster); checkpoints in S3 stay, the next deploy resumes
	$(KUBECTL) -n $(K8S_NAMESPACE) delete rayjob ray-app-train --ignore-not-found --wait

.PHONY: status
status: ## Show the RayJob, its RayCluster and pods
	@$(KUBECTL) -n $(K8S_NAMESPACE) get rayjob ray-app-train \
		-o custom-columns='RAYJOB:.metadata.name,JOB STATUS:.status.jobStatus,DEPLOYMENT:.status.jobDeploymentStatus,RAYCLUSTER:.status.rayClusterName,FAILED:.status.failed,MESSAGE:.status.message' \
		|| echo "no RayJob in namespace $(K8S_NAMESPACE): make deploy"
	@$(KUBECTL) -n $(K8S_NAMESPACE) get rayclusters,pods -o wide 2>/dev/null || true

.PHONY: k8s-logs
k8s-logs: ## Follow the training job's output (the submitter tails `ray job logs`)
	$(KUBECTL) -n $(K8S_NAMESPACE) logs --follow --tail=200 job/ray-app-train

.PHONY: k8s-dashboard
k8s-dashboard: ## Forward the Ray dashboard and job API to http://127.0.0.1:8265 (token: docs/kubernetes.md)
	@cluster=$$($(KUBECTL) -n $(K8S_NAMESPACE) get rayjob ray-app-train -o jsonpath='{.status.rayClusterName}' 2>/dev/null); \
	test -n "$$cluster" || { echo "no RayCluster for ray-app-train yet: make status" >&2; exit 1; }; \
	echo "Ray dashboard of $$cluster: http://127.0.0.1:8265 (Ctrl-C stops)"; \
	$(KUBECTL) -n $(K8S_NAMESPACE) port-forward --address 127.0.0.1 svc/$$cluster-head-svc 8265:8265

.PHONY: kueue-setup
kueue-setup: k8s-tree ## A team's admin, once: Kueue's ClusterQueue and ResourceFlavor, the PriorityClasses, K8S_NAMESPACE's LocalQueue (k8s/kueue; Kueue 0.15+)
	@$(KUBECTL) get crd clusterqueues.kueue.x-k8s.io localqueues.kueue.x-k8s.io >/dev/null 2>&1 || { \
	  echo "kueue-setup: Kueue's CRDs are not installed in this cluster; install Kueue 0.15 or newer (docs/kubernetes.md, \"Queues and priorities\")" >&2; exit 2; }
	KUBECTL="$(KUBECTL)" k8s/scripts/render.sh $(K8S_TREE)/namespace build/k8s/namespace "" "$(K8S_NAMESPACE)" | $(KUBECTL) apply -f -
	KUBECTL="$(KUBECTL)" k8s/scripts/render.sh $(K8S_TREE)/kueue/cluster-queue build/k8s/kueue-cluster-queue "" "" | $(KUBECTL) apply -f -
	KUBECTL="$(KUBECTL)" k8s/scripts/render.sh $(K8S_TREE)/kueue/local-queue build/k8s/kueue-local-queue "" "$(K8S_NAMESPACE)" | $(KUBECTL) apply -f -

.PHONY: kind-down
kind-down: ## Delete the kind cluster (MinIO's checkpoints go with it)
	kind delete cluster --name $(KIND_CLUSTER)

.PHONY: k8s-sync
k8s-sync: ## Refresh the files under k8s/ made from configs/{kind,gpu}.yaml, the dashboard and the alert rules (says each one it rewrites)
	@k8s/scripts/sync.sh

# Not for users: render, deploy and kind-up build it first (a note names each
# stale file under k8s/).
.PHONY: k8s-tree
k8s-tree:
	@k8s/scripts/sync.sh --tree $(K8S_TREE)

# The rendered manifests: a generated kustomization on top of the overlay
# (in K8S_TREE) that sets the image and the namespace (kubectl kustomize
# alone cannot take them); k8s/scripts/render.sh writes it, for k8s/monitoring
# and the kind MinIO too.
.PHONY: $(K8S_MANIFESTS)
$(K8S_MANIFESTS): k8s-tree
	@test -d k8s/overlays/$(OVERLAY) || { echo "OVERLAY=$(OVERLAY): no such overlay; use one of: $$(ls k8s/overlays | tr '\n' ' ')" >&2; exit 2; }
	@mkdir -p $(K8S_BUILD)
	@KUBECTL="$(KUBECTL)" k8s/scripts/render.sh $(K8S_TREE)/overlays/$(OVERLAY) $(K8S_BUILD) "$(K8S_IMAGE)" "$(K8S_NAMESPACE)" > $@.tmp && mv $@.tmp $@
