"""``lowbit search``: parse, call :func:`lowbit.planning.search.search` (and ``measure``),
print, write the recipe.  ``lowbit.cli`` calls :func:`register` with its subparsers object."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "cmd_search"]


def cmd_search(args: argparse.Namespace) -> int:
    from ..planning.search import measure, parse_candidates, search
    from ..quantization.recipe import load_recipe
    from ..report import tables as render
    from ..report.search import choices_table, search_table
    from ..util.io import atomic_write_text, refuse_existing
    from . import _bench, _finish

    # every bad input fails here, before the model is loaded
    candidates = parse_candidates(args.candidates)
    algorithms = load_recipe(args.algorithms).algorithms if args.algorithms else None
    if args.score_algorithms and not args.algorithms:
        raise ValueError("--score-algorithms scores the errors of --algorithms' methods; name a "
                         "calibration recipe with --algorithms (e.g. w4a16-gptq-g128)")
    if args.out:
        refuse_existing(Path(args.out), args.force)
    bench = _bench(args, args.model, calib_windows=max(args.calib_windows, args.score_windows))
    result, _ = search(bench, candidates, args.budget_bits, granularity=args.granularity,
                       score_windows=args.score_windows, proxy=args.proxy, algorithms=algorithms,
                       name=Path(args.out).stem if args.out else None, score_algorithms=args.score_algorithms)
    if args.out:
        atomic_write_text(Path(args.out), result.recipe_yaml)
        print(f"recipe written to {args.out}")
    else:
        print(result.recipe_yaml)
    if args.measure:
        measure(bench, result)
    render.print_tables(choices_table(result), search_table([result]))
    print("search: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()))
    _finish(result, args, f"search-{bench.info.name}")
    return 0


def _bits(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits, got {text!r}") from None


def register(subparsers) -> None:
    from . import _eval_options
    from ..planning.scores import PROXIES
    from ..planning.search import GRANULARITIES

    p = subparsers.add_parser("search", help="mixed precision: choose a format per unit under an average-bits budget")
    p.add_argument("model", metavar="MODEL", help="packaged model name, Hugging Face folder, .gguf file or hub id")
    p.add_argument("--budget-bits", type=_bits, required=True,
                   help="average storage bits per weight over the decoder's Linears, scales included")
    p.add_argument("--candidates", required=True,
                   help="comma-separated weight formats: scheme presets (int4-g128, mxfp4, nvfp4, int8-channel, ...) "
                        "or weight-only recipe presets; 16 bits (bf16) is always a candidate")
    p.add_argument("--granularity", choices=GRANULARITIES, default="module",
                   help="unit that gets one format: fused module group per layer (default), decoder layer, module type")
    p.add_argument("--out", metavar="RECIPE.yaml", help="write the chosen mix as a recipe here (refused if it exists)")
    p.add_argument("--algorithms", metavar="RECIPE",
                   help="run this recipe's calibration methods on the mix (e.g. w4a16-gptq-g128: GPTQ)")
    p.add_argument("--score-algorithms", action="store_true",
                   help="score each format by the weight error --algorithms leave (GPTQ, MSE, learned rounding: one "
                        "calibrated quantization per format) instead of min-max rounding's")
    p.add_argument("--score-windows", type=int, default=16,
                   help="calibration windows the Fisher scores are taken on (default 16)")
    p.add_argument("--proxy", choices=PROXIES, default="token", help="which Fisher estimate scores units (default token)")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="quantize the mix and measure it end to end against the prediction (default on)")
    _eval_options(p)
    p.set_defaults(func=cmd_search)
