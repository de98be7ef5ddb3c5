#!/usr/bin/env bash
# The one GPU check: on a machine with one NVIDIA GPU, in 8 minutes or less, one page (OUT/RESULTS.md):
#   1. the kit against a bare loop on the GPU, one worker, bf16: the same losses step for step, steady
#      samples/s, MFU (bench/run.py --gpu, case a: resnet50 at 128 px; FLOPs per sample counted by
#      torch.utils.flop_counter over the GPU's dense bf16 peak, 989 TFLOP/s for H100/H200)
#   2. checkpoint cost: time training is blocked per checkpoint to S3 (moto on loopback), sync vs async (case d)
#   3. DDP and FSDP on the same workload, samples/s and MFU of each (bench/gpu_page.py strategies); FSDP only where the kit accepts
#      `train.strategy: fsdp` (`ray-app config keys`), otherwise the page says it was not run and why
#   4. the GPU image's own `ray-app train` on the GPU (bench/gpu_page.py image) when Docker with the NVIDIA
#      runtime and the image (IMAGE_GPU, default ray-app:0.1.0-gpu) are there, otherwise the page says which is missing
#   5. a Llama-architecture model of 0.94B parameters (random weights, random token ids, causal_lm) with
#      train.precision=bf16-mixed, train.compile=true and train.activation_checkpointing=full: the kit
#      (model.name=hf) beside its twin with the same switches (from_pretrained of the same folder), tokens/s, MFU,
#      peak GPU memory (bench/gpu_lm.py); it takes what the parts before it left, at least its share
#
#   bash bench/gpu.sh [OUT_DIR]        # default OUT_DIR: bench/gpu (RESULTS.md, results.png; the figures in build/bench/gpu)
#
# No GPU: one line, exit 2, within seconds. A GPU path that starts and breaks (torch without CUDA, no bf16, a
# run that fails or overruns its share of the time) is one line naming it and exit 1: nothing is skipped
# silently. On a fresh copy of the repository it first creates .venv (pip install -e . plus moto[server],
# matplotlib, psutil): that install comes on top of the 8 minutes. Unknown GPU? Set BENCH_GPU_PEAK_TFLOPS.
# Downloads no data (synthetic images and token ids). BENCH_DEADLINE_S (default 480) is the whole check's time
# limit; BENCH_STRATEGIES_S, BENCH_IMAGE_S and BENCH_LM_S set the shares of parts 3-5 (the image's: 90 s, or 30
# where it cannot run; the language model's: 180 s), and parts 1-2 get the rest.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench/gpu}
DEADLINE=${BENCH_DEADLINE_S:-480}
PY=.venv/bin/python

fail() { echo "bench/gpu.sh: $*" >&2; exit 1; }
# run a part under its share of the time; a failure or an overrun is one line naming the part, exit 1
part() {
  local name=$1 seconds=$2 rc=0
  shift 2
  timeout --signal=TERM --kill-after=15 "$seconds" "$@" || rc=$?
  if ((rc == 124)); then fail "$name: still running after its ${seconds}s; its output is above"; fi
  if ((rc != 0)); then fail "$name failed (exit $rc); its output is above"; fi
}

# 1. A GPU, or one line and exit 2.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "bench/gpu.sh: no NVIDIA GPU found (no nvidia-smi on PATH): run it on a machine with one" >&2
  exit 2
fi
if ! gpus=$(timeout 20 nvidia-smi -L 2>/dev/null) || ! grep -q '^GPU ' <<<"$gpus"; then
  echo "bench/gpu.sh: no NVIDIA GPU found (nvidia-smi -L lists none): run it on a machine with one" >&2
  exit 2
fi
echo "$gpus"

if [ ! -x "$PY" ] || ! "$PY" -c "import ray_app, moto, matplotlib, psutil" >/dev/null 2>&1; then
  echo "== creating .venv (python3 -m venv .venv && pip install -e . moto[server] matplotlib psutil)"
  [ -x "$PY" ] || python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e . "moto[server]>=5" "matplotlib>=3.7" "psutil>=5.9"
