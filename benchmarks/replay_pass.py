"""What a layer pass by replay costs with and without handing back quantized children, side by side
in one run (issue 18).

Quantizes a copy of the model with a GPTQ recipe run by replay (``algorithms.recompute``; default
int4 g128 asymmetric) through the layer-by-layer pipeline and stops after ``--layers`` decoder
layers, timing ``LayerPass.layer_pass`` only.  Variants, in the order given (repeat one to see the
noise):

- ``rerun``: every round runs every chunk from the layer's input (``FrozenChildren.enabled`` off);
- ``kept``: a child whose Linears are all quantized (the attention, once q/k/v/o are) hands back
  its output from the round that ran it in full (:mod:`lowbit.quantization.replaycache`, the default).

``--outputs`` times passes that also make the layer's outputs (GPTQ without learned rounding: one
round more); without it the pass stops once every group is quantized, as under ``round_opt``.
Every variant must give the same weights (the script compares them and says so).

    PYTHONPATH=src .venv/bin/python benchmarks/replay_pass.py --model gemma3-270m --layers 4 \\
        --variants rerun,kept,rerun,kept
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
from lowbit.quantization import layerpass  # noqa: E402
from lowbit.quantization.pipeline import quantize  # noqa: E402
from lowbit.quantization.recipe import recipe_from_dict  # noqa: E402
from lowbit.quantization.replaycache import FrozenChildren  # noqa: E402
from awq_balance import _Enough, layer_weights, same_weights  # noqa: E402  (this script's folder is on sys.path)

VARIANTS = ("rerun", "kept")


def run(bench: Workbench, recipe, variant: str, layers: int, outputs: bool) -> tuple[float, dict[str, torch.Tensor]]:
    real = layerpass.LayerPass.layer_pass
    seconds, calls = [0.0], [0]
    model = copy.deepcopy(bench.model)

    def timed(self, i, layer, inputs, kwargs, lnames, leader, outputs=True, want=outputs):
        calls[0] += 1
        if calls[0] > layers:
            raise _Enough
        t = time.perf_counter()
        out = real(self, i, layer, inputs, kwargs, lnames, leader, outputs and want)
        seconds[0] += time.perf_counter() - t
        if out[0] is None:  # the pass stopped once every group was quantized: the next layer needs inputs
            with torch.no_grad():
                out = ([(lambda o: o[0] if isinstance(o, tuple) else o)(layer(x, **kwargs)) for x in inputs], out[1])
        return out

    layerpass.LayerPass.layer_pass = timed
    FrozenChildren.enabled = variant == "kept"
    try:
        quantize(model, recipe, bench.calibration, stats=lambda: bench.stats, progress=False)
    except _Enough:
        pass
    finally:
        layerpass.LayerPass.layer_pass = real
        FrozenChildren.enabled = True
    return seconds[0], layer_weights(model, layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers to pass (from the first)")
    ap.add_argument("--scheme", default="int4-g128-asym")
    ap.add_argument("--outputs", action="store_true", help="passes that make the layer's outputs too")
    ap.add_argument("--variants", default="rerun,kept,rerun,kept")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    bench = Workbench.load(a.model, windows=1, calib_windows=a.calib_windows, progress=False)
    recipe = recipe_from_dict({"name": f"gptq-{a.scheme}", "weights": a.scheme,
                               "algorithms": {"gptq": {}, "recompute": True, "batch": 4}})
    rows, first = [], None
    for v in variants:
        secs, weights = run(bench, recipe, v, a.layers, a.outputs)
        if first is None:
            first = (secs, weights)
        same = same_weights(weights, first[1])
        rows.append({"variant": v, "seconds": secs, "speedup": first[0] / secs, "same_weights": same})
        print(f"{v:6s} {secs:7.2f} s for {a.layers} layer passes  x{first[0] / secs:5.2f} vs {variants[0]}  "
              f"weights {'identical' if same else 'DIFFERENT'} to the first", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"model": a.model, "calib_windows": a.calib_windows, "layers": a.layers,
                                      "scheme": a.scheme, "outputs": a.outputs,
                                      "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
