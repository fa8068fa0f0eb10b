#!/usr/bin/env bash
# The real-model MoE check (issue 21), for a GPU machine with network access; CI does not run it.
# Quantizes a real Qwen3-MoE (default Qwen/Qwen3-30B-A3B, ~61 GB in bf16: load it whole, the
# low-memory path refuses MoE) with a few recipes, then serves each folder with vLLM and compares
# log-probabilities with lowbit's reading (scripts/gpu_verify.sh).
#
#   scripts/gpu_check_moe.sh [MODEL] [OUT]
#
# Env: RECIPES (default "w4a16-int4-g128 fp8-dynamic w4a16-nvfp4 w4a16-gptq-g128 w4a16-awq-g128-asym"), CALIB (calibration windows).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY_LOWBIT:-$HERE/.venv/bin/python}"; [ -x "$PY" ] || PY=python3
lowbit() { "$PY" -c 'import sys; from lowbit.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
MODEL="${1:-Qwen/Qwen3-30B-A3B}"; OUT="${2:-/tmp/lowbit-moe}"
mkdir -p "$OUT"
dirs=()
for R in ${RECIPES:-w4a16-int4-g128 fp8-dynamic w4a16-nvfp4 w4a16-gptq-g128 w4a16-awq-g128-asym}; do
  D="$OUT/$(basename "$MODEL")-$R"
  # every expert is quantized; experts with < 16 calibration tokens are rounded (logged per layer)
  lowbit quantize "$MODEL" --recipe "$R" --out "$D" --force ${CALIB:+--calib-windows "$CALIB"}
  dirs+=("$D")
done
exec "$HERE/scripts/gpu_verify.sh" "${dirs[@]}"
