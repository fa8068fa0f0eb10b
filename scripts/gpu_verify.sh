#!/usr/bin/env bash
# `lowbit verify` with a GPU build of vLLM: serve lowbit's exported folders with vLLM on a GPU
# machine and compare them with lowbit's prediction (PPL, KL, top-1, noise floor). CI does not
# run this; it covers the schemes vLLM's CPU backend cannot run (NVFP4, MXFP4, FP8 static /
# block / weight-only, W8A16, the FP8 KV cache on CPUs without AVX-512).
#
#   scripts/gpu_verify.sh DIR [DIR ...] [-- lowbit verify options, e.g. --windows 32]
#   (scripts/gpu_check.sh DIR ... does the same; without DIR it runs the whole GPU check)
#
# Needs: an NVIDIA GPU, Python 3.10+, this repository (lowbit importable from .venv or the
# current python), network or a local wheel cache for `pip install vllm`.
# Env: VLLM_SPEC (default "vllm"), VENV (default /tmp/vllm-venv, reused when it has vLLM).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [DIR ...] [-- options]" >&2; exit 2; }
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY_LOWBIT="${PY_LOWBIT:-$HERE/.venv/bin/python}"; [ -x "$PY_LOWBIT" ] || PY_LOWBIT=python3
VENV="${VENV:-/tmp/vllm-venv}"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "${VLLM_SPEC:-vllm}"
fi
dirs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done; [ $# -gt 0 ] && shift
PYTHONPATH="$HERE/src${PYTHONPATH:+:$PYTHONPATH}" "$PY_LOWBIT" -c "import sys; from lowbit.cli import main; sys.exit(main())" \
  verify "${dirs[@]}" --python "$VENV/bin/python" "$@"
