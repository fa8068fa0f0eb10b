"""The Fisher proxy of lowbit search against the measured single-unit KL on a real model, on a
few random units (a smaller, standalone version of search_curve.py's validation):

    nice -n 10 env PYTHONPATH=src python benchmarks/search_proxy_check.py --json benchmarks/results/search-proxy-smollm2-2026-12-01.json
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from lowbit.evaluation.workbench import Workbench
from lowbit.planning.scores import PROXIES, fisher_scores, rank_correlation, unit_kl
from lowbit.planning.search import parse_candidates, units_of
from lowbit.util.io import write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--score-windows", type=int, default=3)
    ap.add_argument("--windows", type=int, default=2, help="evaluation windows of each single-unit KL")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    (cand, _) = parse_candidates(args.format)
    bench = Workbench.load(args.model, windows=args.windows, calib_windows=16, progress=False)
    bench.reference
    units = units_of(bench.model)
    picked = random.Random(0).sample(units, args.units)
    names = [n for u in picked for n in u.modules]
    t0 = time.perf_counter()
    sc = fisher_scores(bench.model, names, [cand.scheme], bench.calib_windows[: args.score_windows], progress=False)
    out = {"model": args.model, "format": cand.name, "score_windows": args.score_windows, "kl_windows": args.windows,
           "score_seconds": time.perf_counter() - t0, "load_average_start": os.getloadavg(), "pairs": []}
    for u in picked:
        kl = unit_kl(bench, list(u.modules), cand.scheme, args.windows)
        out["pairs"].append({"unit": u.name, "measured_kl": kl,
                             **{p: float(sum(sc.values[p][n][0] for n in u.modules)) for p in PROXIES}})
        print(out["pairs"][-1], flush=True)
        write_json(Path(args.json), out, force=True)
    meas = [p["measured_kl"] for p in out["pairs"]]
    out["spearman"] = {p: rank_correlation(meas, [x[p] for x in out["pairs"]]) for p in PROXIES}
    out["sum_ratio_predicted_over_measured"] = {p: sum(x[p] for x in out["pairs"]) / sum(meas) for p in PROXIES}
    out["load_average_end"] = os.getloadavg()
    print(out["spearman"], out["sum_ratio_predicted_over_measured"], flush=True)
    write_json(Path(args.json), out, force=True)


if __name__ == "__main__":
    main()
