"""The ``plan`` subcommand: parse, call :func:`lowbit.planning.plan`, print, write.

``lowbit.cli`` calls :func:`register` with its subparsers object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

__all__ = ["register", "cmd_plan", "DEFAULT_PLAN_TASKS"]

#: what ``--max-task-drop`` scores when ``--tasks`` is not given: four quick multiple-choice tasks
DEFAULT_PLAN_TASKS = "arc_easy,hellaswag,piqa,winogrande"


def _lengths(args: argparse.Namespace):
    from ..sim.workload import Lengths, lengths_from_file

    if args.lengths_file:
        pairs = lengths_from_file(args.lengths_file)
        return (Lengths("values", values=tuple(p for p, _ in pairs)),
                Lengths("values", values=tuple(o for _, o in pairs)), pairs)
    return Lengths.parse(args.prompt), Lengths.parse(args.output), ()


def _budget(args: argparse.Namespace):
    from ..planning import Budget

    if args.max_task_drop is not None:
        return Budget.max_task_drop(args.max_task_drop)
    if args.max_kl is not None:
        return Budget.max_kl(args.max_kl)
    return Budget.max_loss(args.max_loss)


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--seeds: expected comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds: empty list")
    return seeds


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..planning import Load, Target, default_candidates, parse_candidate, plan
    from ..report import plan as render
    from ..sim.hardware import load_hardware
    from ..sim.metrics import SLO
    from ..sim.shapes import get_model
    from . import _bench

    t0 = time.perf_counter()
    # every bad input fails here, before the model is loaded
    gpu = load_hardware().gpu(args.gpu)
    budget = _budget(args)
    tasks = args.tasks or (DEFAULT_PLAN_TASKS if budget.metric == "task" else None)
    if tasks:
        from ..data.tasks import resolve_tasks

        resolve_tasks(tasks)  # unknown names fail before any work
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be positive, got {args.limit}")
    cands = ([parse_candidate(x) for x in args.recipes.split(",") if x.strip()] if args.recipes
             else default_candidates(gpu))
    if not cands:
        raise ValueError("--recipes: empty list")
    if args.serve_as:
        get_model(args.serve_as)
    for path in (args.report, args.json):
        if path and Path(path).exists() and not args.force:
            raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    prompt, output, pairs = _lengths(args)
    slo = SLO(ttft=args.ttft / 1e3 if args.ttft else None, tpot=args.tpot / 1e3 if args.tpot else None,
              percentile=args.percentile)
    load = Load(prompt, output, slo, n_requests=args.requests, seeds=_seeds(args.seeds), pairs=pairs)

    bench = _bench(args, args.model)
    target = Target.of(args.gpu, args.tp, bench.info.path, args.serve_as, name=bench.info.name)
    recipe_dir = str(Path(args.report) / "recipes") if args.report else "."
    result = plan(bench, cands, target, load, budget, model_arg=args.model, curves=8 if args.report else 0,
                  progress=not args.no_progress, measure_all=args.measure_all, recipe_dir=recipe_dir,
                  tasks=tasks, task_limit=args.limit)
    con = Console(width=None if Console().is_terminal else 220)
    con.print(render.plan_table(result))
    for line in render.recommendation_lines(result):
        con.print(line, markup=False, highlight=False)
    for c in result.commands:
        if c.recipe_yaml and not args.report:
            con.print(f"recipe {c.recipe_file} (save it there first):\n{c.recipe_yaml}", markup=False, highlight=False)
    from ..models.assets import cache_dir
    from ..util.io import atomic_write_text

    out = Path(args.json) if args.json else \
        cache_dir(args.cache) / "results" / f"plan-{bench.info.name}-{args.gpu}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_text(out, json.dumps(result.to_dict(), indent=2, default=float) + "\n")
    con.print(f"results written to {out}", markup=False)
    if args.report:
        folder = render.write_report(result, args.report, force=args.force)
        con.print(f"report written to {folder}/index.md", markup=False)
    cached = sum(1 for o in result.options if o.capacity.cached)
    con.print(f"planned {len(result.options)} candidates in {time.perf_counter() - t0:.1f} s "
              f"({cached} simulations read from the cache)", markup=False, highlight=False)
    return 0


def register(subparsers) -> None:
    """Add ``plan`` to the CLI's subparsers."""
    from . import _eval_options

    p = subparsers.add_parser(
        "plan", help="accuracy, memory and capacity per candidate recipe, side by side, and a recommendation")
    p.add_argument("model", metavar="MODEL", help="model whose accuracy is measured (packaged name, HF folder, ...)")
    p.add_argument("--gpu", required=True, help="GPU key of the table (h100, h200, a100, b200, l40s, ...)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--serve-as", metavar="CONFIG",
                   help="plan capacity for this model instead (a built-in name such as llama-3.1-8b, or a "
                        "config.json path); accuracy is still measured on MODEL")
    p.add_argument("--recipes", help="comma-separated candidates: presets, YAML files, bf16, any of them +kv-fp8 "
                                     "(default: what the GPU runs natively plus weight-only, with and without FP8 KV)")
    p.add_argument("--prompt", default="1024", help="prompt tokens: N or LOW:HIGH (default 1024)")
    p.add_argument("--output", default="256", help="output tokens: N or LOW:HIGH (default 256)")
    p.add_argument("--lengths-file", help="(prompt, output) pairs: JSON list or CSV; overrides --prompt/--output")
    p.add_argument("--ttft", type=float, default=1000.0, help="TTFT target, ms (default 1000; 0: none)")
    p.add_argument("--tpot", type=float, default=40.0, help="TPOT target, ms (default 40; 0: none)")
    p.add_argument("--percentile", type=float, default=99.0, help="SLO percentile (default 99)")
    p.add_argument("--requests", type=int, default=2000, help="requests per simulation (default 2000)")
    p.add_argument("--seeds", default="0,1,2", help="simulation seeds; the max rate is a range over them")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--max-loss", default="2%", help="accuracy budget: perplexity increase, e.g. 2%% (default)")
    b.add_argument("--max-kl", help="accuracy budget: mean KL divergence per token, e.g. 0.02")
    b.add_argument("--max-task-drop", metavar="PTS",
                   help="accuracy budget: mean benchmark accuracy drop in points (acc_norm where the task has it); "
                        f"scores --tasks (default {DEFAULT_PLAN_TASKS})")
    p.add_argument("--tasks", help="also score every candidate on these benchmarks (comma-separated, as "
                                   "`lowbit compare --tasks`); cached per recipe and task")
    p.add_argument("--limit", type=int, default=None, help="with --tasks: the first N rows of each task")
    p.add_argument("--report", metavar="DIR", help="write a folder: index.md, plan.json, pareto.png, latency.png")
    p.add_argument("--measure-all", action="store_true",
                   help="also measure the FP8-KV variant of a candidate whose whole interval is over the budget")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _eval_options(p)
    p.set_defaults(func=cmd_plan)
