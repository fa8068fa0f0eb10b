"""Rendering of benchmark comparisons (:class:`lowbit.evaluation.task_compare.TaskComparison`)."""

from __future__ import annotations

from rich.table import Table

from ..data.tasks import TASKS
from ..evaluation.paired import accuracy_ci
from ..evaluation.tasks import outcome
from .tables import num

__all__ = ["tasks_table"]


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _ci(ci: tuple[float, float], signed: bool = False) -> str:
    f = (lambda v: f"{100 * v:+.1f}") if signed else _pct
    return f"[{f(ci[0])}, {f(ci[1])}]"


def tasks_table(comparison) -> Table:
    """One line per task, metric and configuration: accuracy with its 95% interval, Δ against
    the reference with its paired bootstrap interval, flips, McNemar's exact p and the mean KL of
    the choice distribution (LAMBADA: perplexity of the last word instead of KL)."""
    limit = f", first {comparison.limit} rows" if comparison.limit else ""
    t = Table(title=f"Benchmarks on {comparison.model} (lm-eval 0.4.13 formats, 0-shot; GSM8K 8-shot "
              f"chain of thought, greedy{limit}; accuracy in %)",
              title_justify="left")
    for col in ("task (n)", "metric", "config", "acc [95% CI]", "Δ [95% CI]", "r→w / w→r", "flipped", "McNemar p",
                "choice KL / ppl"):
        t.add_column(col, justify="left" if col in ("task (n)", "metric", "config") else "right", no_wrap=True)
    ref = comparison.rows[0]
    for task in comparison.tasks:
        label = f"{task} ({comparison.examples[task]})"
        for metric in (m for m in TASKS[task].metrics if m != "perplexity"):
            ppl = "perplexity" in TASKS[task].metrics
            r = ref.results[task]
            m = outcome(r.kind, metric)
            ref_ci = accuracy_ci([e.correct(m) for e in r.examples], seed=comparison.seed)
            t.add_row(label, metric, "reference", f"{_pct(r.metric(metric))} {_ci(ref_ci)}",
                      "", "", "", "", num(r.metric("perplexity")) if ppl else "")
            label = ""
            for row in comparison.rows[1:]:
                p = next(p for p in row.paired[task] if p.metric == metric)
                extra = num(row.results[task].metric("perplexity")) if ppl else num(p.choice_kl)
                t.add_row("", "", row.label, f"{_pct(p.accuracy)} {_ci(p.accuracy_ci)}",
                          f"{100 * p.delta:+.1f} {_ci(p.delta_ci, True)}",
                          f"{p.flips.right_to_wrong} / {p.flips.wrong_to_right}", f"{100 * p.flips.fraction:.1f}%",
                          num(p.mcnemar_p, 3), extra)
    return t
