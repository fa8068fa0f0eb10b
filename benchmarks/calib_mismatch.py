"""Calibration-data mismatch (issue 22): calibrate on one corpus, evaluate on each.

For every method and every calibration corpus the model is quantized once, then evaluated on
the test windows of every evaluation corpus against that corpus's cached reference (the same
windows and reference ``lowbit compare --corpus E`` uses). RTN recipes (no calibration data) are
the baseline rows. Each finished cell is written to ``--json`` at once (atomically), so a run
stopped early keeps what it measured.

    PYTHONPATH=src python benchmarks/calib_mismatch.py --model smollm2-135m \\
        --methods w4a16-gptq-g128,w8a8-int8-sq-gptq,w4a16-awq-g128-asym \\
        --baselines w4a16-int4-g128,w8a8-int8,w4a16-int4-g128-asym \\
        --calib wiki,brown,code,wiki+brown+code --eval wiki,brown,code \\
        --calib-windows 64 --windows 64 --json benchmarks/results/calib_mismatch-smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

from lowbit.data import windows as data
from lowbit.evaluation.metrics import evaluate
from lowbit.evaluation.workbench import Workbench
from lowbit.models.loading import load_model
from lowbit.quantization.calibrate import collect_stats
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import load_recipe
from lowbit.quantization.runtime import quantized_execution
from lowbit.util.io import atomic_write_text


def _cell(e: dict, intervals: bool) -> str:
    if not intervals:
        return f"{e['delta_pct']:+.1f}% / {e['kl_mean']:.4f}"
    (dl, dh), (kl, kh) = e["delta_ci"], e["kl_ci"]
    return f"{e['delta_pct']:+.1f}% [{dl:+.1f}, {dh:+.1f}] / {e['kl_mean']:.4f} [{kl:.4f}, {kh:.4f}] / {e['top1']:.3f}"


def _merge(paths: list[Path]) -> tuple[dict, list[str], dict[tuple[str, str], dict[str, dict]]]:
    """Runs of one protocol (refused otherwise): the first run's header, the evaluation corpora, and
    every cell as ``rows[(recipe, calibration corpus)][eval corpus]``, rows in calibration order
    (per recipe in order of first appearance: RTN, then the evaluation corpora's order, mixtures last)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    d = runs[0]
    for r in runs[1:]:
        if (r["model"], r["windows"], r["seq_len"], r["calib_windows"], r["seed"], r["reference"]) != \
                (d["model"], d["windows"], d["seq_len"], d["calib_windows"], d["seed"], d["reference"]):
            raise SystemExit("--table: the files were measured under different protocols")
    evals = list(d["reference"])
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for c in (c for r in runs for c in r["cells"]):
        rows.setdefault((c["recipe"], c["calib"]), {})[c["eval"]] = c["eval_result"]
    recipes = list(dict.fromkeys(r for r, _ in rows))
    rank = lambda c: (c != "none", evals.index(c) if c in evals else len(evals), c)  # noqa: E731
    return d, evals, dict(sorted(rows.items(), key=lambda kv: (recipes.index(kv[0][0]), rank(kv[0][1]))))


def table(paths: list[Path], intervals: bool = False) -> str:
    """The measured cells of ``--json`` files (runs of one protocol) as one markdown table: a row
    per (recipe, calibration corpus), a column per evaluation corpus, each cell ``PPL Δ% / KL``
    (``intervals``: with their 95% bootstrap intervals, and top-1 agreement)."""
    d, evals, rows = _merge(paths)
    head = ["recipe", "calibrated on", *(f"eval {e} (ref PPL {d['reference'][e]['ppl']:.2f})" for e in evals)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (recipe, calib), cells in rows.items():
        vals = [_cell(cells[e], intervals) if e in cells else "—" for e in evals]
        lines.append(f"| {recipe} | {'— (RTN)' if calib == 'none' else calib} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def shares(paths: list[Path], pairs: dict[str, str]) -> str:
    """Per calibrated recipe (``pairs``: recipe → its RTN baseline) and evaluation corpus, the share of
    the baseline's KL each calibration corpus removes, ``1 − KL / KL_RTN``, and (in parentheses) the KL
    relative to the calibration on the evaluation corpus itself, which is in bold."""
    _, evals, rows = _merge(paths)
    calibs = list(dict.fromkeys(c for r, c in rows if r in pairs))
    lines = ["| method | eval | " + " | ".join(calibs) + " |", "|" + "---|" * (len(calibs) + 2)]
    for recipe, base in pairs.items():
        for i, e in enumerate(evals):
            rtn = rows.get((base, "none"), {}).get(e)
            own = rows.get((recipe, e), {}).get(e)
            vals = []
            for c in calibs:
                cell = rows.get((recipe, c), {}).get(e)
                if cell is None or rtn is None:
                    vals.append("—")
                    continue
                share = f"{1 - cell['kl_mean'] / rtn['kl_mean']:.0%}"
                vals.append(f"**{share}**" if c == e else
                            f"{share} ({cell['kl_mean'] / own['kl_mean']:.2f}×)" if own else share)
            lines.append(f"| {recipe if i == 0 else ''} | {e} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", metavar="JSON", type=Path, nargs="+",
                   help="print the markdown table of finished --json files (one protocol) and exit")
    p.add_argument("--intervals", action="store_true", help="with --table: 95%% intervals and top-1 too")
    p.add_argument("--shares", metavar="RECIPE=RTN,...",
                   help="with --table: instead, the share of each RTN baseline's KL each calibration removes")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", help="calibrated recipes, comma-separated")
    p.add_argument("--baselines", default="", help="one recipe without calibration data (RTN) per method, in order")
    p.add_argument("--calib", default="wiki,brown,code,wiki+brown+code")
    p.add_argument("--eval", default="wiki,brown,code")
    p.add_argument("--calib-windows", type=int, default=128)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    if args.shares and not args.table:
        p.error("--shares needs --table")
    if args.table:
        pairs = [x.split("=") for x in args.shares.split(",")] if args.shares else []
        if any(len(x) != 2 or not all(x) for x in pairs):
            p.error(f"--shares: expected RECIPE=RTN_BASELINE entries, comma-separated, got {args.shares!r}")
        print(shares(args.table, dict(pairs)) if pairs else table(args.table, args.intervals))
        return
    if not args.methods or not args.json:
        p.error("--methods and --json are needed to measure")
    out = Path(args.json)
    if out.exists() and not args.force:
        raise SystemExit(f"{out} exists; pass --force to overwrite it")

    loaded = load_model(args.model)
    shared = lambda name, cache=None: loaded  # noqa: E731  one model in memory for every bench
    evals = args.eval.split(",")
    benches = {e: Workbench.load(args.model, corpus=e, windows=args.windows, seq_len=args.seq_len, calib_windows=0,
                                 seed=args.seed, loader=shared, progress=False) for e in evals}
    model, tok, info = loaded
    bos = tok.bos_token_id if info.needs_bos else None
    result = {"model": info.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "PYTHONPATH=src python benchmarks/calib_mismatch.py " + " ".join(
                  f"{k} {v}" for k, v in (("--model", args.model), ("--methods", args.methods),
                                          ("--baselines", args.baselines), ("--calib", args.calib),
                                          ("--eval", args.eval), ("--calib-windows", args.calib_windows),
                                          ("--windows", args.windows), ("--json", args.json))),
              "load_average_start": os.getloadavg(), "windows": args.windows, "seq_len": args.seq_len,
              "calib_windows": args.calib_windows, "seed": args.seed, "reference": {}, "cells": []}
    for e, b in benches.items():
        ref = b.reference_row().eval
        result["reference"][e] = {"ppl": ref.ppl, "tokens": ref.tokens}
        print(f"reference on {e}: ppl {ref.ppl:.3f}", flush=True)

    def save():
        atomic_write_text(out, json.dumps(result, indent=2) + "\n")

    def cell(recipe_name: str, calib_name: str | None) -> None:
        recipe = load_recipe(recipe_name)
        calib = (data.calibration_for(tok, calib_name, args.calib_windows, args.seq_len, args.seed, bos)
                 if calib_name else None)
        q = copy.deepcopy(model)
        t0 = time.perf_counter()
        state = quantize(q, recipe, calib, stats=lambda: collect_stats(copy.deepcopy(model), calib, progress=False),
                         progress=False)
        tq = time.perf_counter() - t0
        with quantized_execution(q, state) as fwd:
            for e, b in benches.items():
                t1 = time.perf_counter()
                ev = evaluate(fwd, b.windows, b.reference, name=recipe.name, seed=args.seed, progress=False)
                result["cells"].append({"recipe": recipe.name, "calib": calib_name or "none", "eval": e,
                                        "eval_result": ev.to_dict(), "quantize_seconds": tq,
                                        "eval_seconds": time.perf_counter() - t1, "load_average": os.getloadavg()})
                save()
                print(f"{recipe.name:<22} calib {calib_name or 'none':<16} eval {e:<6} ppl {ev.ppl:8.3f} "
                      f"({ev.delta_pct:+6.2f}%) KL {ev.kl_mean:.4f} top-1 {ev.top1:.3f}  quantize {tq:.0f} s "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)

    methods = args.methods.split(",")
    baselines = [b for b in args.baselines.split(",") if b]
    if baselines and len(baselines) != len(methods):
        raise SystemExit("--baselines: one RTN recipe per method, in the same order")
    for i, m in enumerate(methods):  # each method's baseline first: a family's rows complete together
        if baselines:
            cell(baselines[i], None)
        for c in args.calib.split(","):
            cell(m, c)
    result["load_average_end"] = os.getloadavg()
    save()


if __name__ == "__main__":
    main()
