# Containers: images (docker/Dockerfile) and a cluster of containers on this
# machine (docker/compose.yaml). Included by the Makefile; uses its IMAGE,
# VERSION, VENV and ARGS. docs/containers.md explains every target.

##@ Containers (one machine: Ray head + worker containers, MinIO, Prometheus)

IMAGE_GPU ?= $(IMAGE)-gpu
RAY_WORKERS ?= 2
DASHBOARD ?= http://127.0.0.1:8265
CLUSTER_CONFIG ?= configs/cluster.yaml
# Secrets are read from git-ignored files at call time, never echoed by make.
CLUSTER_ENV = IMAGE=$(IMAGE) RAY_AUTH_TOKEN="$$(cat .ray-token)" MINIO_ROOT_PASSWORD="$$(cat .minio-secret)"
COMPOSE = $(CLUSTER_ENV) docker compose -f docker/compose.yaml

.PHONY: image
image: ## Build the CPU image $(IMAGE) (pinned python base; BASE_IMAGE=... to override)
	docker build -f docker/Dockerfile --target cpu --build-arg VERSION=$(VERSION) \
	  $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -t $(IMAGE) .

.PHONY: image-gpu
image-gpu: ## Build the CUDA image $(IMAGE_GPU): the same python base, torch's CUDA wheels from the index (GPU_BASE_IMAGE=... to override)
	bash docker/stages.sh gpu | docker build -f - --target gpu --build-arg VERSION=$(VERSION) \
	  $(if $(GPU_BASE_IMAGE),--build-arg GPU_BASE_IMAGE=$(GPU_BASE_IMAGE)) -t $(IMAGE_GPU) .

.PHONY: image-offline
image-offline: ## Build $(IMAGE) without a registry: debootstrap base + local wheelhouse
	IMAGE=$(IMAGE) docker/build-offline.sh

.PHONY: image-gpu-offline
image-gpu-offline: ## Build $(IMAGE_GPU) without a registry: the same debootstrap base + a wheelhouse of torch's CUDA wheels (3.1 GB)
	TARGET=gpu IMAGE=$(IMAGE_GPU) docker/build-offline.sh

# Random secrets, made once, mode 600, never printed.
.ray-token .minio-secret:
	@umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > $@ && echo "wrote $@ (kept private, git-ignored)"

.PHONY: compose-up
compose-up: .ray-token .minio-secret ## Start the cluster of containers (RAY_WORKERS=2); dashboard http://127.0.0.1:8265
	$(COMPOSE) up -d --scale worker=$(RAY_WORKERS)
	@echo "Ray dashboard http://127.0.0.1:8265  Prometheus http://127.0.0.1:9090  MinIO http://127.0.0.1:9001"
	@echo "next: make compose-submit"

.PHONY: compose-submit
compose-submit: venv .ray-token ## Train $(CLUSTER_CONFIG) on the cluster of containers (ray job submit); ARGS="--set k=v"
	RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$$(cat .ray-token)" $(VENV)/bin/ray job submit \
	  --address $(DASHBOARD) --working-dir . \
	  --runtime-env-json '{"excludes": [".ray-token", ".minio-secret", ".venv", "runs", "build"]}' \
	  -- ray-app train --config $(CLUSTER_CONFIG) $(ARGS)

.PHONY: compose-logs
compose-logs: ## Follow the logs of the cluster's containers
	$(COMPOSE) logs -f --tail 100

.PHONY: compose-down
compose-down: ## Stop the cluster of containers (checkpoints stay in the minio-data volume)
	$(COMPOSE) down

.PHONY: compose-down-volumes
compose-down-volumes: ## Stop the cluster of containers and delete its volumes (checkpoints, metrics)
	$(COMPOSE) down --volumes

# Short aliases, as the quick start names them (`make up && make submit`), and `make down`.
.PHONY: up submit down
up: compose-up ## alias of compose-up
submit: compose-submit ## alias of compose-submit
down: compose-down ## alias of compose-down

.PHONY: test-e2e
test-e2e: venv ## Container e2e tests (builds the image offline first; needs Docker)
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)
