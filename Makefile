# ray_app: PyTorch DDP on Ray Train. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VERSION := 0.1.0
# The one image name shared by the Makefile, docker/compose.yaml and k8s/ (a test checks they agree).
IMAGE ?= ray-app:$(VERSION)
CONFIG ?= configs/local.yaml
ARGS ?=

##@ Quick start

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make \033[36m<target>\033[0m [VAR=value]\n"} /^[a-zA-Z0-9_-]+:.*?##/ { printf "  \033[36m%-20s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

.PHONY: venv
venv: $(VENV)/.installed ## Create .venv and install the kit with dev extras

.PHONY: train
train: venv ## Train the default config (local Ray, 2 CPU workers, ./runs); CONFIG=... ARGS="--set k=v"
	$(VENV)/bin/ray-app train --config $(CONFIG) $(ARGS)

.PHONY: sweep
sweep: venv ## Sweep the default config over configs/sweeps/digits.yaml (Ray Tune, ASHA) into ./runs/digits-sweep; SPACE=... ARGS="--set k=v"
	$(VENV)/bin/ray-app sweep --config $(CONFIG) --space $(or $(SPACE),configs/sweeps/digits.yaml) --set run.name=digits-sweep $(ARGS)

.PHONY: test
test: venv ## Run every test tier (unit, deploy, bench, integration, e2e; e2e needs Docker), integration modules side by side, longest first; CI's run
	$(PY) -m tests.streams --durations=25 $(PYTEST_ARGS)

.PHONY: test-long
test-long: venv ## The soaks and long variants CI leaves out: chaos with 20 faults, every bench case's smoke (about an hour)
	$(PY) -m pytest tests -m long --durations=25 $(PYTEST_ARGS)

##@ Test tiers (each one folder of tests/; PYTEST_ARGS="-k s3" to select)

.PHONY: test-unit
test-unit: venv ## ray_app's own logic, no cluster or server, a few minutes (tests/unit)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

.PHONY: test-deploy
test-deploy: venv ## Static checks of k8s/, monitoring/, docker/, CI scripts, lint (tests/deploy)
	$(PY) -m pytest tests/deploy $(PYTEST_ARGS)

.PHONY: test-bench
test-bench: venv ## bench/'s parsing, and the bench smoke run CI keeps (tests/bench, a few minutes)
	$(PY) -m pytest tests/bench $(PYTEST_ARGS)

.PHONY: test-integration
test-integration: venv ## Real Ray, S3 API server, Prometheus (tests/integration, tens of minutes)
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

##@ Development

N ?= 20
SEED ?=

.PHONY: chaos
chaos: venv ## One run on local Ray, N random SIGKILL/SIGTERM/SIGSTOP faults, ends bit-identical -> build/chaos.json (N=20 SEED=)
	$(PY) -m tests.integration.chaos --faults $(N) $(if $(SEED),--seed $(SEED)) --out build/chaos.json

.PHONY: lint
lint: venv ## ruff (pyflakes, pycodestyle, isort, bugbear; config in pyproject.toml); also run by the deploy tests
	$(VENV)/bin/ruff check ray_app bench tests

.PHONY: check-ray
check-ray: venv ## Check each assumption the kit makes about Ray's private code against the installed Ray (ray_app/shared/ray_seam.py)
	$(PY) -m ray_app.shared.ray_seam

.PHONY: preflight
preflight: venv ## Check config, storage and cluster without training
	$(VENV)/bin/ray-app preflight --config $(CONFIG) $(ARGS)

.PHONY: clean
clean: ## Remove runs/ and caches (keeps .venv)
	rm -rf runs .pytest_cache build dist

-include mk/*.mk
