"""The k-quant least-squares search (``lowbit.numerics.ggml_search``) against min-max rounding, in one run.

Prints, for Q4_K / Q5_K / Q6_K / Q3_K / IQ4_NL: the squared error of the search relative to min-max on Gaussian weights;
the fraction of elements given back when lowbit's own output is rounded again (idempotence); over every
Q4_K and Q6_K tensor of the published Gemma-3-270m GGUF (dequantized, then re-quantized by lowbit): the
super-blocks that come back byte for byte, the relative error, the values that differ, and min-max's error
on the same weights; and the time of one 576 × 256 observation (what GPTQ observes per super-block column
group of a SmolLM2 matrix) by the search and by min-max, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/kquant_search.py
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lowbit.models.assets import source_gguf  # noqa: E402
from lowbit.numerics import ggml as G  # noqa: E402
from lowbit.numerics.ggml_pack import pack  # noqa: E402
from lowbit.numerics.ggml_search import rtn_params  # noqa: E402
from lowbit.numerics.qtensor import fake_quantize, quantize  # noqa: E402
from lowbit.numerics.scheme import PRESETS  # noqa: E402


def _rounded(m, t, params):
    return G.dequantize_values(G.element_values(m, t, params[0], params[1]), t, params[0], params[1])


def _rel(a, b) -> float:
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def _gaussian(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 2048, generator=torch.Generator().manual_seed(seed)) * 0.02


def _ms(f, n: int = 20) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    import gguf

    for name in ("q4_k", "q5_k", "q6_k", "q3_k", "iq4_nl"):
        t, scheme = G.get_type(name), PRESETS[f"gguf-{name}"]
        m = _gaussian(64, 1)
        ratio = _rel(_rounded(m, t, rtn_params(m, t)), m) / _rel(_rounded(m, t, G.minmax_params(m, t)), m)
        back = []
        for seed in range(5):
            w = fake_quantize(_gaussian(16, seed), scheme)
            back.append(float((fake_quantize(w, scheme) == w).float().mean()))
        print(f"{name}: squared error {ratio:.3f}x min-max's (64 x 2048, seed 1); given back "
              f"{min(back):.4f}-{max(back):.4f} of elements (16 x 2048, seeds 0-4)")
    stats = defaultdict(list)
    for x in gguf.GGUFReader(source_gguf("gemma3-270m")).tensors:
        if x.tensor_type.name not in ("Q4_K", "Q6_K"):
            continue
        name = x.tensor_type.name.lower()
        t, raw = G.get_type(name), np.asarray(x.data)
        w = gguf.quants.dequantize(raw, x.tensor_type)
        W = torch.from_numpy(np.ascontiguousarray(w)).float()
        qt = quantize(W, PRESETS[f"gguf-{name}"])
        mine = pack(qt.values(), t, qt.scale, qt.zero, qt.super_scale, qt.super_min).numpy()
        back = gguf.quants.dequantize(mine, x.tensor_type)
        same = (mine.reshape(-1, t.type_size) == raw.reshape(-1, t.type_size)).all(axis=1).mean()
        stats[name].append((same, _rel(torch.from_numpy(back), torch.from_numpy(w)), float((back != w).mean()),
                            _rel(_rounded(W, t, G.minmax_params(W, t)), W)))
    for name, rows in stats.items():
        a = np.array(rows)
        print(f"published Gemma-3-270m {name} x{len(rows)}: super-blocks byte-identical >= {a[:, 0].min():.4f}, "
              f"relative error <= {a[:, 1].max():.2e}, values differing <= {a[:, 2].max():.5f} "
              f"(mean {a[:, 2].mean():.5f}); min-max's relative error median {np.median(a[:, 3]):.2e}")
    m, t = torch.randn(576, 256, generator=torch.Generator().manual_seed(0)) * 0.02, G.get_type("q4_k")
    search, minmax = _ms(lambda: rtn_params(m, t)), _ms(lambda: G.minmax_params(m, t))
    print(f"one 576 x 256 q4_k observation: search {search:.1f} ms, min-max {minmax:.2f} ms ({search / minmax:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
