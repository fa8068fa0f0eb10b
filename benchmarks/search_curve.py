"""lowbit search on a real model: the Fisher proxy against measured single-unit KL (rank
correlation), the search time, and the curve of measured KL / PPL Δ against average bits
for searched mixes, next to the two common heuristics (and the searched mix at each
heuristic's bits).  Uniform recipes are evaluated by `lowbit compare` (their JSON is cited).

    nice -n 10 env PYTHONPATH=src python benchmarks/search_curve.py --model smollm2-135m \
        --json benchmarks/results/search-smollm2-2026-12-01.json --png benchmarks/results/search-smollm2.png

The JSON is rewritten after every point, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from lowbit.evaluation.workbench import Workbench
from lowbit.planning.scores import PROXIES, rank_correlation, unit_kl
from lowbit.planning.search import heuristic_recipe, measure, parse_candidates, search, units_of
from lowbit.quantization.recipe import load_recipe
from lowbit.util.io import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--candidates", default="int4-g128,mxfp4,nvfp4,int8-channel")
    ap.add_argument("--budgets", default="4.5,4.25,5,6")
    ap.add_argument("--heuristic-base", default="nvfp4")
    ap.add_argument("--heuristic-high", default="int8-channel")
    ap.add_argument("--score-windows", type=int, default=16)
    ap.add_argument("--validate", type=int, default=24, help="(unit, format) pairs measured one at a time (0: none)")
    ap.add_argument("--validate-windows", type=int, default=4)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--uniform", default="", help="uniform recipes to evaluate here too (comma-separated)")
    ap.add_argument("--algorithms", default=None,
                    help="a calibration recipe (preset or YAML) whose methods run on every searched and heuristic mix, "
                         "e.g. w4a16-gptq-g128 for GPTQ; the uniform points name their own recipes")
    ap.add_argument("--json", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--replot", action="store_true", help="only draw --png from the points already in --json")
    args = ap.parse_args()
    if args.replot:
        from lowbit.report.search import plot_curve

        data = json.loads(Path(args.json).read_text())
        print(plot_curve(data["points"], args.png, f"{data['model']}: measured loss against average bits", force=True))
        return

    out: dict = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                 "load_average_start": os.getloadavg(), "points": []}

    def save():
        out["load_average_now"] = os.getloadavg()
        write_json(Path(args.json), out, force=True)

    cands = parse_candidates(args.candidates)
    algorithms = load_recipe(args.algorithms).algorithms if args.algorithms else None
    bench = Workbench.load(args.model, windows=args.windows, calib_windows=max(args.score_windows, 16),
                           progress=True)
    bench.reference  # computed (or read) before any timing
    t0 = time.perf_counter()
    first, scores = search(bench, cands, float(args.budgets.split(",")[0]), score_windows=args.score_windows,
                           algorithms=algorithms)
    out["search_seconds"] = {"scores+solve (wall)": time.perf_counter() - t0, **first.seconds,
                             "load_average": os.getloadavg()}
    print("search", out["search_seconds"], flush=True)
    save()

    def point(kind, label, row, bits, predicted=None, extra=None):
        e = row.eval
        out["points"].append({"kind": kind, "label": label, "bits": bits, "weight_bits_measured": row.weight_bits,
                              "kl": e.kl_mean, "kl_ci": e.kl_ci, "ppl": e.ppl, "ppl_delta": e.delta_pct,
                              "top1": e.top1, "predicted_kl": predicted, "load_average": os.getloadavg(),
                              "eval_seconds": e.seconds, **(extra or {})})
        print(out["points"][-1], flush=True)
        save()

    def searched(budget, label=None):
        res, _ = search(bench, cands, budget, scores=scores, name=label, algorithms=algorithms)
        measure(bench, res)
        point("search", res.recipe.name, res.measured, res.average_bits, res.predicted_kl,
              {"budget": budget, "counts": res.counts(), "recipe_yaml": res.recipe_yaml})
        return res

    budgets = [float(b) for b in args.budgets.split(",")]
    searched(budgets[0])
    for name in [x for x in args.uniform.split(",") if x]:
        row = bench.run(load_recipe(name))
        point("uniform", name, row, row.weight_bits)
    # the proxy against the measured single-unit KL, on random (unit, format) pairs
    units = units_of(bench.model)
    quantized = [c for c in cands if c.scheme is not None]
    rng = random.Random(0)
    pairs = [(rng.randrange(len(units)), rng.randrange(len(quantized))) for _ in range(args.validate)]
    val = []
    t1 = time.perf_counter()
    for ui, ci in pairs:
        u, c = units[ui], quantized[ci]
        kl = unit_kl(bench, list(u.modules), c.scheme, args.validate_windows)
        val.append({"unit": u.name, "format": c.name, "measured_kl": kl,
                    **{p: float(sum(scores.values[p][n][ci] for n in u.modules)) for p in PROXIES}})
        print(val[-1], flush=True)
    if val:
        out["validation"] = {
            "pairs": val, "windows": args.validate_windows, "seconds": time.perf_counter() - t1,
            "spearman": {p: rank_correlation([v["measured_kl"] for v in val], [v[p] for v in val]) for p in PROXIES},
            "sum_ratio_predicted_over_measured": {p: sum(v[p] for v in val) / sum(v["measured_kl"] for v in val)
                                                  for p in PROXIES},
        }
        print("validation", out["validation"]["spearman"], out["validation"]["sum_ratio_predicted_over_measured"], flush=True)
    save()

    base, high = parse_candidates(f"{args.heuristic_base},{args.heuristic_high}")[:2]
    for kind in ("edges", "down"):
        r = heuristic_recipe(bench.model, base, high, kind, algorithms)
        row = bench.run(r)
        point("heuristic", r.name, row, row.weight_bits)
        searched(row.weight_bits, f"search-at-{kind}")
    for b in budgets[1:]:
        searched(b)
    if args.png:
        from lowbit.report.search import plot_curve

        plot_curve(out["points"], args.png, f"{args.model}: measured loss against average bits", force=True)


if __name__ == "__main__":
    main()
