"""``lowbit search``: mixed precision under a bits budget.

Each *unit* — a fused group of Linears (``module``: q/k/v, o, gate/up, down of each decoder
layer; fused siblings must share a format for vLLM), a whole decoder layer (``layer``) or a
module type across layers (``type``) — gets one of the candidate weight formats or stays in
16 bits.  Sizes are :func:`lowbit.numerics.scheme.bits_per_element` (scales included) times
the parameter count; the accuracy cost of each unit × format is the Fisher proxy of the
single-unit KL (:mod:`.scores`), assumed additive over units.  The assignment of least
predicted KL with average bits ≤ the budget is found exactly (:mod:`.knapsack`) and written
as a recipe of glob rules (a calibration recipe's ``algorithms`` may come along), which
``compare``, ``quantize`` and the exporter take like any other.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from dataclasses import asdict, dataclass, field

from torch import nn

from ..checkpoint.compressed_tensors import ct_format
from ..evaluation.workbench import HIGH_PRECISION_BITS, Row, Workbench
from ..models.arch import arch_of
from ..models.experts import is_moe
from ..numerics.scheme import PRESETS, Scheme, bits_per_element
from ..quantization.recipe import DEFAULT_IGNORE, RECIPES, Algorithms, Recipe, Rule, load_recipe
from ..quantization.targets import layer_index, sibling_groups
from .commands import recipe_yaml
from .knapsack import solve
from .scores import PROXIES, Scores, calibrated_errors, fisher_scores

__all__ = ["GRANULARITIES", "HIGH", "Candidate", "Unit", "SearchResult", "parse_candidates", "units_of",
           "unit_costs", "unit_losses", "search", "measure", "heuristic_recipe"]

log = logging.getLogger(__name__)

GRANULARITIES = ("module", "layer", "type")
#: the candidate "leave in 16 bits" (always a candidate)
HIGH = "bf16"
_HIGH_NAMES = {"bf16", "fp16", "16", "none"}


@dataclass(frozen=True)
class Candidate:
    name: str
    scheme: Scheme | None  # None: left in 16 bits


def _candidate(name: str) -> Candidate:
    if name in _HIGH_NAMES:
        return Candidate(HIGH, None)
    if name in PRESETS:
        scheme = PRESETS[name]
    elif name in RECIPES:
        r = RECIPES[name]
        if r.kv_cache is not None or len(r.rules) != 1 or r.rules[0].inputs is not None or r.rules[0].weights is None:
            raise ValueError(f"candidate {name!r}: the search chooses weight formats only; this recipe also "
                             "quantizes inputs or the KV cache (weight-only recipes and scheme presets are candidates)")
        scheme = r.rules[0].weights
    else:
        raise ValueError(f"unknown candidate {name!r}: not a scheme preset ({', '.join(PRESETS)}), a weight-only "
                         f"recipe preset or one of {', '.join(sorted(_HIGH_NAMES))}")
    if scheme.dynamic and scheme.format.kind == "int" and scheme.granularity.kind == "token":
        raise ValueError(f"candidate {name!r} is an activation scheme, not a weight format")
    ct_format(scheme, None)  # compressed-tensors / vLLM must be able to store it (UnsupportedScheme says why)
    return Candidate(name, scheme)


def parse_candidates(text: str | list[str]) -> list[Candidate]:
    """Comma-separated scheme presets or weight-only recipe presets; 16 bits is added when
    missing.  Duplicates (the same scheme twice) are errors."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise ValueError("--candidates: give at least one format")
    out = [_candidate(n) for n in names]
    schemes = [c.scheme for c in out]
    for i, s in enumerate(schemes):
        if s in schemes[:i]:
            raise ValueError(f"--candidates: {names[i]!r} is the same format as an earlier candidate")
    if None not in schemes:
        out.append(Candidate(HIGH, None))
    if all(c.scheme is None for c in out):
        raise ValueError("--candidates: give at least one quantized format besides 16 bits")
    return out


@dataclass(frozen=True)
class Unit:
    """Linears that get one format together; ``targets`` are the recipe's globs for them."""

    name: str
    modules: tuple[str, ...]
    targets: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def params(self) -> int:
        return sum(a * b for a, b in self.shapes)


