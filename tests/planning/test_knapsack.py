"""The search's multiple-choice knapsack: exact against brute force, within budget, and clear
about infeasible budgets."""

import random

import pytest

from lowbit.planning.knapsack import Infeasible, brute_force, solve


def _instance(rng, units, options, big=False):
    scale = 10**5 if big else 20
    costs = [[rng.randint(1, scale) for _ in range(rng.randint(1, options))] for _ in range(units)]
    losses = [[rng.random() * 10 for _ in c] for c in costs]
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    return costs, losses, rng.randint(lo, hi)


@pytest.mark.parametrize("seed", range(40))
def test_exact_against_brute_force(seed):
    rng = random.Random(seed)
    costs, losses, cap = _instance(rng, rng.randint(1, 6), 4)
    sol = solve(costs, losses, cap)
    best, _ = brute_force(costs, losses, cap)
    assert all(x % sol.step == 0 for c in costs for x in c)  # small costs: the exact axis, no rounding
    assert sol.cost <= cap
    assert sol.cost == sum(costs[i][j] for i, j in enumerate(sol.choice))
    assert sol.loss == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_rounded_costs_stay_within_budget(seed):
    """Costs too large for one cell per unit are rounded up: still within the real budget,
    and close to the optimum."""
    rng = random.Random(100 + seed)
    costs, losses, cap = _instance(rng, 5, 3, big=True)
    sol = solve(costs, losses, cap, max_steps=1000)
    assert sol.step > 1
    assert sol.cost <= cap
    best, _ = brute_force(costs, losses, cap)
    assert sol.loss >= best - 1e-9
    exact = solve(costs, losses, cap, max_steps=10**6)
    assert exact.loss == pytest.approx(best, abs=1e-9)


def test_common_divisor_is_exact():
    costs = [[4000, 8000, 16000], [4000, 8000, 16000], [12000, 24000]]
    losses = [[3.0, 1.0, 0.0], [5.0, 0.5, 0.0], [2.0, 0.0]]
    sol = solve(costs, losses, 36000)
    assert sol.step == 4000
    assert sol.loss == pytest.approx(brute_force(costs, losses, 36000)[0])


def test_infeasible_budget_names_the_least_cost():
    with pytest.raises(Infeasible, match="cheapest choice costs 7, more than the capacity 6"):
        solve([[3, 5], [4, 9]], [[1.0, 0.0], [1.0, 0.0]], 6)


@pytest.mark.parametrize("costs, losses, match", [
    ([], [], "no units"),
    ([[1, 2]], [[0.0]], "2 costs and 1 losses"),
    ([[1.5]], [[0.0]], "not a non-negative integer"),
    ([[1]], [[float("nan")]], "not finite"),
])
def test_bad_input(costs, losses, match):
    with pytest.raises(ValueError, match=match):
        solve(costs, losses, 10)
