"""What one learned-rounding step costs, and what it buys, side by side in one run (issue 18).

One real decoder layer (default: SmolLM2-135M layer 10) with its float inputs from the
calibration windows, int4 g64 symmetric round-to-nearest as the start, the float layer's outputs
as targets (``--scheme``: another weight scheme, e.g. ``int4-g64-asym``).  For each configuration
(torch threads × windows per step × compute dtype, and the fused or generic integer rounding) the same
``optimize_rounding`` runs for the same number of *window passes* (steps × batch); the script prints
seconds per window pass, the ratio to the first configuration, and the block-output MSE reached on
the training windows in fp32 (relative to the start), so a faster setting that trains worse shows it.

    PYTHONPATH=src .venv/bin/python benchmarks/roundopt_step.py --passes 64 --json out.json
    PYTHONPATH=src .venv/bin/python benchmarks/roundopt_step.py --windows 64 --passes 320 \
        --configs 2:4:bf16:generic,2:4:bf16,2:4:bf16:generic,2:4:bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.evaluation.workbench import Workbench  # noqa: E402
from lowbit.models.arch import decoder_layers  # noqa: E402
from lowbit.numerics.qtensor import dequantize, quantize  # noqa: E402
from lowbit.numerics.scheme import PRESETS  # noqa: E402
from lowbit.quantization.algorithms import LearnedRounding, optimize_rounding  # noqa: E402
from lowbit.quantization.layerwise import capture_inputs  # noqa: E402


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--scheme", default="int4-g64")
    ap.add_argument("--windows", type=int, default=16, help="training windows (x 512 tokens)")
    ap.add_argument("--passes", type=int, default=64, help="window passes per configuration (steps x batch)")
    ap.add_argument("--configs", default="1:1:fp32,2:1:fp32,1:8:fp32,2:8:fp32,2:8:bf16",
                    help="threads:batch:dtype[:generic], comma-separated; the first is the ratio's base; "
                         "':generic' turns off the fused integer rounding (LearnedRounding.use_fused)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    bench = Workbench.load(args.model, windows=1, calib_windows=args.windows, progress=False)
    model = bench.model
    layers = decoder_layers(model)
    with torch.no_grad():
        inputs, kwargs = capture_inputs(model, bench.calibration, 1)
        for i in range(args.layer):
            inputs = [_out(layers[i](x, **kwargs[i])) for x in inputs]
        layer, kw = layers[args.layer], kwargs[args.layer]
        targets = [_out(layer(x, **kw)) for x in inputs]
    names = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    weights = {n: layer.get_submodule(n).weight.detach().clone() for n in names}
    scheme = PRESETS[args.scheme]
    inits = {n: quantize(w, scheme) for n, w in weights.items()}
    for p in layer.parameters():
        p.requires_grad_(False)
    x_all, t_all = torch.cat(inputs), torch.cat(targets)

    def fp32_forward(ws, x):
        return _out(functional_call(layer, {f"{n}.weight": w for n, w in ws.items()}, (x,), kw))

    with torch.no_grad():
        start = {n: dequantize(q, weights[n].dtype) for n, q in inits.items()}
        loss0 = sum(float(torch.nn.functional.mse_loss(fp32_forward(start, x), t, reduction="sum"))
                    for x, t in zip(inputs, targets)) / t_all.numel()

    rows = []
    for spec in args.configs.split(","):
        threads, batch, dtype, *path = spec.split(":")
        threads, batch = int(threads), int(batch)
        LearnedRounding.use_fused = path != ["generic"]
        steps = max(1, args.passes // batch)
        batches = list(zip(x_all.split(batch), t_all.split(batch)))
        amp = dtype == "bf16"

        def forward(ws, x, amp=amp):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                return _out(functional_call(layer, {f"{n}.weight": w for n, w in ws.items()}, (x,), kw)).float()

        # the loss over every training window is measured at the start and after the last step; time
        # it alone (steps=0) and leave it out, so that the figure is the steps' own
        t0 = time.perf_counter()
        optimize_rounding(forward, weights, inits, batches, steps=0, threads=threads)
        check = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = optimize_rounding(forward, weights, inits, batches, steps=steps, checks=1, threads=threads)
        wall = time.perf_counter() - t0 - 2 * check
        # the result judged in fp32 whatever the training's compute dtype (what is stored is what counts)
        with torch.no_grad():
            final = {n: dequantize(q, weights[n].dtype) for n, q in res.qtensors.items()}
            fp32 = sum(float(torch.nn.functional.mse_loss(fp32_forward(final, x), t, reduction="sum"))
                       for x, t in batches) / t_all.numel()
        row = {"config": spec, "threads": threads, "batch": batch, "dtype": dtype, "fused": LearnedRounding.use_fused,
               "steps": steps,
               "passes": steps * batch, "wall_s": wall, "loss_check_s": check, "s_per_pass": wall / (steps * batch),
               "loss_init_fp32": loss0, "loss_final_fp32": fp32, "rel": fp32 / loss0}
        rows.append(row)
        base = rows[0]["s_per_pass"]
        print(f"{spec:>12}: {steps:4d} steps, {row['s_per_pass']:.4f} s/pass ({base / row['s_per_pass']:.2f}x the "
              f"first), fp32 block-output MSE {loss0:.4g} -> {fp32:.4g} ({row['rel']:.3f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M")},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