fi
start=$SECONDS  # the 8 minutes start once the venv is there

# 2. torch sees the GPU and can do bf16; else the GPU path is broken.
"$PY" - <<'EOF' || fail "torch cannot use the GPU (above); install the kit's CUDA build of torch"
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
if not torch.cuda.is_bf16_supported():
    sys.exit(f"{torch.cuda.get_device_name(0)} has no bf16")
print(f"torch {torch.__version__} CUDA {torch.version.cuda} NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}: "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, bf16")
EOF

left() { echo $((DEADLINE - (SECONDS - start))); }
# Docker with the NVIDIA runtime and the GPU image: without them the image part only says what is missing
image_ready() {
  command -v docker >/dev/null 2>&1 || return 1
  [[ $(timeout 20 docker info --format '{{json .Runtimes}}' 2>/dev/null) == *nvidia* ]] || return 1
  timeout 20 docker image inspect "${IMAGE_GPU:-ray-app:0.1.0-gpu}" >/dev/null 2>&1
}
# seconds each part may take; what is left over goes to the kit vs bare loop and checkpoint runs
STRATEGIES_S=${BENCH_STRATEGIES_S:-90}
if [ -n "${BENCH_IMAGE_S:-}" ]; then IMAGE_S=$BENCH_IMAGE_S; elif image_ready; then IMAGE_S=90; else IMAGE_S=30; fi
LM_S=${BENCH_LM_S:-180}

# 3. Kit vs bare loop (case a) and checkpoint blocked time (case d): one round, stopping early if the time runs
#    short; writes OUT/RESULTS.md, the page the next parts append to.
measure_s=$(( $(left) - STRATEGIES_S - IMAGE_S - LM_S ))
(( measure_s >= 120 )) || fail "BENCH_DEADLINE_S=$DEADLINE leaves ${measure_s}s for the measurements; give it >= 120 s more"
echo "== kit vs bare loop, checkpoints (bench/run.py --gpu --cases a,d): at most ${measure_s}s"
part "the kit vs bare loop and checkpoint runs (bench/run.py --gpu)" "$measure_s" \
  "$PY" bench/run.py --gpu --cases a,d --rounds 1 --budget "$((measure_s - 60))" --out "$OUT" "${@:2}"

# 4. DDP and FSDP.
echo "== DDP and FSDP (bench/gpu_page.py strategies): at most ${STRATEGIES_S}s"
part "DDP and FSDP (bench/gpu_page.py strategies)" "$STRATEGIES_S" \
  "$PY" bench/gpu_page.py strategies --out "$OUT" --timeout "$((STRATEGIES_S - 10))"

# 5. The GPU image's own ray-app train.
image_s=$(left)
(( image_s > IMAGE_S )) && image_s=$IMAGE_S
(( image_s >= 30 )) || fail "no time left for the GPU image's run (${image_s}s of BENCH_DEADLINE_S=$DEADLINE)"
echo "== the GPU image (bench/gpu_page.py image): at most ${image_s}s"
part "the GPU image's run (bench/gpu_page.py image)" "$image_s" \
  "$PY" bench/gpu_page.py image --out "$OUT" --timeout "$((image_s - 10))"

# 6. The language model with every speed switch on: all the time left (its share at least, unless a part overran).
lm_s=$(left)
(( lm_s >= 60 )) || fail "no time left for the language model's runs (${lm_s}s of BENCH_DEADLINE_S=$DEADLINE)"
echo "== a 0.94B Llama, bf16-mixed + compile + full AC, kit and twin (bench/gpu_lm.py): at most ${lm_s}s"
part "the language model's runs (bench/gpu_lm.py)" "$lm_s" \
  "$PY" bench/gpu_lm.py --out "$OUT" --timeout "$((lm_s - 10))"

printf '\n_bash bench/gpu.sh: %s s in all (limit %s s)._\n' "$((SECONDS - start))" "$DEADLINE" >> "$OUT/RESULTS.md"
echo "== bench/gpu.sh: $OUT/RESULTS.md in $((SECONDS - start)) s"
