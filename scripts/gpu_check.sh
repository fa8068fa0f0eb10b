#!/usr/bin/env bash
# The GPU check of issue 19, for a CUDA machine (CI and CPU-only machines do not run it).
#
#   scripts/gpu_check.sh [--large PATH] [--out DIR] [--windows N] [--no-verify]
#   scripts/gpu_check.sh DIR [DIR ...] [-- options]   # verify exported folders only (scripts/gpu_verify.sh)
#
# 1. On the GPU (--device cuda), for the packaged model (smollm2-135m) and, with --large, a larger
#    model folder: compare (reference pass, calibration, batched evaluation), quantize with
#    W4A16 RTN and GPTQ (written and evaluated), and quantize the larger model with --low-memory
#    (one decoder layer on the GPU at a time). Each stage's wall time and peak GPU memory
#    (torch's allocator) go to OUT/stages.jsonl and are printed.
# 2. The packaged model is exported with FP8 (dynamic, static, block), W4A16, W8A8 INT8, NVFP4 and
#    MXFP4 — the FP4 formats only on a GPU with FP4 lanes (compute capability 10.0 and up), FP8 on
#    8.9 and up — and every folder goes through `lowbit verify` with a GPU build of vLLM
#    (scripts/gpu_verify.sh installs it into $VENV, default /tmp/vllm-venv).
#
# Env: PY_LOWBIT (python with lowbit's dependencies, default .venv/bin/python), VENV, VLLM_SPEC,
#      DTYPE (default bf16 for the larger model), RECIPE_LARGE (default w4a16-gptq-g128).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"

if [ $# -ge 1 ] && [ -d "$1" ]; then  # the former interface: folders to verify
  exec "$HERE/scripts/gpu_verify.sh" "$@"
fi

LARGE=""; OUT="/tmp/lowbit-gpu-check"; WINDOWS=64; VERIFY=1
while [ $# -gt 0 ]; do
  case "$1" in
    --large) LARGE="${2:?--large needs a model folder}"; shift 2 ;;
    --out) OUT="${2:?--out needs a folder}"; shift 2 ;;
    --windows) WINDOWS="${2:?--windows needs a number}"; shift 2 ;;
    --no-verify) VERIFY=0; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PY="${PY_LOWBIT:-$HERE/.venv/bin/python}"; [ -x "$PY" ] || PY=python3
export PYTHONPATH="$HERE/src${PYTHONPATH:+:$PYTHONPATH}"

# Refuse clearly where there is no GPU: before any download or model load.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi is missing or lists none); run it on a CUDA machine" >&2
  exit 3
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check.sh: $PY has no CUDA torch (torch.cuda.is_available() is False); install a CUDA build" >&2
  exit 3
fi
if [ -n "$LARGE" ] && [ ! -f "$LARGE/config.json" ]; then
  echo "gpu_check.sh: --large $LARGE is not a model folder (no config.json)" >&2
  exit 2
fi

mkdir -p "$OUT"
STAGES="$OUT/stages.jsonl"; : > "$STAGES"
CC="$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(a * 10 + b)')"
echo "[gpu_check] $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); compute capability ${CC}"

stage() {  # stage NAME lowbit-args...
  local name="$1"; shift
  "$PY" "$HERE/scripts/gpu_stage.py" "$STAGES" "$name" -- "$@"
}

SMALL=smollm2-135m
stage "compare $SMALL" compare "$SMALL" --device cuda --windows "$WINDOWS" \
  --recipes w4a16-int4-g128,w4a16-gptq-g128,fp8-dynamic --json "$OUT/compare-$SMALL.json" --force
stage "quantize $SMALL w4a16-gptq-g128" quantize "$SMALL" --device cuda --recipe w4a16-gptq-g128 \
  --windows "$WINDOWS" --out "$OUT/$SMALL-w4a16-gptq-g128" --force
stage "quantize $SMALL low-memory" quantize "$SMALL" --device cuda --low-memory --no-eval \
  --recipe w4a16-gptq-g128 --out "$OUT/$SMALL-w4a16-gptq-g128-lowmem" --force

if [ -n "$LARGE" ]; then
  NAME="$(basename "$LARGE")"; R="${RECIPE_LARGE:-w4a16-gptq-g128}"; DT="${DTYPE:-bf16}"
  # --device auto: a device map when the model does not fit one GPU (evaluation only)
  stage "eval $NAME $DT" eval "$LARGE" --device auto --dtype "$DT" --windows "$WINDOWS" \
    --json "$OUT/eval-$NAME.json" --force
  stage "quantize $NAME low-memory $R" quantize "$LARGE" --device cuda --dtype "$DT" --low-memory --no-eval \
    --recipe "$R" --out "$OUT/$NAME-$R" --force
  stage "eval $NAME-$R" eval "$OUT/$NAME-$R" --reference "$LARGE" --device auto --dtype "$DT" \
    --windows "$WINDOWS" --json "$OUT/eval-$NAME-$R.json" --force
fi

if [ "$VERIFY" = 1 ]; then
  recipes=(w4a16-int4-g128 w8a8-int8)
  [ "$CC" -ge 89 ] && recipes+=(fp8-dynamic fp8-tensor fp8-block)
  [ "$CC" -ge 100 ] && recipes+=(nvfp4 mxfp4)
  [ "$CC" -lt 100 ] && echo "[gpu_check] NVFP4 / MXFP4 skipped: compute capability $CC < 10.0 has no FP4 lanes"
  dirs=()
  for R in "${recipes[@]}"; do
    stage "export $SMALL $R" quantize "$SMALL" --device cuda --recipe "$R" --no-eval \
      --out "$OUT/verify/$SMALL-$R" --force
    dirs+=("$OUT/verify/$SMALL-$R")
  done
  "$HERE/scripts/gpu_verify.sh" "${dirs[@]}" -- --device cuda --json "$OUT/verify.json" --force
fi
echo "[gpu_check] stages: $STAGES"
