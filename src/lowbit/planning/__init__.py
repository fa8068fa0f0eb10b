"""Planning (``lowbit plan``): measured accuracy and simulated capacity joined, per candidate
recipe, into one decision — a table, a recommendation, the Pareto front and the commands.

This stage owns the candidate set (recipes the GPU runs natively plus the weight-only ones,
derived from the GPU table's lanes), the recipe → simulator-plan mapping (from the recipe's
schemes), the simulator-result cache, and the recommendation.  It may import
``evaluation``, ``checkpoint``, ``sim``, ``quantization``, ``models``, ``data``, ``numerics``
and ``util`` — never ``report`` or ``cli``, which render and parse what it returns.
"""

from .candidates import DEFAULT_POOL, Candidate, default_candidates, parse_candidate, recipe_plan
from .capacity import Capacity, Load, capacity_for
from .commands import Commands, recipe_yaml, ship_commands
from .plan import Option, PlanResult, Target, plan
from .recommend import Budget, Recommendation, pareto_front, recommend

__all__ = [
    "Candidate", "DEFAULT_POOL", "default_candidates", "parse_candidate", "recipe_plan",
    "Capacity", "Load", "capacity_for", "Commands", "recipe_yaml", "ship_commands",
    "Option", "PlanResult", "Target", "plan", "Budget", "Recommendation", "pareto_front", "recommend",
]
