"""What AWQ's balancing stage costs, old way and new way side by side in one run (issue 18).

Quantizes a copy of the model with an AWQ recipe (default: int4 g64 asymmetric, scales only) through
the layer-by-layer pipeline and stops after ``--layers`` decoder layers, timing ``balance_layer``
(the forward that samples each balancing group's inputs, then the scale searches).  Variants, run
in the order given by ``--variants`` (repeat one to see the noise):

- ``direct``: each α judged by computing the group's products on the sampled tokens (the search as
  it was before the Gram form), the MLP run on every token;
- ``gram``: each α judged through the sample's XᵀX, the MLP run on every token;
- ``sampled``: the Gram form, and the MLP run only on the tokens AWQ samples (the default).

Every variant must choose the same scales (the script compares the balanced weights and says so).

    PYTHONPATH=src .venv/bin/python benchmarks/awq_balance.py --layers 6
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.evaluation.workbench import Workbench  # noqa: E402
from lowbit.quantization import algorithms as A  # noqa: E402
from lowbit.quantization import balancing, layerwise  # noqa: E402
from lowbit.quantization.pipeline import quantize  # noqa: E402
from lowbit.quantization.recipe import recipe_from_dict  # noqa: E402

VARIANTS = ("direct", "gram", "sampled")


class _Enough(Exception):
    """Raised once the layers asked for are balanced."""


def _products(x, ws):
    return torch.cat([x @ w.T for w in ws], dim=-1)


def run(bench: Workbench, recipe, variant: str, layers: int) -> tuple[float, dict[str, torch.Tensor]]:
    real_scales, real_balance = A.awq_scales, layerwise.balance_layer
    seconds = [0.0]
    calls = [0]
    model = copy.deepcopy(bench.model)

    def scales(*a, **k):
        return real_scales(*a, **k, out_fn=_products) if variant == "direct" else real_scales(*a, **k)

    def balance(*a, **k):
        calls[0] += 1
        if calls[0] > layers:
            raise _Enough
        t = time.perf_counter()
        real_balance(*a, **k)
        seconds[0] += time.perf_counter() - t

    A.awq_scales, layerwise.balance_layer = scales, balance
    balancing.SAMPLE_MLP = variant == "sampled"
    try:
        quantize(model, recipe, bench.calibration, stats=lambda: bench.stats, progress=False)
    except _Enough:
        pass
    finally:
        A.awq_scales, layerwise.balance_layer = real_scales, real_balance
        balancing.SAMPLE_MLP = True
    return seconds[0], layer_weights(model, layers)


def layer_weights(model, layers: int) -> dict[str, torch.Tensor]:
    """Copies of the parameters of the first ``layers`` decoder layers."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if any(f".layers.{i}." in n for i in range(layers))}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(w, b[n]) for n, w in a.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6, help="decoder layers to balance (from the first)")
    ap.add_argument("--scheme", default="int4-g64-asym")
    ap.add_argument("--variants", default="direct,gram,sampled")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    bench = Workbench.load(a.model, windows=1, calib_windows=a.calib_windows, progress=False)
    recipe = recipe_from_dict({"name": f"awq-{a.scheme}", "weights": a.scheme, "algorithms": {"awq": {"clip": False}}})
    rows, first = [], None
    for v in variants:
        secs, weights = run(bench, recipe, v, a.layers)
        if first is None:
            first = (secs, weights)
        same = same_weights(weights, first[1])
        close = all(torch.allclose(w, first[1][n], rtol=1e-5, atol=1e-7) for n, w in weights.items())
        rows.append({"variant": v, "seconds": secs, "speedup": first[0] / secs, "same_weights": same,
                     "close_weights": close})
        print(f"{v:8s} {secs:7.2f} s for {a.layers} layers  x{first[0] / secs:5.2f} vs {variants[0]}  "
              f"balanced weights {'identical' if same else ('within 1e-5' if close else 'DIFFERENT')} to the first",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "calib_windows": a.calib_windows, "layers": a.layers,
                                      "scheme": a.scheme, "torch_threads": torch.get_num_threads(), "rows": rows},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
