"""Evaluation throughput: lowbit's evaluator against a plain transformers loop.

Both run the same model on the same windows (SmolLM2-135M, wiki test split, 512 tokens):

* plain: ``with torch.no_grad(): model(window, labels=window)``, one window per forward,
  perplexity from the returned loss — the loop people write;
* lowbit: ``evaluate(plain_forward(model), windows)`` with its default workers (forked
  processes, one torch thread each), and with ``workers=1`` (this process, torch's threads);
* calibration: ``collect_stats`` over the same windows, default workers against one.

They alternate (plain, lowbit, lowbit-1, ...) so that machine noise hits all of them; the
best round of each is reported, with the perplexities to 4 significant digits.
Run: ``.venv/bin/python benchmarks/eval_speed.py [--windows 16] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lowbit.quantization.calibrate import collect_stats
from lowbit.evaluation.compare import Workbench
from lowbit.evaluation.metrics import evaluate
from lowbit.util.parallel import default_workers
from lowbit.quantization.runtime import plain_forward


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
    n_workers = default_workers()
    runs = {
        "plain": lambda: plain_loop(model, windows),
        "lowbit": lambda: evaluate(plain_forward(model), windows, progress=False).ppl,
        "lowbit-1": lambda: evaluate(plain_forward(model), windows, progress=False, workers=1).ppl,
        "calib": lambda: collect_stats(model, windows, progress=False).tokens,
        "calib-1": lambda: collect_stats(model, windows, progress=False, workers=1).tokens,
    }
    best = {k: math.inf for k in runs}
    out = {}
    for _ in range(args.rounds):
        for k, run in runs.items():
            t0 = time.perf_counter()
            out[k] = run()
            best[k] = min(best[k], time.perf_counter() - t0)
    print(f"{args.model}: {len(windows)} windows x {windows.shape[1]} tokens, torch threads {torch.get_num_threads()}, "
          f"default workers {n_workers}, best of {args.rounds} alternating rounds")
    labels = {"plain": "plain loop", "lowbit": f"lowbit evaluate, {n_workers} workers",
              "lowbit-1": "lowbit evaluate, workers=1", "calib": f"calibration, {n_workers} workers",
              "calib-1": "calibration, workers=1"}
    for k in runs:
        what = f"perplexity {out[k]:.4g}" if not k.startswith("calib") else f"{out[k]} tokens"
        print(f"  {labels[k]:<32} {best[k]:7.2f} s  {tokens / best[k]:7.0f} tokens/s  {what}")
    same = format(out["plain"], ".4g") == format(out["lowbit"], ".4g") == format(out["lowbit-1"], ".4g")
    print(f"  evaluate vs plain loop: {best['plain'] / best['lowbit']:.2f}x (workers=1: "
          f"{best['plain'] / best['lowbit-1']:.2f}x); perplexities agree to 4 significant digits: {same}")
    print(f"  calibration, {n_workers} workers vs 1: {best['calib-1'] / best['calib']:.2f}x")


if __name__ == "__main__":
    main()
