"""Round-to-nearest weight error of several schemes on one model's Linear weights (issue 18).

For each scheme, the total squared error ``Σ ||Q(W) − W||²`` over the decoder's quantized Linear
weights (min-max scales, no calibration), and its ratio to the first scheme's. It isolates what a
scale rule alone does — e.g. ``int4-g64`` (``amax / 7.5``) against ``int4-g64-signed`` (each group's
extreme on −8) — before any calibration method or model evaluation.

    PYTHONPATH=src .venv/bin/python benchmarks/scheme_weight_error.py --model smollm2-135m \\
        --schemes int4-g64,int4-g64-signed,int2-g64,int2-g64-signed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.evaluation.workbench import Workbench  # noqa: E402
from lowbit.numerics.qtensor import fake_quantize  # noqa: E402
from lowbit.numerics.scheme import get_scheme  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemes", default="int4-g64,int4-g64-signed", help="comma-separated scheme presets")
    args = ap.parse_args()
    schemes = {n: get_scheme(n) for n in args.schemes.split(",")}
    model = Workbench.load(args.model, windows=1, calib_windows=1, progress=False).model
    layers = [(n, m.weight.detach().float()) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    totals = {}
    for name, scheme in schemes.items():
        totals[name] = sum(float((fake_quantize(w, scheme) - w).pow(2).sum()) for _, w in layers)
    first = next(iter(totals.values()))
    print(f"{args.model}: {len(layers)} Linear weights, {sum(w.numel() for _, w in layers):,} elements")
    print(f"{'scheme':<22} {'sum sq. error':>14} {'ratio':>7}")
    for name, t in totals.items():
        print(f"{name:<22} {t:>14.5g} {t / first:>7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
