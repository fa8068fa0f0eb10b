"""Ways to run SmolLM2-135M's matmuls on this CPU: speed against accuracy (issue 3).

Evaluation throughput is bounded by the FP32 GEMMs of the forward (74% of its time). This
benchmark asks whether any matmul route this torch build offers is faster than plain FP32 while
keeping FP32-level accuracy. For each Linear shape of one 512-token forward of SmolLM2-135M
(q/o 576->576, k/v 576->192, gate/up 576->1536, down 1536->576, lm_head 576->49152; each
decoder shape 30 times) it times, alternating and keeping the best round of each:

* ``fp32``        ``x @ w.T`` as transformers runs it (MKL sgemm);
* ``fp32-packed`` MKL with the weight packed once (what inductor's freezing uses);
* ``bf16``        oneDNN with ``fp32_precision="bf16"``: inputs rounded to BF16 (AMX), FP32
                  accumulation and output, weight packed once — fast, but not FP32-accurate;
* ``bf16x3``      FP32 emulated with three BF16 products, x_hi@w_hi + x_hi@w_lo + x_lo@w_hi,
                  where a_hi = bf16(a) and a_lo = bf16(a - a_hi), each on oneDNN as above;
* ``bf16x3-cat``  the same three products as one GEMM over the concatenated K axis.

and the largest error of each against a float64 product, relative to the largest |output|.
Run: ``.venv/bin/python benchmarks/matmul_paths.py [--rounds 5] [--tokens 512]``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch

# (in_features, out_features, uses per forward) of SmolLM2-135M's Linears.
SHAPES = {
    "q/o": (576, 576, 60),
    "k/v": (576, 192, 60),
    "gate/up": (576, 1536, 60),
    "down": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}


@contextlib.contextmanager
def fp32_precision(mode: str):
    old = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = mode
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old


def split_bf16(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a = hi + lo + O(2^-17 |a|), both exactly representable in BF16 (kept as FP32)."""
    hi = a.bfloat16().float()
    return hi, (a - hi).bfloat16().float()


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def paths(w: torch.Tensor, tokens: int) -> dict:
    """Each path as a function of x, with its weight prepared (packed, split) once."""
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, tokens)
    w_hi, w_lo = split_bf16(w)
    with fp32_precision("bf16"):
        bf16_w = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
        hi_w = torch.ops.mkldnn._reorder_linear_weight(w_hi, tokens)
        lo_w = torch.ops.mkldnn._reorder_linear_weight(w_lo, tokens)
        cat_w = torch.ops.mkldnn._reorder_linear_weight(torch.cat([w_hi, w_lo, w_hi], 1), tokens)

    def bf16(x):
        with fp32_precision("bf16"):
            return onednn_linear(x, bf16_w)

    def bf16x3(x):
        x_hi, x_lo = split_bf16(x)
        with fp32_precision("bf16"):
            y = onednn_linear(x_hi, hi_w)
            y += onednn_linear(x_hi, lo_w)
            y += onednn_linear(x_lo, hi_w)
        return y

    def bf16x3_cat(x):
        x_hi, x_lo = split_bf16(x)
        with fp32_precision("bf16"):
            return onednn_linear(torch.cat([x_hi, x_hi, x_lo], 1), cat_w)

    return {
        "fp32": lambda x: x @ w.T,
        "fp32-packed": lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, w, None, tokens),
        "bf16": bf16,
        "bf16x3": bf16x3,
        "bf16x3-cat": bf16x3_cat,
    }


def best_ms(fn, x, reps: int) -> float:
    fn(x)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = list(paths(torch.zeros(8, 8), 8))
    total = dict.fromkeys(names, 0.0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens\n")
    print("| shape (x uses) | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    errors = dict.fromkeys(names, 0.0)
    for label, (k, n, uses) in SHAPES.items():
        x = torch.randn(args.tokens, k)
        w = torch.randn(n, k) / math.sqrt(k)
        exact = x.double() @ w.double().T
        scale = exact.abs().max().item()
        fns = paths(w, args.tokens)
        for name, fn in fns.items():
            err = (fn(x).double() - exact).abs().max().item() / scale
            errors[name] = max(errors[name], err)
        best = dict.fromkeys(names, math.inf)
        for _ in range(args.rounds):  # alternate, so that machine noise hits every path
            for name, fn in fns.items():
                best[name] = min(best[name], best_ms(fn, x, reps=3 if n > 10000 else 10))
        for name in names:
            total[name] += best[name] * uses
        print(f"| {label} (x{uses}) | " + " | ".join(f"{best[m]:.3f}" for m in names) + " |")
    print("| **one forward** | " + " | ".join(f"**{total[m]:.0f}**" for m in names) + " |")
    print("| speed vs fp32 | " + " | ".join(f"{total['fp32'] / total[m]:.2f}x" for m in names) + " |")
    print("| max error / max abs | " + " | ".join(f"{errors[m]:.1e}" for m in names) + " |")


if __name__ == "__main__":
    main()
