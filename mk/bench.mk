# Benchmarks: the kit side by side with bare torchrun (bench/). Included by the
# Makefile, whose $(PY) / $(VENV) it uses. The full run takes about half an hour
# on 2 cores and writes bench/RESULTS.md, bench/results.png and build/bench/results.json;
# CI runs only a smoke: cases (c) and (e) at tiny size, outputs checked, not numbers
# (tests/bench/test_bench_smoke.py); `make bench-smoke` runs every case's.

BENCH_ARGS ?=

##@ Benchmarks

.PHONY: bench
bench: venv ## Kit vs bare torchrun, every case, 3 interleaved rounds -> bench/RESULTS.md (BENCH_ARGS="--cases a,c")
	$(PY) bench/run.py $(BENCH_ARGS)

.PHONY: bench-smoke
bench-smoke: venv ## Every bench case once at tiny size; checks the outputs are well-formed (CI runs cases c and e)
	$(PY) bench/run.py --smoke --out build/bench-smoke $(BENCH_ARGS)

.PHONY: bench-gpu
bench-gpu: ## On a machine with one GPU, <= 8 min: kit vs a bare loop (bf16, MFU), checkpoints, DDP vs FSDP, the GPU image (bench/gpu.sh)
	bash bench/gpu.sh

.PHONY: bench-addons
bench-addons: venv ## Every rank's pace and the run journal, their own time inside a real 2-rank step of workloads (a), (b): cost <= 0.5 % each
	$(PY) -m bench.addon_cost --json build/bench/addon_cost.json $(BENCH_ARGS)
