"""The decision: the accuracy budget, the Pareto fronts, and the recommendation with its reason.

A candidate is *eligible* when its weights fit and its measured loss is within the budget.
The capacity pick is the eligible candidate with the highest max rate under the SLO (ties:
lower loss, then less memory); the latency pick the eligible one with the lowest single-user
TPOT, named only when it is at least :data:`LATENCY_MARGIN` faster than the capacity pick.  Both reasons are read off the simulator's numbers (which
target fails first just above the max rate, the lane, the bits per weight) — never assumed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

__all__ = ["Budget", "Point", "Recommendation", "pareto_front", "recommend", "LATENCY_MARGIN"]

#: the latency pick is named only when its single-user TPOT is this much (fraction) below the
#: capacity pick's: smaller differences are below what the step-time model can resolve
LATENCY_MARGIN = 0.02


@dataclass(frozen=True)
class Budget:
    """How much accuracy may be lost: ``metric`` ``ppl`` (perplexity Δ%, the point estimate),
    ``kl`` (mean KL divergence per token) or ``task`` (benchmark accuracy drop in points: the
    mean over the tasks of the reference's headline accuracy minus the candidate's, ×100), at
    most ``limit``."""

    metric: str
    limit: float

    def __post_init__(self) -> None:
        if self.metric not in ("ppl", "kl", "task"):
            raise ValueError(f"budget metric must be 'ppl', 'kl' or 'task', got {self.metric!r}")
        if not (math.isfinite(self.limit) and self.limit >= 0):
            raise ValueError(f"budget limit must be a finite number >= 0, got {self.limit!r}")

    @classmethod
    def max_loss(cls, text: str) -> Budget:
        """``2%`` or ``2`` → perplexity at most +2%."""
        m = re.fullmatch(r"\s*\+?([0-9]*\.?[0-9]+)\s*%?\s*", str(text))
        if not m:
            raise ValueError(f"--max-loss: expected a perplexity increase in percent such as 2% or 0.5, got {text!r}")
        return cls("ppl", float(m.group(1)))

    @classmethod
    def max_kl(cls, text: str) -> Budget:
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"--max-kl: expected a number such as 0.02, got {text!r}") from None
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--max-kl: expected a finite number >= 0, got {text!r}")
        return cls("kl", v)

    @classmethod
    def max_task_drop(cls, text: str) -> Budget:
        """``1`` or ``1pt`` → mean benchmark accuracy at most 1 point below the reference's."""
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(pts?|points?)?\s*", str(text))
        if not m:
            raise ValueError(f"--max-task-drop: expected accuracy points such as 1 or 0.5, got {text!r}")
        return cls("task", float(m.group(1)))

    def loss(self, ev) -> float:
        """The loss of an :class:`~lowbit.evaluation.metrics.Eval` (0 for the reference itself);
        a task budget's loss is the candidate's task row's ``headline_drop()`` instead."""
        if self.metric == "task":
            raise ValueError("a task-accuracy budget is read off task scores (TaskRow.headline_drop), not a perplexity row")
        v = ev.delta_pct if self.metric == "ppl" else ev.kl_mean
        return 0.0 if v is None else float(v)

    def certainly_over(self, ev) -> bool:
        """The whole 95% interval of ``ev``'s loss lies above the limit (never, for a task
        budget: perplexity does not bound task accuracy)."""
        if self.metric == "task":
            return False
        ci = ev.delta_ci if self.metric == "ppl" else ev.kl_ci
        return ci is not None and ci[0] > self.limit

    def describe(self) -> str:
        if self.metric == "task":
            return f"mean task accuracy at most {self.limit:g} points below the reference"
        return f"perplexity at most +{self.limit:g}%" if self.metric == "ppl" else f"mean KL at most {self.limit:g}"

    def fmt(self, loss: float) -> str:
        if self.metric == "task":
            return f"{-loss:+.2f} pts"
        return f"{loss:+.2f}%" if self.metric == "ppl" else f"KL {loss:.4f}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Point:
    """What the recommendation reads of one candidate."""

    name: str
    loss: float
    fits: bool
    rate: float  # median max rate under the SLO, 0 when it does not fit
    tpot: float | None  # single-user TPOT, seconds
    memory: float  # weights + one mean conversation's KV, bytes per GPU
    weights_per_gpu: float
    weight_bits: float
    lane: str
    weight_only: bool
    kv_bytes: float
    binding: str | None
    kv_capacity: int


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points, in input order, for (loss to minimize, value to maximize).

    ``q`` dominates ``p`` when ``q.loss ≤ p.loss`` and ``q.value ≥ p.value`` with one of them
    strict; equal points do not dominate each other.  Sorting by loss, a point survives when
    it has the best value of its loss group and beats every value of strictly smaller loss.
    """
    order = sorted(range(len(points)), key=lambda i: points[i][0])
    keep, best_before, i = [], -math.inf, 0
    while i < len(order):
        j = i
        while j < len(order) and points[order[j]][0] == points[order[i]][0]:
            j += 1
        group = order[i:j]
        top = max(points[k][1] for k in group)
        keep += [k for k in group if points[k][1] == top and top > best_before]
        best_before = max(best_before, top)
        i = j
    return sorted(keep)


@dataclass(frozen=True)
class Recommendation:
    """The outcome.  ``verdict``: ``ok``, ``nothing fits``, ``nothing within budget`` or
    ``nothing meets the SLO`` (then ``pick`` is ``None`` and ``reason`` says why)."""

    verdict: str
    pick: str | None
    reason: str
    latency_pick: str | None
    latency_reason: str | None
    eligible: tuple[str, ...]
    front_rate: tuple[str, ...]
    front_memory: tuple[str, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def _why_capacity(p: Point, others: list[Point], slo_ttft: float | None, slo_tpot: float | None) -> str:
    base = next((o for o in others if o.name != p.name and o.lane == "bf16" and not o.weight_only and o.fits), None)
    base = base or max((o for o in others if o.name != p.name and o.fits), key=lambda o: o.rate, default=None)
    vs = f"{p.rate:.1f} req/s against {base.rate:.1f} for {base.name}" if base else f"{p.rate:.1f} req/s"
    lane = p.lane.upper() + " lane" if p.lane != "bf16" else ("BF16 lane, weight-only" if p.weight_only else "BF16 lane")
    def target(what: str, v: float | None) -> str:
        return f"the {what} target{f' of {v * 1e3:g} ms' if v else ''} fails first above the max rate"

    if p.binding == "tpot":
        head = f"TPOT-bound at this load ({target('TPOT', slo_tpot)})"
        if p.weight_only:
            how = f"weight-only helps: its decode reads {p.weight_bits:.1f}-bit weights"
        elif p.lane != "bf16":
            how = f"the {lane} and {p.weight_bits:.1f}-bit weights cut decode time"
        else:
            how = "no candidate within the budget reads fewer weight bytes, so the KV cache decides" if \
                p.kv_bytes == 1.0 else "no candidate within the budget decodes faster"
    elif p.binding == "ttft":
        head = f"prefill-bound at this load ({target('TTFT', slo_ttft)})"
        how = f"needs a faster math lane than BF16: the {lane} prefills faster" if p.lane != "bf16" else \
            f"no eligible candidate prefills faster than the {lane}"
    else:
        head, how = "throughput-bound (both targets hold up to the simulator's saturation bound)", f"the {lane}"
    kv = f"; its FP8 KV cache holds {p.kv_capacity:,} tokens" if p.kv_bytes == 1.0 else ""
    return f"{head}: {how} — {vs}{kv}."


def recommend(points: list[Point], budget: Budget, slo_ttft: float | None = None, slo_tpot: float | None = None,
              gpu: str = "the GPU", usable_bytes: float | None = None) -> Recommendation:
    """Eligible set, picks with reasons, and both Pareto fronts (rate over fitting candidates,
    memory over all) of ``points``."""
    fit = [p for p in points if p.fits]
    measured = [p for p in points if math.isfinite(p.loss)]  # an unmeasured candidate (loss inf) is on no front
    fit_measured = [p for p in fit if math.isfinite(p.loss)]
    fr = pareto_front([(p.loss, p.rate) for p in fit_measured])
    fm = pareto_front([(p.loss, -p.memory) for p in measured])
    front_rate, front_memory = tuple(fit_measured[i].name for i in fr), tuple(measured[i].name for i in fm)
    eligible = [p for p in fit if p.loss <= budget.limit]
    names = tuple(p.name for p in eligible)
    if not fit:
        small = min(points, key=lambda p: p.weights_per_gpu)
        room = f" of the {usable_bytes / 1e9:.1f} GB usable" if usable_bytes else ""
        return Recommendation("nothing fits", None,
                              f"no candidate fits {gpu}: the smallest, {small.name}, needs "
                              f"{small.weights_per_gpu / 1e9:.1f} GB of weights per GPU{room}; use more GPUs (--tp)",
                              None, None, names, front_rate, front_memory)
    if not eligible:
        best = min(fit, key=lambda p: p.loss)
        return Recommendation("nothing within budget", None,
                              f"no candidate that fits meets the budget ({budget.describe()}): the least loss is "
                              f"{best.name} at {budget.fmt(best.loss)}; relax the budget or add better-calibrated "
                              "recipes (--recipes)", None, None, names, front_rate, front_memory)
    lat = min((p for p in eligible if p.tpot is not None), key=lambda p: (p.tpot, p.loss), default=None)
    serving = [p for p in eligible if p.rate > 0]
    if not serving:
        return Recommendation("nothing meets the SLO", None,
                              "no candidate within the budget meets the SLO at any request rate: relax --ttft / "
                              "--tpot or use more GPUs", lat.name if lat else None,
                              None if lat is None else f"lowest single-user TPOT: {lat.tpot * 1e3:.2f} ms",
                              names, front_rate, front_memory)
    pick = max(serving, key=lambda p: (p.rate, -p.loss, -p.memory))
    reason = _why_capacity(pick, points, slo_ttft, slo_tpot)
    lat_reason = None
    if lat is not None and lat.name != pick.name and lat.tpot < pick.tpot * (1 - LATENCY_MARGIN):
        what = "weight-only: the fewest bytes read per token" if lat.weight_only else f"the {lat.lane.upper()} lane"
        lat_reason = (f"lowest single-user TPOT: {lat.tpot * 1e3:.2f} ms against {pick.tpot * 1e3:.2f} ms for "
                      f"{pick.name} ({what}, {lat.weight_bits:.1f}-bit weights), at {lat.rate:.1f} req/s max.")
    else:
        lat = None
    return Recommendation("ok", pick.name, reason, lat.name if lat else None, lat_reason, names, front_rate,
                          front_memory)