def units_of(model: nn.Module, granularity: str = "module") -> list[Unit]:
    """The model's search units at ``granularity`` (:data:`GRANULARITIES`), in layer order.

    Raises:
        ValueError: an unknown granularity, or a mixture-of-experts model (not supported yet).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if is_moe(model):
        raise ValueError("lowbit search does not handle mixture-of-experts models yet (experts and routers "
                         "would need their own units and cost model)")
    arch = arch_of(model)
    index = layer_index(arch.layers)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and index(n) is not None
            and not any(fnmatch.fnmatchcase(n, p) for p in DEFAULT_IGNORE)}
    fused = {n: g for g in sibling_groups(model) for n in g}
    groups: list[tuple[str, ...]] = []
    for n in mods:  # named_modules order: layer by layer, q before k before v
        g = fused.get(n, (n,))
        if g not in groups:
            groups.append(g)
    shapes = {n: tuple(m.weight.shape) for n, m in mods.items()}
    head = arch.layers + "."

    def rel(n: str) -> str:
        return n[len(head):].split(".", 1)[1]

    if granularity == "module":
        return [Unit(g[0] if len(g) == 1 else f"{g[0]}+{'+'.join(rel(n).rsplit('.', 1)[-1] for n in g[1:])}",
                     g, g, tuple(shapes[n] for n in g)) for g in groups]
    buckets: dict[str, list[str]] = {}
    for g in groups:
        key = f"{arch.layers}.{index(g[0])}" if granularity == "layer" else "+".join(rel(n) for n in g)
        buckets.setdefault(key, []).extend(g)
    out = []
    for key, names in buckets.items():
        targets = (f"{key}.*",) if granularity == "layer" else tuple(f"*.{r}" for r in key.split("+"))
        out.append(Unit(key, tuple(names), targets, tuple(shapes[n] for n in names)))
    return out


def unit_costs(units: list[Unit], candidates: list[Candidate]) -> list[list[int]]:
    """Storage bits of each unit under each candidate (integers: elements and scales)."""
    return [[sum(round((bits_per_element(c.scheme, s) if c.scheme else HIGH_PRECISION_BITS) * s[0] * s[1])
                 for s in u.shapes) for c in candidates] for u in units]


def unit_losses(units: list[Unit], candidates: list[Candidate], scores: Scores, proxy: str) -> list[list[float]]:
    """Predicted KL of each unit under each candidate: the sum of its modules' scores (0 in 16 bits)."""
    if proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {', '.join(PROXIES)}, got {proxy!r}")
    quantized = [c for c in candidates if c.scheme is not None]
    out = []
    for u in units:
        row = []
        for c in candidates:
            if c.scheme is None:
                row.append(0.0)
                continue
            k = quantized.index(c)
            row.append(float(sum(scores.values[proxy][n][k] for n in u.modules)))
        out.append(row)
    return out


@dataclass(frozen=True)
class UnitChoice:
    unit: str
    modules: tuple[str, ...]
    candidate: str
    bits: float  # average bits per element of the unit under its candidate
    predicted_kl: float


@dataclass
class SearchResult:
    model: str
    budget_bits: float
    granularity: str
    candidates: list[str]
    proxy: str
    score_windows: int
    average_bits: float
    predicted_kl: float
    choices: list[UnitChoice]
    recipe: Recipe
    seconds: dict[str, float] = field(default_factory=dict)
    measured: Row | None = None

    @property
    def recipe_yaml(self) -> str:
        return recipe_yaml(self.recipe)

    def counts(self) -> dict[str, int]:
        out = {c: 0 for c in self.candidates}
        for ch in self.choices:
            out[ch.candidate] += 1
        return out

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("recipe", "measured", "choices")}
        d["choices"] = [asdict(c) for c in self.choices]
        d["recipe_yaml"] = self.recipe_yaml
        d["measured"] = self.measured.to_dict() if self.measured else None
        return d


def _recipe(name: str, description: str, units: list[Unit], picks: list[Candidate],
            algorithms: Algorithms) -> Recipe:
    rules = []
    for c in dict.fromkeys(p.name for p in picks):
        cand = next(p for p in picks if p.name == c)
        if cand.scheme is None:
            continue  # 16 bits: no rule matches these modules
        targets = tuple(t for u, p in zip(units, picks) if p.name == c for t in u.targets)
        rules.append(Rule(targets, cand.scheme))
    return Recipe(name=name, rules=tuple(rules), description=description, algorithms=algorithms)


