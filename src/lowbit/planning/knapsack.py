"""The multiple-choice knapsack behind ``lowbit search``: one choice per unit, total cost at
most a capacity, least total loss — solved exactly by a dynamic programme over integer
costs.

Costs are storage bits, which are integers (elements × element bits + scales); they are
divided by their greatest common divisor, and, only when the capacity would still need more
than ``max_steps`` cells, rounded *up* to a coarser step — so a returned choice always fits
the real capacity, and it is the exact optimum of the (possibly rounded) problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Solution", "Infeasible", "solve", "brute_force"]

#: cells of the cost axis before costs are rounded up to a coarser step
MAX_STEPS = 200_000


class Infeasible(ValueError):
    """No choice fits the capacity (the message gives the least cost that would)."""


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # index of the chosen option per unit
    loss: float
    cost: int  # in the caller's units (exact, not rounded)
    step: int  # the cost axis' cell: 1 is exact integer costs; larger means costs were rounded up


def _check(costs: list[list[int]], losses: list[list[float]]) -> None:
    if not costs:
        raise ValueError("knapsack: no units to choose for")
    if len(costs) != len(losses):
        raise ValueError(f"knapsack: {len(costs)} cost rows but {len(losses)} loss rows")
    for i, (c, l) in enumerate(zip(costs, losses)):
        if not c or len(c) != len(l):
            raise ValueError(f"knapsack: unit {i} has {len(c)} costs and {len(l)} losses (need the same, at least 1)")
        if any(int(x) != x or x < 0 for x in c):
            raise ValueError(f"knapsack: unit {i} has a cost that is not a non-negative integer: {c}")
        if any(not math.isfinite(x) for x in l):
            raise ValueError(f"knapsack: unit {i} has a loss that is not finite: {l}")


def solve(costs: list[list[int]], losses: list[list[float]], capacity: int, *, max_steps: int = MAX_STEPS) -> Solution:
    """The choice (one option per unit) of least total loss whose total cost is at most
    ``capacity``.

    Raises:
        Infeasible: even the cheapest option of every unit exceeds ``capacity``.
        ValueError: malformed input (names the unit).
    """
    _check(costs, losses)
    least = sum(min(c) for c in costs)
    if least > capacity:
        raise Infeasible(f"the cheapest choice costs {least}, more than the capacity {capacity}")
    g = 0
    for c in costs:
        for x in c:
            g = math.gcd(g, int(x))
    g = max(g, 1)
    step = max(g, -(-int(capacity) // max_steps))
    cells = int(capacity) // step
    w = [[-(-int(x) // step) for x in c] for c in costs]  # rounded up: never over the real capacity
    if sum(min(c) for c in w) > cells:  # rounding up made the cheapest choice too dear: retry finer
        if step == g:
            raise Infeasible(f"the cheapest choice costs {least}, more than the capacity {capacity}")
        return solve(costs, losses, capacity, max_steps=max_steps * 4)
    best = np.zeros(cells + 1)  # best[c]: least loss of the units so far within cost c
    picks = np.zeros((len(costs), cells + 1), dtype=np.int16)
    for i, (wi, li) in enumerate(zip(w, losses)):
        new = np.full(cells + 1, np.inf)
        for j, (wj, lj) in enumerate(zip(wi, li)):
            if wj > cells:
                continue
            cand = np.full(cells + 1, np.inf)
            cand[wj:] = best[: cells + 1 - wj] + lj
            better = cand < new
            new[better] = cand[better]
            picks[i, better] = j
        best = new
    if not np.isfinite(best[cells]):
        raise Infeasible(f"the cheapest choice costs {least}, more than the capacity {capacity}")
    choice = []
    c = cells
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i, c])
        choice.append(j)
        c -= w[i][j]
    choice.reverse()
    total = sum(costs[i][j] for i, j in enumerate(choice))
    return Solution(tuple(choice), float(sum(losses[i][j] for i, j in enumerate(choice))), int(total), step)


def brute_force(costs: list[list[int]], losses: list[list[float]], capacity: int) -> tuple[float, tuple[int, ...]] | None:
    """Every combination tried (for tests of :func:`solve` on small instances); ``None`` when
    none fits."""
    import itertools

    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        cost = sum(costs[i][j] for i, j in enumerate(choice))
        if cost > capacity:
            continue
        loss = sum(losses[i][j] for i, j in enumerate(choice))
        if best is None or loss < best[0]:
            best = (loss, choice)
    return best
