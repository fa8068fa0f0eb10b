#!/usr/bin/env bash
# Serve lowbit's exported folders with vLLM on a GPU machine and compare prompt-token
# log-probabilities with lowbit's own reading of the same files.  CI does not run this.
#
#   scripts/gpu_check.sh DIR [DIR ...]
#
# Needs: an NVIDIA GPU, Python 3.10+, this repository (lowbit importable from .venv or the
# current python), network or a local wheel cache for `pip install vllm`.
# Env: VLLM_SPEC (default "vllm"), PORT (default 8011), TOL (mean |Δ log p|, default 0.1),
#      KEEP_VENV=1 to reuse /tmp/vllm-venv.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [DIR ...]" >&2; exit 2; }
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY_LOWBIT="${PY_LOWBIT:-$HERE/.venv/bin/python}"; [ -x "$PY_LOWBIT" ] || PY_LOWBIT=python3
VENV=/tmp/vllm-venv; PORT="${PORT:-8011}"; TOL="${TOL:-0.1}"
WORK="$(mktemp -d)"; trap 'kill ${SERVER:-0} 2>/dev/null || true' EXIT

if [ ! -x "$VENV/bin/vllm" ] || [ -z "${KEEP_VENV:-}" ]; then
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "${VLLM_SPEC:-vllm}"
fi
cat > "$WORK/prompts.txt" <<'P'
The capital of France is Paris, and the capital of Germany is
In 1969, the first humans landed on the Moon as part of the Apollo program.
def fibonacci(n):
    if n < 2:
A quantized language model stores its weights in fewer bits, which
P

status=0
for DIR in "$@"; do
  DIR="$(cd "$DIR" && pwd)"; name="$(basename "$DIR")"
  echo "== $name"; "$PY_LOWBIT" -m lowbit.cli serve-command "$DIR" 2>/dev/null || true
  KV=""; grep -q '"kv_cache_scheme": {' "$DIR/config.json" && KV="--kv-cache-dtype fp8"
  "$VENV/bin/vllm" serve "$DIR" --port "$PORT" --max-model-len 2048 --gpu-memory-utilization 0.5 $KV \
      > "$WORK/$name.server.log" 2>&1 & SERVER=$!
  for _ in $(seq 1 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 2; done
  if ! curl -sf "localhost:$PORT/health" >/dev/null; then
    echo "FAIL $name: vLLM did not start"; tail -20 "$WORK/$name.server.log"; status=1; kill $SERVER; continue
  fi
  grep -iE "quantiz|kernel|marlin|warn" "$WORK/$name.server.log" | head -8 || true
  "$VENV/bin/python" - "$DIR" "$PORT" "$WORK/prompts.txt" "$WORK/$name.vllm.json" <<'PY'
import json, sys, urllib.request
folder, port, prompts, out = sys.argv[1:5]
rows = []
for p in [l for l in open(prompts).read().splitlines() if l.strip()]:
    body = {"model": folder, "prompt": p, "max_tokens": 16, "temperature": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 0}
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    r = json.load(urllib.request.urlopen(req))["choices"][0]
    pl = r.get("prompt_logprobs") or []
    treq = urllib.request.Request(f"http://localhost:{port}/tokenize", json.dumps({"model": folder, "prompt": p}).encode(),
                                  {"Content-Type": "application/json"})
    ids = json.load(urllib.request.urlopen(treq))["tokens"]
    lps = [d[str(t)]["logprob"] for d, t in zip(pl[1:], ids[1:])]  # entry of the actual prompt token
    print(f"  {p[:40]!r} -> {r['text'][len(p):][:60]!r}")
    rows.append({"prompt": p, "ids": ids, "logprobs": lps})
json.dump(rows, open(out, "w"))
PY
  kill $SERVER; wait $SERVER 2>/dev/null || true
  "$PY_LOWBIT" "$HERE/scripts/gpu_logprobs.py" lowbit "$DIR" "$WORK/prompts.txt" "$WORK/$name.lowbit.json"
  "$PY_LOWBIT" "$HERE/scripts/gpu_logprobs.py" compare "$WORK/$name.lowbit.json" "$WORK/$name.vllm.json" --tol "$TOL" \
    && echo "PASS $name" || { echo "FAIL $name (log-probs)"; status=1; }
done
echo "results in $WORK"; exit $status
