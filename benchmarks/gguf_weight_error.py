"""Per-tensor weight error of GGUF files against the model they were made from (issue 23).

For each file, each quantized 2-D weight's relative squared error ``||Q - W||² / ||W||²`` against the
model's own weight, and the median per ggml type.  It shows where two files with the same types differ —
e.g. whether a quantizer reproduces weights that already lie on its grid (a model shipped as a GGUF and
dequantized, as the packaged Gemma-3-270m is).

    PYTHONPATH=src .venv/bin/python benchmarks/gguf_weight_error.py --model gemma3-270m A.gguf B.gguf
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.checkpoint.gguf import read_gguf_weights, tensor_types  # noqa: E402
from lowbit.evaluation.workbench import Workbench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--show", nargs="*", default=[], help="module names whose errors to print per file")
    args = ap.parse_args()
    model = Workbench.load(args.model, windows=1, calib_windows=1, progress=False).model
    ref = {k: v.float() for k, v in model.state_dict().items()}
    for f in args.files:
        types = tensor_types(f, model.config)
        errors: dict[str, list[float]] = defaultdict(list)
        for name, q in read_gguf_weights(f, model.config).items():
            module = name.removesuffix(".weight")
            if q.dim() < 2 or module not in types:
                continue
            w = ref[name]
            e = float(((q - w) ** 2).sum() / (w ** 2).sum())
            errors[types[module]].append(e)
            if module in args.show:
                print(f"{f.name}: {module} ({types[module]}) {e:.3e}")
        summary = ", ".join(f"{t} ×{len(v)} median {statistics.median(v):.3e}" for t, v in sorted(errors.items()))
        print(f"{f.name}: {summary}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
