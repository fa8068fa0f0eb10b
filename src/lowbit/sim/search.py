"""The highest request rate a scenario sustains under an SLO, by bisection.

The bracket's top is a closed-form bound: no engine can finish requests faster than its
cheapest per-request work at the largest batch it can hold,

    λ_max = 1 / (prompt · t_prefill_token + output · t_decode(B*) / B*),

with t_prefill_token the per-token time of a full-budget prefill step and B* = min(max_num_seqs,
KV capacity ÷ (prompt + output)).  Below it, the SLO check is monotone enough in the rate
for bisection in log space.  Each seed draws its own arrivals and lengths (common random
numbers across rates), and the answer is reported as a range over seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .metrics import SLO, SimResult
from .scenario import Scenario
from .workload import Workload

__all__ = ["MaxRate", "saturation_bound", "max_rate"]


@dataclass(frozen=True)
class MaxRate:
    """Max sustainable rate under an SLO.

    Attributes:
        form: ``percentile`` or ``goodput``.
        per_seed: the max rate found with each seed (req/s), at most ``bound``; 0 when even a
            trickle misses the SLO.
        low, median, high: over seeds.
        bound: the closed-form upper bound used as the bracket's top.
        evaluations: simulations run.
    """

    form: str
    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]
    low: float
    median: float
    high: float
    bound: float
    evaluations: int

    def to_dict(self) -> dict:
        return asdict(self)


def saturation_bound(scenario: Scenario, workload: Workload) -> float:
    """The closed-form upper bound on sustainable request rate (requests/s); see the module docstring."""
    step, eng = scenario.step, scenario.engine
    p, o = workload.mean_prompt, workload.mean_output
    chunk = eng.max_num_batched_tokens
    per_prefill_token = step.step_time(chunk, 0, 0.0, chunk * (chunk + 1) / 2 * min(1.0, p / chunk), chunk, 1) / chunk
    batch = max(1, min(eng.max_num_seqs, int(scenario.capacity_tokens // max(p + o, 1))))
    ctx = p + o / 2
    per_decode = step.step_time(0, batch, batch * ctx, sampled=batch) / batch
    return 1.0 / (p * per_prefill_token + max(o - 1, 0) * per_decode)


def _meets(res: SimResult, slo: SLO, form: str) -> bool:
    return res.meets_percentile(slo) if form == "percentile" else res.meets_goodput(slo)


def max_rate(
    scenario: Scenario,
    workload: Workload,
    slo: SLO,
    form: str = "percentile",
    seeds: tuple[int, ...] = (0, 1, 2),
    rel_tol: float = 0.02,
) -> MaxRate:
    """Bisect the rate of ``workload`` (its ``rate`` is ignored) for the highest that meets ``slo``.

    Args:
        scenario: model, plan, GPU and engine.
        workload: lengths, request count, burstiness; ``seed`` and ``rate`` are replaced.
        slo: the targets.
        form: ``percentile`` (p-th percentile of each metric within target) or ``goodput``
            (at least ``slo.attainment`` of requests meet every target).
        seeds: one search per seed.
        rel_tol: stop when the bracket is narrower than this fraction.
    """
    if form not in ("percentile", "goodput"):
        raise ValueError(f"SLO form must be 'percentile' or 'goodput', got {form!r}")
    if not seeds:
        raise ValueError("max_rate needs at least one seed")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    bound = saturation_bound(scenario, workload)
    found, evals = [], 0
    for seed in seeds:
        w = workload.with_seed(seed)
        lo, hi = bound / 64, bound * 1.05
        lo_checked = False  # the bottom is checked only if every probe above it fails (it is the slowest run)
        while hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            evals += 1
            if _meets(scenario.run(w.with_rate(mid)), slo, form):
                lo, lo_checked = mid, True
            else:
                hi = mid
        if not lo_checked:
            evals += 1
            if not _meets(scenario.run(w.with_rate(lo)), slo, form):
                lo = 0.0
        found.append(min(lo, bound))  # a finite run can absorb a burst above the bound; it is not sustainable
    arr = np.asarray(found)
    return MaxRate(form=form, seeds=tuple(seeds), per_seed=tuple(float(x) for x in arr),
                   low=float(arr.min()), median=float(np.median(arr)), high=float(arr.max()),
                   bound=bound, evaluations=evals)
