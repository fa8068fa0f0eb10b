"""The decision rules on points: the Pareto front against its definition, the budget, fits."""

import math
import random

import pytest

from lowbit.planning.recommend import LATENCY_MARGIN, Budget, Point, pareto_front, recommend


def _dominated(p, q) -> bool:
    """q dominates p (loss minimized, value maximized)."""
    return q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])


def brute_front(points):
    return [i for i, p in enumerate(points) if not any(_dominated(p, q) for q in points)]


def test_pareto_front_is_exactly_the_non_dominated_set():
    rng = random.Random(0)
    for trial in range(3000):
        n = rng.randint(0, 14)
        coarse = trial % 2 == 0  # small integer grids make ties in one or both coordinates common
        pts = [(float(rng.randint(0, 4)), float(rng.randint(0, 4))) if coarse else (rng.uniform(-1, 5), rng.gauss(0, 3))
               for _ in range(n)]
        assert pareto_front(pts) == brute_front(pts), pts


def test_pareto_front_examples():
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points do not dominate each other
    assert pareto_front([(0.0, 1.0), (1.0, 1.0), (1.0, 2.0), (2.0, 3.0), (2.0, 0.5)]) == [0, 2, 3]


def _point(name, loss, rate, fits=True, tpot=0.005, memory=1e9, weight_only=False, lane="bf16", binding="tpot"):
    return Point(name, loss, fits, rate if fits else 0.0, tpot if fits else None, memory, memory, 8.0, lane,
                 weight_only, 2.0, binding if fits else None, 1000)


def test_pick_is_the_fastest_within_budget():
    rng = random.Random(1)
    for _ in range(500):
        pts = [_point(f"c{i}", rng.uniform(0, 5), rng.uniform(0, 50), fits=rng.random() > 0.2,
                      tpot=rng.uniform(0.002, 0.01)) for i in range(rng.randint(1, 8))]
        budget = Budget("ppl", rng.uniform(0, 5))
        rec = recommend(pts, budget, 1.0, 0.04)
        ok = [p for p in pts if p.fits and p.loss <= budget.limit]
        assert set(rec.eligible) == {p.name for p in ok}
        if not ok:
            assert rec.pick is None and rec.verdict in ("nothing within budget", "nothing fits")
            continue
        pick = next(p for p in pts if p.name == rec.pick)
        assert pick.fits and pick.loss <= budget.limit
        assert pick.rate == max(p.rate for p in ok)
        if rec.latency_pick:
            lat = next(p for p in pts if p.name == rec.latency_pick)
            assert lat in ok and lat.tpot == min(p.tpot for p in ok) and lat.tpot < pick.tpot * (1 - LATENCY_MARGIN)


def test_a_candidate_that_does_not_fit_is_never_picked():
    pts = [_point("big", 0.0, 0.0, fits=False), _point("small", 1.0, 10.0)]
    rec = recommend(pts, Budget("ppl", 2.0))
    assert rec.pick == "small" and "big" not in rec.eligible and "big" not in rec.front_rate
    rec = recommend([_point("big", 0.0, 0.0, fits=False)], Budget("ppl", 2.0), gpu="RTX", usable_bytes=20e9)
    assert rec.pick is None and rec.verdict == "nothing fits" and "big" in rec.reason and "--tp" in rec.reason


def test_nothing_within_budget_is_said():
    rec = recommend([_point("a", 3.0, 10.0), _point("b", 2.5, 5.0)], Budget("ppl", 2.0))
    assert rec.pick is None and rec.verdict == "nothing within budget"
    assert "b at +2.50%" in rec.reason


def test_reason_follows_the_binding_target():
    base = _point("bf16", 0.0, 10.0, binding="ttft")
    fp8 = _point("fp8", 1.0, 20.0, lane="fp8", binding="ttft")
    assert recommend([base, fp8], Budget("ppl", 2.0), 1.0, 0.04).reason.startswith("prefill-bound")
    w4 = _point("w4", 1.0, 20.0, weight_only=True, binding="tpot")
    r = recommend([base, w4], Budget("ppl", 2.0), 1.0, 0.04).reason
    assert r.startswith("TPOT-bound") and "weight-only helps" in r and "20.0 req/s against 10.0 for bf16" in r


@pytest.mark.parametrize("text, limit", [("2%", 2.0), ("0.5", 0.5), ("+1.25 %", 1.25)])
def test_budget_parses(text, limit):
    assert Budget.max_loss(text) == Budget("ppl", limit)


@pytest.mark.parametrize("text", ["abc", "-1%", "2%%", "", "nan"])
def test_bad_max_loss_is_refused(text):
    with pytest.raises(ValueError, match="--max-loss"):
        Budget.max_loss(text)


def test_bad_max_kl_is_refused():
    with pytest.raises(ValueError, match="--max-kl"):
        Budget.max_kl("x")
    with pytest.raises(ValueError, match="--max-kl"):
        Budget.max_kl("-0.1")
    assert Budget.max_kl("0.02").limit == 0.02 and not math.isnan(Budget.max_kl("0").limit)
