"""``lowbit compare --tasks`` / ``lowbit eval --tasks``: benchmark accuracy of each configuration,
paired against the reference model on the same questions.

The reference's per-example scores are computed once per (model, task, rows) and cached as JSON
under ``<cache>/task-references``; each configuration quantizes a copy of the bench's model (as
:meth:`Workbench.run` does) and is scored through :func:`quantized_execution`.  A recipe's
scores are cached too, under ``<cache>/task-rows``, keyed like the row cache
(:mod:`lowbit.evaluation.rowcache`: lowbit's version and source digest, the model, the full
recipe, the calibration windows and seed) plus the task and its rows, so ``lowbit plan
--max-task-drop`` planning again for another GPU scores nothing twice.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch import nn

from .._version import __version__, source_digest
from ..data.tasks import TASKS, Example, load_task, resolve_tasks
from ..quantization.pipeline import quantize
from ..quantization.recipe import Recipe
from ..util.io import atomic_write_text
from .compare import Workbench
from .workbench import _digest, model_fingerprint
from .paired import PairedAccuracy, paired_accuracy
from .generate import generate_examples
from .tasks import TaskResult, outcome, score_examples

__all__ = ["TaskConfig", "TaskRow", "TaskComparison", "task_comparison", "headline_metric", "task_row_path"]

log = logging.getLogger(__name__)

#: bump when scoring changes, so cached reference scores are recomputed
SCORER_VERSION = 1


@dataclass(frozen=True)
class TaskConfig:
    """What to score: the bench's model quantized by ``recipe``, or ``model`` as loaded."""

    label: str
    recipe: Recipe | None = None
    model: nn.Module | None = None


@dataclass(frozen=True)
class TaskRow:
    """One configuration on every task: its scores, and per task and metric the paired
    comparison with the reference (empty for the reference itself)."""

    label: str
    description: str
    results: dict[str, TaskResult]
    paired: dict[str, tuple[PairedAccuracy, ...]]
    quantize_seconds: float = 0.0

    def headline(self, task: str) -> PairedAccuracy | None:
        """The paired comparison of ``task``'s :func:`headline_metric` (``None`` for the reference)."""
        m = headline_metric(task)
        return next((p for p in self.paired.get(task, ()) if p.metric == m), None)

    def headline_drop(self) -> float:
        """Mean over the tasks of the headline accuracy's drop against the reference, in points
        (positive: this configuration answers fewer right; 0 for the reference itself)."""
        pairs = [self.headline(t) for t in self.paired]
        pairs = [p for p in pairs if p is not None]
        return float(sum(-100.0 * p.delta for p in pairs) / len(pairs)) if pairs else 0.0

    def to_dict(self) -> dict:
        return {"label": self.label, "description": self.description, "quantize_seconds": self.quantize_seconds,
                "paired": {t: [p.to_dict() for p in ps] for t, ps in self.paired.items()},
                "metrics": {t: {m: r.metric(m) for m in TASKS[t].metrics} for t, r in self.results.items()},
                "results": {t: r.to_dict() for t, r in self.results.items()}}


