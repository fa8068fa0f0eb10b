"""The highest request rate a scenario sustains under an SLO, by bisection.

The bracket's top is a closed-form bound: no engine can finish requests faster than its
cheapest per-request work at the largest batch it can hold,

    λ_max = 1 / (prompt · t_prefill_token + output · t_decode(B*) / B*),

with t_prefill_token the per-token time of a full-budget prefill step and B* = min(max_num_seqs,
KV capacity ÷ (prompt + output)).  Below it, the SLO check is monotone enough in the rate
for a bracketing search and bisection in log space (see :func:`max_rate`).  Each seed draws its own arrivals and lengths (common random
numbers across rates), and the answer is reported as a range over seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .engine import StopRule
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
    early_stop: bool = True,
) -> MaxRate:
    """The highest rate of ``workload`` (its ``rate`` is ignored) that meets ``slo``, per seed.

    Per seed: a first probe at a guess (0.85 × the closed-form bound, or the median of the
    seeds already searched), then steps of ×1.1 (squared at each further step) up or down
    until a passing and a failing rate bracket the answer, then bisection in log space until
    ``hi / lo ≤ 1 + rel_tol``.  The answer ``lo`` is always a simulated rate that met the SLO
    (0 when even ``bound / 64`` does not) and ``hi`` one that missed it, or ``1.05 × bound``,
    which is never simulated: a rate above the bound is not reported (a finite run can absorb
    a burst it could not sustain).

    Args:
        scenario: model, plan, GPU and engine.
        workload: lengths, request count, burstiness; ``seed`` and ``rate`` are replaced.
        slo: the targets.
        form: ``percentile`` (p-th percentile of each metric within target) or ``goodput``
            (at least ``slo.attainment`` of requests meet every target).
        seeds: one search per seed.
        rel_tol: stop when the bracket is narrower than this fraction.
        early_stop: abandon a probe once enough requests missed the TTFT or TPOT target that
            the SLO is certainly lost (:class:`~lowbit.sim.engine.StopRule`); the pass/fail
            answer of every probe is unchanged.
    """
    if form not in ("percentile", "goodput"):
        raise ValueError(f"SLO form must be 'percentile' or 'goodput', got {form!r}")
    if not seeds:
        raise ValueError("max_rate needs at least one seed")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    bound = saturation_bound(scenario, workload)
    stop = None
    if early_stop and (slo.ttft is not None or slo.tpot is not None):
        stop = StopRule(slo.ttft, slo.tpot, slo.percentile if form == "percentile" else None, slo.attainment)
    found: list[float] = []
    evals = 0
    for seed in seeds:
        w = workload.with_seed(seed)

        def ok(rate: float) -> bool:
            nonlocal evals
            evals += 1
            return _meets(scenario.run(w.with_rate(rate), stop=stop), slo, form)

        floor_, top = bound / 64, bound * 1.05
        positive = [f for f in found if f > 0]
        guess = float(np.median(positive)) if positive else 0.85 * bound
        guess = min(max(guess, floor_), top / (1 + rel_tol))
        step = 1.1
        if ok(guess):
            lo, hi = guess, top
            while lo * step < top:
                if ok(lo * step):
                    lo, step = lo * step, step * step
                else:
                    hi = lo * step
                    break
        else:
            lo, hi = 0.0, guess
            while hi / step > floor_:
                if ok(hi / step):
                    lo = hi / step
                    break
                hi, step = hi / step, step * step
            if lo == 0.0:
                if ok(floor_):
                    lo = floor_
                else:
                    found.append(0.0)
                    continue
        while hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        found.append(min(lo, bound))
    arr = np.asarray(found)
    return MaxRate(form=form, seeds=tuple(seeds), per_seed=tuple(float(x) for x in arr),
                   low=float(arr.min()), median=float(np.median(arr)), high=float(arr.max()),
                   bound=bound, evaluations=evals)
