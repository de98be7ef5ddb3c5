#!/usr/bin/env bash
# GPU benchmarks: cases (a) throughput, (c) time to first step, (d) checkpoint cost,
# on ONE GPU with ONE worker and bf16 -- the kit (`ray-app train --set scaling.use_gpu=true
# --set scaling.num_workers=1 --set train.amp=true`) against a bare single-process loop
# (bench/twin.py --device cuda) -- reporting samples/s and model FLOP utilization (MFU:
# FLOPs per sample counted by torch.utils.flop_counter.FlopCounterMode x samples/s over the
# GPU's dense bf16 peak, 989 TFLOP/s for H100/H200). With >= 2 GPUs it adds the
# DataParallel baseline. The measurements stop starting new rounds after BENCH_BUDGET_S.
#
#   bash bench/gpu.sh [OUT_DIR]        # default OUT_DIR: bench/gpu  (RESULTS.md, results.png; results.json in build/bench/gpu)
#
# Self-contained on a fresh copy of the repository: creates .venv (pip install -e . plus
# moto[server] for the S3 API server and matplotlib) when it is missing. Unknown GPU? Set
# BENCH_GPU_PEAK_TFLOPS. Installs nothing else and downloads no data (synthetic images).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench/gpu}
BUDGET=${BENCH_BUDGET_S:-240}   # measuring; the venv (first run only) comes on top
ROUNDS=${BENCH_ROUNDS:-2}
PY=.venv/bin/python

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU visible (nvidia-smi -L failed); run it on a GPU machine" >&2
  exit 2
fi
nvidia-smi -L

if [ ! -x "$PY" ] || ! "$PY" -c "import ray_app, moto, matplotlib, psutil" >/dev/null 2>&1; then
  echo "== creating .venv (python3 -m venv .venv && pip install -e . moto[server] matplotlib psutil)"
  [ -x "$PY" ] || python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e . "moto[server]>=5" "matplotlib>=3.7" "psutil>=5.9"
fi

"$PY" - <<'EOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: torch {torch.__version__} sees no CUDA device (a CPU-only wheel?); install a CUDA build")
print(f"torch {torch.__version__}: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF

# the kit's workers and the bare loop each get the host's CPUs for the data loader; no other tuning
exec timeout --signal=TERM 900 "$PY" bench/run.py --gpu --rounds "$ROUNDS" --budget "$BUDGET" --out "$OUT" "${@:2}"