@dataclass(frozen=True)
class TaskComparison:
    model: str
    tasks: tuple[str, ...]
    limit: int | None
    seed: int
    examples: dict[str, int]
    rows: tuple[TaskRow, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {"model": self.model, "tasks": list(self.tasks), "limit": self.limit, "seed": self.seed,
                "examples": self.examples, "rows": [r.to_dict() for r in self.rows]}


def _kind(task: str) -> str:
    return TASKS[task].kind


def headline_metric(task: str) -> str:
    """The one accuracy a task is summarised by: ``acc_norm`` where lm-eval reports it (the
    length-normalised score leaderboards quote for ARC-Challenge, HellaSwag, PIQA, ...), else ``acc``;
    for a generative task its first filter (GSM8K: ``strict-match``)."""
    metrics = TASKS[task].metrics
    return next(m for m in ("acc_norm", "acc", *metrics) if m in metrics)


def _indices(examples: list[Example]) -> str:
    return ",".join(str(e.index) for e in examples)


def task_row_path(bench: Workbench, recipe: Recipe, task: str, examples: list[Example], limit: int | None,
                  seed: int) -> Path:
    """Where ``recipe``'s scores on ``task`` (these ``examples``) are, or would be, cached."""
    key = _digest(__version__, source_digest(__name__), model_fingerprint(bench.info), repr(recipe), bench.calib_windows,
                  bench.seed, SCORER_VERSION, task, limit, seed, _indices(examples))
    return bench.cache / "task-rows" / f"{bench.info.name}-{recipe.name}-{task}-{key}.json".replace("/", "_")


def _score(bench: Workbench, model: nn.Module, examples: list[Example], task: str, name: str, state=None,
           share_prefix: bool | None = None) -> TaskResult:
    if _kind(task) == "generate":
        return generate_examples(model, bench.tokenizer, examples, state=state, bos=bench.info.needs_bos, name=name,
                                 progress=bench.progress)
    return score_examples(model, bench.tokenizer, examples, state=state, bos=bench.info.needs_bos, name=name,
                          kind=_kind(task), share_prefix=share_prefix, progress=bench.progress)


def reference_scores(bench: Workbench, task: str, examples: list[Example], limit: int | None, seed: int) -> TaskResult:
    """The bench's model, as loaded, on ``examples`` (cached per model, task and rows)."""
    key = bench._key("tasks", SCORER_VERSION, task, limit, seed, len(examples), _indices(examples))
    path = bench.cache / "task-references" / f"{bench.info.name}-{task}-{key}.json"
    if path.exists():
        return TaskResult.from_dict(json.loads(path.read_text()))
    res = _score(bench, bench.model, examples, task, "reference")
    atomic_write_text(path, json.dumps(res.to_dict()) + "\n")
    return res


def _pair(task: str, ref: TaskResult, res: TaskResult, bootstrap: int, seed: int) -> tuple[PairedAccuracy, ...]:
    out = []
    for metric in TASKS[task].metrics:
        if metric == "perplexity":
            continue
        m = outcome(_kind(task), metric)
        scored = _kind(task) != "generate"  # a choice distribution to compare (not for generated answers)
        out.append(paired_accuracy(metric, [e.correct(m) for e in ref.examples], [e.correct(m) for e in res.examples],
                                   reference_ll=[e.loglik for e in ref.examples] if scored else None,
                                   other_ll=[e.loglik for e in res.examples] if scored else None,
                                   bootstrap=bootstrap, seed=seed))
    return tuple(out)


def _config_results(bench: Workbench, cfg: TaskConfig, examples: dict[str, list[Example]], limit: int | None,
                    seed: int, share_prefix: bool | None) -> tuple[dict[str, TaskResult], float]:
    """``cfg`` scored on every task, and the seconds its quantization took (0 when every
    task's scores came from the cache).  A model given as loaded is never cached: its
    weights are not in any key."""
    paths = {}
    if cfg.recipe is not None and cfg.model is None:
        paths = {t: task_row_path(bench, cfg.recipe, t, ex, limit, seed) for t, ex in examples.items()}
    results = {t: TaskResult.from_dict(json.loads(p.read_text())) for t, p in paths.items() if p.exists()}
    todo = [t for t in examples if t not in results]
    if not todo:
        return results, 0.0
    t0 = time.perf_counter()
    state, model, tq = None, cfg.model if cfg.model is not None else bench.model, 0.0
    if cfg.recipe is not None:
        model = copy.deepcopy(model)
        state = quantize(model, cfg.recipe, bench.calibration, stats=lambda: bench.stats, progress=bench.progress)
        tq = time.perf_counter() - t0
    for t in todo:
        results[t] = _score(bench, model, examples[t], t, cfg.label, state, share_prefix)
        if t in paths:
            atomic_write_text(paths[t], json.dumps(results[t].to_dict()) + "\n")
    return {t: results[t] for t in examples}, tq


def task_comparison(bench: Workbench, configs: list[TaskConfig], tasks: list[str] | str, *, limit: int | None = None,
                    seed: int = 0, bootstrap: int = 1000, share_prefix: bool | None = None,
                    on_row: Callable[[TaskRow], None] | None = None) -> TaskComparison:
    """The reference and each configuration scored on ``tasks`` (the first ``limit`` rows of
    each; MMLU a seeded stratified subset), paired against the reference per task."""
    names = resolve_tasks(tasks)
    examples = {t: load_task(t, limit=limit, seed=seed, cache=bench.cache) for t in names}
    t0 = time.perf_counter()
    ref = {t: reference_scores(bench, t, ex, limit, seed) for t, ex in examples.items()}
    bench.stage_seconds["tasks reference"] = time.perf_counter() - t0
    rows = [TaskRow("reference", "unquantized", ref, {})]
    if on_row:
        on_row(rows[0])
    for cfg in configs:
        t0 = time.perf_counter()
        results, tq = _config_results(bench, cfg, examples, limit, seed, share_prefix)
        paired = {t: _pair(t, ref[t], r, bootstrap, seed) for t, r in results.items()}
        desc = cfg.recipe.description if cfg.recipe is not None else "as loaded"
        rows.append(TaskRow(cfg.label, desc, results, paired, tq))
        bench.stage_seconds[f"tasks {cfg.label}"] = time.perf_counter() - t0
        if on_row:
            on_row(rows[-1])
    return TaskComparison(bench.info.name, tuple(names), limit, seed, {t: len(e) for t, e in examples.items()},
                          tuple(rows))
