"""Exact (FP32) ways to run an evaluation forward faster, per window (issue 3).

Each variant runs SmolLM2-135M over the same wiki test windows, one 512-token window per
forward, computing the window's NLL the way lowbit's evaluator does (logits, ``logsumexp``,
gather of the targets); the variants alternate and the best round of each is kept:

* ``full/sdpa``    ``model(ids).logits`` as transformers loads it (SDPA attention) — lowbit's path;
* ``split/sdpa``   the decoder body, then lm_head into one reused logits buffer, one position
                   fewer (no fresh 100 MB logits tensor per window);
* ``*/eager``      transformers' eager attention (matmul, mask, softmax, matmul) instead of SDPA;
* ``*/packed``     every decoder Linear through MKL with its weight packed once
                   (``torch.ops.mkl._mkl_linear``, what inductor's freezing uses);
* ``full/sdpa/bf16-inputs`` — not exact, for scale: every matmul with its inputs rounded to BF16
                   (oneDNN AMX, ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``), FP32
                   accumulation and output.

It prints ms per window, the speed against ``full/sdpa`` and each variant's perplexity.
Run: ``.venv/bin/python benchmarks/eval_variants.py [--threads 1] [--windows 4] [--rounds 3]``
(one thread is what each of the evaluator's worker processes uses).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from lowbit.evaluation.compare import Workbench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench = Workbench.load("smollm2-135m", windows=args.windows, calib_windows=0, progress=False)
    model, windows = bench.model, bench.windows
    head = model.lm_head.weight
    buffers: dict[int, torch.Tensor] = {}

    def nll(logits, ids):
        lse = torch.logsumexp(logits, -1)
        return float((lse - logits.gather(-1, ids[0, 1:, None]).squeeze(-1)).double().sum())

    def full(ids):
        return nll(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), ids)

    def split(ids):
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        out = buffers.get(h.shape[0])
        if out is None:
            out = buffers[h.shape[0]] = torch.empty(h.shape[0], head.shape[0])
        return nll(torch.mm(h, head.T, out=out), ids)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    tokens = windows.shape[1]

    def packed(on: bool):
        for m in linears:
            m.__dict__.pop("forward", None)
            if not on:
                continue
            w = torch.ops.mkl._mkl_reorder_linear_weight(m.weight, tokens)

            def forward(x, m=m, w=w):
                x2 = x.reshape(-1, x.shape[-1])
                if x2.shape[0] == tokens:
                    y = torch.ops.mkl._mkl_linear(x2, w, m.weight, m.bias, tokens)
                else:
                    y = torch.nn.functional.linear(x2, m.weight, m.bias)
                return y.reshape(*x.shape[:-1], y.shape[-1])

            m.forward = forward

    variants = {f"{f}/{attn}{'/packed' if p else ''}": (fn, attn, p, "none")
                for p in (False, True) for attn in ("sdpa", "eager") for f, fn in (("full", full), ("split", split))}
    variants["full/sdpa/bf16-inputs"] = (full, "sdpa", False, "bf16")
    best = dict.fromkeys(variants, math.inf)
    total = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (fn, attn, p, precision) in variants.items():
                model.set_attn_implementation(attn)
                packed(p)
                torch.backends.mkldnn.matmul.fp32_precision = precision
                try:
                    fn(windows[:1])  # warm-up
                    t0 = time.perf_counter()
                    total[name] = sum(fn(windows[i : i + 1]) for i in range(len(windows)))
                    best[name] = min(best[name], time.perf_counter() - t0)
                finally:
                    torch.backends.mkldnn.matmul.fp32_precision = "none"
        packed(False)
    n = len(windows) * (tokens - 1)
    print(f"SmolLM2-135M, {len(windows)} windows x {tokens} tokens, {torch.get_num_threads()} torch threads, "
          f"best of {args.rounds} alternating rounds\n")
    print("| variant | ms / window | vs full/sdpa | perplexity |\n|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {best[name] / len(windows) * 1e3:.0f} | {best['full/sdpa'] / best[name]:.3f}x | "
              f"{math.exp(total[name] / n):.6f} |")


if __name__ == "__main__":
    main()
