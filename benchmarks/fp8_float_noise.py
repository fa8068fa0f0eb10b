"""How far apart two correct implementations of a dynamic-activation recipe land when only their
float precision differs (issue 14: why KL(lowbit ‖ vLLM) for FP8 dynamic is 12× the noise floor).

The same lowbit quantization of SmolLM2 runs twice over the same windows: once in fp32, once in bf16
(weights, residual stream and activations in bf16; Linears as fp32 products of bf16 operands, rounded
to bf16, as ``lowbit verify``'s prediction and vLLM's CPU kernels compute them).  For each recipe it
prints KL(fp32 ‖ bf16) of the two runs (full distributions, mean over predicted tokens), their top-1
agreement, and the ratio to the unquantized model's KL(fp32 ‖ bf16): the noise floor.  A dynamic
per-token activation quantizer turns the bf16 perturbation of its input into code flips, so the
disagreement of two such implementations is a multiple of the floor even when both are right.

    PYTHONPATH=src .venv/bin/python benchmarks/fp8_float_noise.py --windows 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.engines.bf16 import bf16_linear_via_fp32  # noqa: E402
from lowbit.evaluation.workbench import Workbench  # noqa: E402
from lowbit.models.loading import load_model  # noqa: E402
from lowbit.quantization.pipeline import quantize  # noqa: E402
from lowbit.quantization.recipe import load_recipe  # noqa: E402
from lowbit.quantization.runtime import quantized_execution  # noqa: E402


def _logits(model, state, windows) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode(), quantized_execution(model, state) as fwd, bf16_linear_via_fp32():
        for w in range(len(windows)):
            out.append(fwd(windows[w:w + 1])[0, :-1].float())
    return out


def _kl(p_logits, q_logits) -> tuple[float, float]:
    kl = top1 = n = 0.0
    for a, b in zip(p_logits, q_logits):
        lp, lq = F.log_softmax(a.double(), -1), F.log_softmax(b.double(), -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        top1 += float((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
    return kl / n, top1 / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--recipes", default="fp8-dynamic,w8a8-int8,fp8-block,w4a16-int4-g128")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bench = Workbench.load(args.model, windows=args.windows, calib_windows=0, progress=False)
    windows = bench.windows
    results = []
    ref32 = None
    for name in ["unquantized", *args.recipes.split(",")]:
        runs = []
        for dtype in (torch.float32, torch.bfloat16):
            m, _, _ = load_model(str(bench.info.path), dtype=dtype)
            state = None if name == "unquantized" else quantize(m, load_recipe(name), None, progress=False)
            runs.append(_logits(m, state, windows))
            del m
        if ref32 is None:
            ref32 = runs[0]
        kl, top1 = _kl(runs[0], runs[1])
        qkl, _ = _kl(ref32, runs[0]) if name != "unquantized" else (0.0, 1.0)
        results.append({"recipe": name, "kl_fp32_vs_bf16": kl, "top1_fp32_vs_bf16": top1, "kl_quantization_fp32": qkl})
        floor = results[0]["kl_fp32_vs_bf16"]
        print(f"{name:18s} KL(fp32 ‖ bf16) {kl:.5f} ({kl / floor:5.1f}× floor)  top-1 {top1:.4f}  "
              f"quantization KL(ref ‖ recipe, fp32) {qkl:.5f}  ratio {kl / qkl if qkl else float('nan'):.2f}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "windows": args.windows, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
