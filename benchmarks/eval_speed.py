"""Evaluation throughput: lowbit's evaluator against a plain transformers loop.

Both run the same model on the same windows (SmolLM2-135M, wiki test split, 512 tokens):

* plain: ``with torch.no_grad(): model(window, labels=window)``, one window per forward,
  perplexity from the returned loss — the loop people write;
* lowbit: ``evaluate(plain_forward(model), windows)``.

The two alternate (plain, lowbit, plain, lowbit, ...) so that machine noise hits both;
the best round of each is reported, with the perplexities to 4 significant digits.
Run: ``.venv/bin/python benchmarks/eval_speed.py [--windows 16] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lowbit.compare import Workbench
from lowbit.evaluate import evaluate
from lowbit.runtime import plain_forward


def plain_loop(model, windows) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            out = model(w[None], labels=w[None])
            nll += out.loss.item() * (len(w) - 1)
            n += len(w) - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bench = Workbench.load(args.model, windows=args.windows, calib_windows=0, progress=False)
    model, windows = bench.model, bench.windows
    tokens = windows.numel()
    best = {"plain": math.inf, "lowbit": math.inf}
    ppl = {}
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        ppl["plain"] = plain_loop(model, windows)
        best["plain"] = min(best["plain"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        ppl["lowbit"] = evaluate(plain_forward(model), windows, progress=False).ppl
        best["lowbit"] = min(best["lowbit"], time.perf_counter() - t0)
    print(f"{args.model}: {len(windows)} windows x {windows.shape[1]} tokens, {torch.get_num_threads()} threads, "
          f"best of {args.rounds} alternating rounds")
    for k in ("plain", "lowbit"):
        print(f"  {k:<7} {best[k]:7.2f} s  {tokens / best[k]:7.0f} tokens/s  perplexity {ppl[k]:.4g}")
    same = format(ppl["plain"], ".4g") == format(ppl["lowbit"], ".4g")
    print(f"  speed-up {best['plain'] / best['lowbit']:.2f}x; perplexities agree to 4 significant digits: {same}")


if __name__ == "__main__":
    main()
