"""How far float noise carries through llama.cpp's 8-bit activation rounding (issue 23).

lowbit's prediction of a GGUF file can round each Linear's input as llama.cpp's CPU backend
does (``lowbit.engines.llama_cpp.engine_activations``).  This script measures, on lowbit's side
alone, what that rounding does with float noise: the same forward twice, once with the inputs of
every rounding multiplied by ``1 + eps·N(0, 1)`` (``eps`` = 1e-7, a few fp32 ulps), and reports
KL(modelled ‖ modelled with noise) beside KL(modelled ‖ weights only).  If the first is as large
as the second, two implementations of the same arithmetic that sum floats in different orders
(lowbit's fp32 matmuls and llama.cpp's integer-block dot products) cannot agree token by token
better than that, whatever the model of the rounding.

    .venv/bin/python benchmarks/gguf_activation_noise.py out/gguf/lowbit-q4_0.gguf --windows 2
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from lowbit.checkpoint.gguf import read_gguf_weights, tensor_types
from lowbit.data import windows as data
from lowbit.engines import llama_cpp as L
from lowbit.models.loading import load_model
from lowbit.numerics import ggml_act


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eps", type=float, default=1e-7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    model, tok, info = load_model(a.model)
    q = copy.deepcopy(model)
    sd = q.state_dict()
    for k, v in read_gguf_weights(a.gguf, model.config).items():
        sd[k].copy_(v)
    types = tensor_types(a.gguf, model.config)
    wins = data.windows_for(tok, "wiki", "test", seq_len=a.seq_len, n_windows=a.windows,
                            bos_token_id=model.config.bos_token_id if info.needs_bos else None)
    g = torch.Generator().manual_seed(0)
    exact = ggml_act.round_activations

    def noisy(x, kind):
        return exact(x * (1 + a.eps * torch.randn(x.shape, generator=g)), kind)

    def logp(rounding):
        L.round_activations = rounding  # engine_activations' hooks look the name up in that module
        try:
            with torch.no_grad(), L.engine_activations(q, types):
                return [torch.log_softmax(q(w[None]).logits[0].double(), -1) for w in wins]
        finally:
            L.round_activations = exact

    act, act_noisy = logp(exact), logp(noisy)
    with torch.no_grad():
        plain = [torch.log_softmax(q(w[None]).logits[0].double(), -1) for w in wins]

    def kl(p, r):
        return float(torch.cat([(x.exp() * (x - y)).sum(-1) for x, y in zip(p, r)]).mean())

    out = {"file": str(a.gguf), "windows": a.windows, "seq_len": a.seq_len, "eps": a.eps,
           "kl_modelled_vs_noisy": kl(act, act_noisy), "kl_modelled_vs_weights_only": kl(act, plain)}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
