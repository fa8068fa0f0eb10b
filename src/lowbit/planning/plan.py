"""``lowbit plan``: each candidate's measured accuracy (on the bench's model) beside its memory
and capacity (on the target: the model's own config, or a larger sibling's), and the decision.

Accuracy rows come from the row cache that ``lowbit compare`` fills
(:mod:`lowbit.evaluation.rowcache`); simulator results from ``<cache>/sim``
(:mod:`lowbit.planning.capacity`).  Planning again for another GPU or SLO re-simulates only.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..evaluation.compare import Row, Workbench
from ..evaluation.rowcache import cached_row, is_cached
from ..evaluation.task_compare import TaskComparison, TaskConfig, TaskRow, task_comparison
from ..sim.capacity import Curve
from ..sim.engine import EngineConfig
from ..sim.hardware import GPU, Kernels, load_hardware
from ..sim.shapes import ModelShape, get_model, shape_from_config
from ..util.parallel import map_shards
from ..util.progress import staged_progress
from .candidates import Candidate
from .capacity import Capacity, Load, capacity_for, curve_for
from .commands import Commands, ship_commands
from .recommend import Budget, Point, Recommendation, recommend

__all__ = ["Target", "Option", "PlanResult", "plan"]


@dataclass(frozen=True)
class Target:
    """Where the model is to be served: GPU, tensor parallelism, engine, and the model's shape.

    ``served`` names the model capacity is planned for when it is not the measured one
    (``--serve-as``), else ``None``.
    """

    gpu: GPU
    kernels: Kernels
    tp: int
    engine: EngineConfig
    shape: ModelShape
    served: str | None = None

    @classmethod
    def of(cls, gpu: str, tp: int, model_dir: Path | None, serve_as: str | None = None,
           engine: EngineConfig | None = None, hardware: str | Path | None = None, name: str = "model") -> Target:
        """From names: ``gpu`` a key of the GPU table; the shape from ``serve_as`` (a built-in
        name or config.json path) or else ``model_dir/config.json``."""
        hw = load_hardware(hardware)
        g = hw.gpu(gpu)
        if tp < 1:
            raise ValueError(f"--tp must be >= 1, got {tp}")
        if serve_as is not None:
            shape = get_model(serve_as)
        else:
            if model_dir is None or not (Path(model_dir) / "config.json").exists():
                raise FileNotFoundError(f"{model_dir}: no config.json to plan capacity from; use --serve-as")
            shape = shape_from_config(json.loads((Path(model_dir) / "config.json").read_text()), name=name)
        eng = engine if engine is not None else EngineConfig.vllm_defaults(g, tp)
        if eng.tp != tp:
            raise ValueError(f"engine tp ({eng.tp}) differs from tp ({tp})")
        return cls(g, hw.kernels, tp, eng, shape, serve_as)

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.to_dict(), "tp": self.tp, "engine": self.engine.to_dict(),
                "shape": self.shape.to_dict(), "served": self.served}


@dataclass(frozen=True)
class Option:
    """One row of the plan: a candidate, its measured accuracy and its capacity."""

    candidate: Candidate
    accuracy: Row | None  # None: not measured (its base is certainly over the budget)
    capacity: Capacity
    loss: float  # inf when not measured
    within_budget: bool
    tasks: TaskRow | None = None  # benchmark scores, when the plan scored tasks

    @property
    def measured(self) -> bool:
        return self.accuracy is not None

    def point(self, context: int) -> Point:
        c, m = self.capacity, self.capacity.memory
        bits = self.accuracy.weight_bits if self.accuracy else float("nan")
        return Point(self.candidate.name, self.loss, c.fits, c.rate if c.fits else 0.0, c.low_load_tpot,
                     m.weights_per_gpu + m.kv_per_token * context, m.weights_per_gpu, bits,
                     c.plan.lane, c.plan.weight_only, c.plan.kv_bytes, c.binding, m.kv_capacity_tokens)

    def to_dict(self) -> dict:
        return {"candidate": self.candidate.to_dict(), "accuracy": self.accuracy.to_dict() if self.accuracy else None,
                "capacity": self.capacity.to_dict(), "loss": self.loss if self.measured else None,
                "within_budget": self.within_budget,
                "tasks": None if self.tasks is None else {
                    "headline_drop_points": self.tasks.headline_drop(),
                    "paired": {t: [p.to_dict() for p in ps] for t, ps in self.tasks.paired.items()},
                    "metrics": self.tasks.to_dict()["metrics"]}}


@dataclass(frozen=True)
class PlanResult:
    """Everything ``lowbit plan`` found.  ``served_note`` is non-empty when capacity is planned
    for a different model than the one measured, and says so in plain words."""

    model: str
    served_note: str
    target: Target
    load: Load
    budget: Budget
    accuracy_setup: dict
    options: tuple[Option, ...]
    recommendation: Recommendation
    commands: tuple[Commands, ...]
    curves: tuple[Curve, ...] = ()
    notes: tuple[str, ...] = ()
    stage_seconds: dict = field(default_factory=dict)
    tasks: dict | None = None  # {"tasks": [...], "limit": N, "examples": {task: n}} when tasks were scored

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.candidate.name == name)

    def to_dict(self) -> dict:
        return {"model": self.model, "served_note": self.served_note, "target": self.target.to_dict(),
                "load": self.load.to_dict(), "budget": self.budget.to_dict(), "accuracy_setup": self.accuracy_setup,
                "options": [o.to_dict() for o in self.options], "recommendation": self.recommendation.to_dict(),
                "commands": [c.to_dict() for c in self.commands], "curves": [c.to_dict() for c in self.curves],
                "notes": list(self.notes), "stage_seconds": dict(self.stage_seconds), "tasks": self.tasks}


def _accuracy(bench: Workbench, candidates: list[Candidate], budget: Budget, measure_all: bool,
              progress: bool) -> list[Row | None]:
    """Rows in candidate order: bases first, then the KV variants — a variant whose base is
    certainly over the budget (its whole interval above the limit) is left unmeasured
    (``None``) unless ``measure_all`` or its row is cached.  A heuristic, not a bound: an FP8
    KV cache usually adds error (kv-fp8 alone costs SmolLM2 +0.4–0.6%), but on 8 windows
    fp8-dynamic+kv-fp8 measured +2.88% against +3.39% for fp8-dynamic alone (noise)."""
    todo = [c.recipe for c in candidates if c.recipe is not None and not is_cached(bench, c.recipe)]
    if any(r.needs_calibration and not r.algorithms.layerwise for r in todo):
        bench.stats  # calibrate once, up front (as compare does)
    names = {c.name for c in candidates}
    order = sorted(range(len(candidates)), key=lambda i: candidates[i].base in names)
    rows: dict[int, Row | None] = {}
    for i, stage in staged_progress(order, "accuracy", enabled=progress):
        c = candidates[i]
        stage(c.name)
        base = next((rows[j] for j in rows if candidates[j].name == c.base), None)
        if c.recipe is None:
            rows[i] = bench.reference_row()
        elif (base is not None and budget.certainly_over(base.eval) and not measure_all
              and not is_cached(bench, c.recipe)):
            rows[i] = None
        else:
            rows[i] = cached_row(bench, c.recipe)
    return [rows[i] for i in range(len(candidates))]


def _task_rows(bench: Workbench, candidates: list[Candidate], tasks: list[str] | str,
               limit: int | None) -> tuple[list[TaskRow], TaskComparison]:
    """Each candidate's benchmark scores, paired against the reference (the reference's own
    row for the unquantized candidate); cached per recipe and task (``<cache>/task-rows``)."""
    configs = [TaskConfig(c.name, c.recipe) for c in candidates if c.recipe is not None]
    cmp = task_comparison(bench, configs, tasks, limit=limit, seed=bench.seed)
    by_label = {r.label: r for r in cmp.rows}
    return [by_label["reference" if c.recipe is None else c.name] for c in candidates], cmp


def _in_workers(items: list, fn, description: str, progress: bool, workers: int | None) -> list:
    """``[fn(x) for x in items]``, the items shared among forked workers: each simulation is
    single-threaded Python, independent of the others, and writes its own cache file."""
    if not items:
        return []

    def shard(indices, tick) -> list:
        out = []
        for i in indices:
            out.append(fn(items[i]))
            tick()
        return out

    parts = map_shards(shard, len(items), workers=workers, description=description, progress=progress)
    return [x for part in parts for x in part]


def _curve_rates(caps: list[Capacity], points: int) -> tuple[float, ...]:
    top = max((c.max_rate.high for c in caps if c.max_rate is not None), default=0.0)
    return tuple(float(x) for x in np.linspace(0.1, 1.2, points) * top) if top > 0 else ()


def plan(bench: Workbench, candidates: list[Candidate], target: Target, load: Load, budget: Budget, *,
         model_arg: str | None = None, curves: int = 0, progress: bool = True, measure_all: bool = False,
         recipe_dir: str = ".", tasks: list[str] | str | None = None, task_limit: int | None = None) -> PlanResult:
    """Measure (or read) each candidate's accuracy on ``bench``, simulate it on ``target``
    under ``load``, and recommend within ``budget``.

    Args:
        bench: the measured model, its windows and caches.
        candidates: what to consider (see :func:`~lowbit.planning.candidates.default_candidates`).
        model_arg: the model as the user named it, for the commands (default the bench's name).
        curves: latency-curve points per fitting candidate (0: none).
        progress: progress bars on a terminal.
        measure_all: also measure KV variants of candidates certainly over the budget.
        recipe_dir: where the commands expect a non-preset recipe's YAML.
        tasks: benchmarks to score every candidate on (required by a ``task`` budget, whose
            loss is the mean headline-accuracy drop in points); ``task_limit`` rows of each.
    """
    if not candidates:
        raise ValueError("plan needs at least one candidate")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidates repeat: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    rows = _accuracy(bench, candidates, budget, measure_all, progress)
    secs["accuracy"] = time.perf_counter() - t0
    if budget.metric == "task" and not tasks:
        raise ValueError("a task-accuracy budget (--max-task-drop) needs the tasks to score (--tasks)")
    task_rows: list[TaskRow | None] = [None] * len(candidates)
    task_setup = None
    if tasks:
        t0 = time.perf_counter()
        task_rows, cmp = _task_rows(bench, candidates, tasks, task_limit)
        task_setup = {"tasks": list(cmp.tasks), "limit": cmp.limit, "examples": dict(cmp.examples)}
        secs["tasks"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    caps = _in_workers(candidates, lambda c: capacity_for(c.name, c.plan, target.shape, target.gpu, target.kernels,
                                                          target.engine, load, bench.cache),
                       "simulating", progress, bench.workers)
    secs["simulation"] = time.perf_counter() - t0
    if budget.metric == "task":
        loss = [t.headline_drop() for t in task_rows]
    else:
        loss = [math.inf if r is None else budget.loss(r.eval) for r in rows]
    options = tuple(Option(c, r, cap, x, x <= budget.limit, t)
                    for c, r, cap, x, t in zip(candidates, rows, caps, loss, task_rows))
    ctx = load.context
    usable = target.gpu.memory_gib * 2**30 * target.engine.gpu_memory_utilization - target.engine.reserved_gb * 1e9
    rec = recommend([o.point(ctx) for o in options], budget, load.slo.ttft, load.slo.tpot,
                    f"{target.gpu.name} × {target.tp}", usable)
    model = model_arg or bench.info.name
    max_len = max(4096, int(2 ** np.ceil(np.log2(max(ctx, 1)))))
    picks = [n for n in (rec.pick, rec.latency_pick) if n]
    cmds = tuple(ship_commands(next(c for c in candidates if c.name == n), model, target.served, target.tp, max_len,
                               recipe_dir) for n in picks)
    curve_list: list[Curve] = []
    if curves:
        t0 = time.perf_counter()
        rates = _curve_rates(caps, curves)
        fitting = [c for c, cap in zip(candidates, caps) if cap.fits] if rates else []
        curve_list = _in_workers(fitting, lambda c: curve_for(c.name, c.plan, target.shape, target.gpu, target.kernels,
                                                              target.engine, load, rates, bench.cache),
                                 "latency curves", progress, bench.workers)
        secs["latency curves"] = time.perf_counter() - t0
    served_note = ""
    if target.served is not None:
        served_note = (f"Accuracy was measured on {bench.info.name}; memory and capacity are planned for "
                       f"{target.shape.name} ({target.shape.params / 1e9:.2f} B parameters), a model this plan did not "
                       f"measure: the recommendation assumes {target.shape.name} loses what {bench.info.name} lost.")
    notes = tuple(f"{cap.candidate}: {target.gpu.name} has no {c.plan.lane} tensor cores, so it runs weight-only on the "
                  "BF16 lane (as vLLM does); its accuracy row is still the recipe's own"
                  for c, cap in zip(candidates, caps) if cap.fell_back)
    skipped = [c.name for c, r in zip(candidates, rows) if r is None]
    if skipped:
        notes += (f"not measured: {', '.join(skipped)} — each adds a KV cache to a candidate whose whole 95% "
                  f"interval is already over the budget ({budget.describe()}); --measure-all measures them too",)
    if bench.info.reference_note:
        notes += (bench.info.reference_note,)
    d = bench.describe()
    setup = {"corpus": d.corpus, "split": d.split, "windows": d.windows, "seq_len": d.seq_len, "tokens": d.tokens,
             "seed": d.seed, "calibration_windows": d.calibration_windows, "kl_topk": d.kl_topk,
             "calib_corpus": d.calib_corpus, "loss_on": d.loss_on}
    secs.update({f"bench: {k}": v for k, v in bench.stage_seconds.items()})
    return PlanResult(model, served_note, target, load, budget, setup, options, rec, cmds, tuple(curve_list), notes,
                      secs, task_setup)
