"""``--tasks`` for ``lowbit eval`` and ``lowbit compare``, and ``lowbit assets fetch tasks``:
parse, call :func:`lowbit.evaluation.task_compare.task_comparison`, render.

``lowbit.cli`` calls :func:`add_options` on both parsers and :func:`run` from both commands.
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["add_options", "run", "fetch"]

ASSET = "tasks"


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", help="comma-separated benchmarks, scored as lm-eval 0.4.13 scores them: arc_easy, "
                                   "arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, sciq, mmlu, lambada")
    p.add_argument("--limit", type=int, default=None,
                   help="the first N rows of each task (MMLU: a seeded subset of N stratified by subject)")
    p.add_argument("--tasks-only", action="store_true", help="with --tasks: skip the perplexity evaluation")


def fetch(cache) -> str:
    from ..data.tasks import fetch_tasks

    return str(fetch_tasks(cache))


class _Merged:
    """The perplexity comparison's JSON with a ``tasks`` key added (either may be absent)."""

    def __init__(self, ppl, tasks):
        self.ppl, self.tasks = ppl, tasks

    def to_dict(self) -> dict:
        d = self.ppl.to_dict() if self.ppl is not None else {}
        d["tasks"] = self.tasks.to_dict()
        return d


def run(args: argparse.Namespace, bench, configs: list[tuple[str, object, object]],
        perplexity: Callable[[], object] | None, stem: str) -> int:
    """Benchmarks (and, unless ``--tasks-only``, the perplexity comparison ``perplexity()``) for
    ``configs``: ``(label, recipe or None, model or None)`` each. Prints the tables and writes
    one JSON file with both (per-example outcomes under ``tasks``)."""
    from ..data.tasks import resolve_tasks
    from ..evaluation.task_compare import TaskConfig, task_comparison
    from ..report import tables as render
    from ..report.tasks import tasks_table
    from . import _finish

    resolve_tasks(args.tasks)  # unknown names fail before any work
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be positive, got {args.limit}")
    ppl = None
    if perplexity is not None and not args.tasks_only:
        ppl = perplexity()
        render.print_tables(render.comparison_table(ppl))
    cmp = task_comparison(bench, [TaskConfig(*c) for c in configs], args.tasks, limit=args.limit, seed=args.seed)
    render.print_tables(tasks_table(cmp), render.stages_table(dict(bench.stage_seconds)))
    if bench.info.reference_note:
        print(f"note: {bench.info.reference_note}")
    _finish(_Merged(ppl, cmp), args, stem)
    return 0
