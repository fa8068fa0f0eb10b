"""The ``long-context`` subcommand: perplexity and KL by position bucket for KV-cache recipes
(:func:`lowbit.evaluation.longctx.long_context`).

``lowbit.cli`` calls :func:`register` with its subparsers object.
"""

from __future__ import annotations

import argparse

__all__ = ["register", "cmd_long_context", "DEFAULT_RECIPES"]

#: FP8 per tensor and per head, KIVI-style INT4 and INT2
DEFAULT_RECIPES = "kv-fp8,kv-fp8-head,kv-int4-kivi,kv-int4-kivi-r128,kv-int2-kivi,kv-int2-kivi-r128"


def cmd_long_context(args: argparse.Namespace) -> int:
    from ..evaluation.longctx import long_context
    from ..quantization.recipe import load_recipe
    from ..report.tables import long_context_table, print_tables
    from . import _bench, _finish

    recipes = [load_recipe(r.strip()) for r in args.recipes.split(",") if r.strip()]  # bad names fail first
    if not recipes:
        raise ValueError("--recipes: empty list")
    if getattr(args, "loss_on", "all") != "all":
        raise ValueError("--loss-on assistant is not supported by long-context: it scores every position of long "
                         "windows of prose")
    bench = _bench(args, args.model, windows=1)
    res = long_context(bench, recipes, length=args.length, windows=args.long_windows, topk=args.topk)
    print_tables(long_context_table(res))
    _finish(res, args, f"long-context-{bench.info.name}-{args.length}")
    return 0


def register(subparsers) -> None:
    """Add ``long-context`` to the CLI's subparsers."""
    from . import _eval_options

    p = subparsers.add_parser("long-context", help="perplexity and KL by position bucket for KV-cache recipes "
                                                   "on long windows")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"KV recipes (default {DEFAULT_RECIPES})")
    p.add_argument("--length", type=int, default=8192, help="tokens per long window (default 8192)")
    p.add_argument("--long-windows", type=int, default=4, help="long windows (default 4)")
    p.add_argument("--topk", type=int, default=256, help="reference tokens kept per position for KL (default 256)")
    _eval_options(p, windows=None)
    p.set_defaults(func=cmd_long_context)