def search(bench: Workbench, candidates: list[Candidate], budget_bits: float, *, granularity: str = "module",
           score_windows: int = 16, proxy: str = "token", algorithms: Algorithms | str | None = None,
           scores: Scores | None = None, name: str | None = None,
           score_algorithms: bool = False) -> tuple[SearchResult, Scores]:
    """Score (unless ``scores`` are given, e.g. from a search at another budget), then solve.

    Scores are taken on the bench's first ``score_windows`` calibration windows (the train
    split; never the evaluation windows).  ``algorithms``: a calibration recipe (preset name,
    YAML path or :class:`Algorithms`) whose methods run on the mix (GPTQ, AWQ, ...).
    ``score_algorithms``: score each format by the weight error those methods leave
    (:func:`lowbit.planning.scores.calibrated_errors`: one calibrated quantization of the whole
    model per format, on the bench's calibration windows) instead of min-max rounding's.

    Raises:
        ValueError: a budget below the cheapest assignment (the message says the least
            average bits possible), a bad granularity, proxy or candidate list.
    """
    if not math.isfinite(budget_bits) or budget_bits <= 0:
        raise ValueError(f"--budget-bits must be a positive number, got {budget_bits}")
    if isinstance(algorithms, str):
        algorithms = load_recipe(algorithms).algorithms
    algorithms = algorithms or Algorithms()
    units = units_of(bench.model, granularity)
    costs = unit_costs(units, candidates)
    total = sum(u.params for u in units)
    least = sum(min(c) for c in costs) / total
    if least > budget_bits + 1e-12:
        raise ValueError(f"--budget-bits {budget_bits} is infeasible: the cheapest candidates give "
                         f"{least:.4f} average bits on {bench.info.name}")
    seconds = {}
    if scores is None:
        if len(bench.calib_windows) < score_windows:
            raise ValueError(f"the search scores on {score_windows} calibration windows; the bench has "
                             f"{len(bench.calib_windows)} (raise --calib-windows)")
        schemes = [c.scheme for c in candidates if c.scheme is not None]
        names = [n for u in units for n in u.modules]
        deltas = None
        if score_algorithms:
            if not algorithms.layerwise:
                raise ValueError("scoring by the algorithms' errors needs a calibration recipe (--algorithms)")
            t0 = time.perf_counter()
            deltas = calibrated_errors(bench.model, names, schemes, algorithms, bench.calibration,
                                       stats=lambda: bench.stats, progress=bench.progress)
            seconds["calibrated errors"] = time.perf_counter() - t0
        scores = fisher_scores(bench.model, names, schemes, bench.calib_windows[:score_windows], seed=bench.seed,
                               progress=bench.progress, deltas=deltas)
        seconds["scores"] = scores.seconds
    losses = unit_losses(units, candidates, scores, proxy)
    t0 = time.perf_counter()
    sol = solve(costs, losses, math.floor(budget_bits * total))
    seconds["solve"] = time.perf_counter() - t0
    picks = [candidates[j] for j in sol.choice]
    choices = [UnitChoice(u.name, u.modules, p.name, costs[i][j] / u.params, losses[i][j])
               for i, (u, p, j) in enumerate(zip(units, picks, sol.choice))]
    label = name or f"search-{budget_bits:g}b"
    desc = (f"lowbit search on {bench.info.name}: {granularity} units, {'/'.join(c.name for c in candidates)}, "
            f"{sol.cost / total:.4f} average bits (budget {budget_bits:g}), predicted KL {sol.loss:.4f}")
    recipe = _recipe(label, desc, units, picks, algorithms)
    result = SearchResult(bench.info.name, budget_bits, granularity, [c.name for c in candidates], proxy,
                          scores.windows, sol.cost / total, sol.loss, choices, recipe, seconds)
    log.info("search: %s", desc)
    return result, scores


def measure(bench: Workbench, result: SearchResult) -> SearchResult:
    """Quantize the chosen mix (with its algorithms) and evaluate it end to end: the
    additivity check, predicted against measured KL."""
    result.measured = bench.run(result.recipe)
    return result


def heuristic_recipe(model: nn.Module, base: Candidate, high: Candidate, kind: str,
                     algorithms: Algorithms | None = None) -> Recipe:
    """The common hand-made mixes: ``edges`` (first and last decoder layers in ``high``) or
    ``down`` (every down_proj in ``high``), the rest in ``base``; ``algorithms`` (e.g. GPTQ) run
    on the mix as in :func:`search`."""
    arch = arch_of(model)
    n = len(model.get_submodule(arch.layers))
    if kind == "edges":
        targets = (f"{arch.layers}.0.*", f"{arch.layers}.{n - 1}.*")
    elif kind == "down":
        targets = (f"*.{arch.down}",)
    else:
        raise ValueError(f"heuristic must be edges or down, got {kind!r}")
    rules = [Rule(("*",), base.scheme), Rule(targets, high.scheme)]
    return Recipe(name=f"{base.name}+{high.name}-{kind}", rules=tuple(rules),
                  description=f"{base.name}, {'first and last layers' if kind == 'edges' else 'down_proj'} in {high.name}",
                  algorithms=algorithms or Algorithms())
