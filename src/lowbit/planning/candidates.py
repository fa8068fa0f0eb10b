"""Candidates: a recipe (what lowbit measures) paired with the simulator plan it maps to.

The mapping recipe → plan is read off the recipe's schemes, not looked up in a table:

- weights: the preset equal to the recipe's weight scheme (sizes then come from
  ``bits_per_element`` at each linear's real shape);
- activations: the preset equal to its input scheme, and the math lane named by that
  scheme's element format (``fp8``, ``int8``, ``fp4``; no quantized input: ``bf16``,
  weight-only);
- KV cache: the recipe's KV element width (8 or 16 bits).

The default candidate set comes from the GPU table: every recipe of :data:`DEFAULT_POOL`
whose lane the GPU has (``peak_tflops`` in ``gpus.yaml``; weight-only recipes run on the
BF16 lane, which every GPU has), plus BF16, each with and without an FP8 KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..evaluation.compare import kv_bits
from ..numerics.formats import Format
from ..numerics.scheme import PRESETS, Scheme
from ..quantization.recipe import RECIPES, Recipe, load_recipe
from ..sim.hardware import GPU, LANES
from ..sim.plans import PLANS, Plan

__all__ = ["Candidate", "DEFAULT_POOL", "DEFAULT_KV", "BASELINE", "recipe_plan", "parse_candidate",
           "default_candidates", "sim_plan_name"]

#: what ``lowbit plan`` considers by default, before the GPU's lanes filter it: per scheme family
#: the recipe with lowbit's best calibration that stays within a few minutes on a CPU
#: (W4A16: GPTQ; W4A4 NVFP4: GPTQ; FP8 / INT8 W8A8: round-to-nearest is already within ~2-3%)
DEFAULT_POOL: tuple[str, ...] = ("fp8-dynamic", "fp8-block", "w8a8-int8", "w4a16-gptq-g128", "nvfp4-gptq", "mxfp4")

#: the KV-cache recipe every default candidate is also planned with
DEFAULT_KV = "kv-fp8"

#: the unquantized model's candidate name (its accuracy row is the reference)
BASELINE = "bf16"


@dataclass(frozen=True)
class Candidate:
    """One option: ``recipe`` is what gets measured (``None``: the unquantized model),
    ``plan`` how the simulator sizes and times it (before a GPU's lane fallback); ``base``
    the candidate it extends with a KV-cache recipe (``fp8-dynamic`` for
    ``fp8-dynamic+kv-fp8``), or ``None``."""

    name: str
    recipe: Recipe | None
    plan: Plan
    base: str | None = None

    @property
    def description(self) -> str:
        return self.recipe.description if self.recipe is not None else "unquantized (BF16 weights, BF16 KV cache)"

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "recipe": self.recipe.name if self.recipe is not None else None,
                "base": self.base, "plan": self.plan.to_dict(), "sim_plan": sim_plan_name(self.plan)}


def _lane(fmt: Format) -> str:
    """The math lane whose tensor cores take inputs of ``fmt``: ``fp8``, ``int8``, ``fp4``."""
    lane = {"float": "fp", "int": "int"}.get(fmt.kind, fmt.kind) + str(fmt.bits)
    if lane not in LANES:
        raise ValueError(f"no GPU math lane takes {fmt.name} inputs (lanes: {', '.join(LANES)})")
    return lane


def _preset_name(scheme: Scheme, role: str, recipe: str) -> str:
    for name, s in PRESETS.items():
        if s == scheme:
            return name
    raise ValueError(f"recipe {recipe!r}: its {role} scheme ({scheme}) is not a preset scheme; the simulator "
                     f"sizes and times preset schemes only ({', '.join(PRESETS)})")


def recipe_plan(recipe: Recipe | None, name: str | None = None) -> Plan:
    """The simulator :class:`Plan` of ``recipe`` (``None``: BF16), named ``name`` (default the recipe's name).

    Raises:
        ValueError: the recipe gives different decoder linears different schemes, quantizes
            inputs without weights, uses a non-preset scheme, or a KV cache the simulator does
            not model (only 8 or 16 bits, keys and values alike).
    """
    if recipe is None:
        return replace(PLANS["bf16"], name=name or BASELINE)
    name = name or recipe.name
    rules = [r for r in recipe.rules if r.weights is not None or r.inputs is not None]
    if any(r.targets != ("*",) for r in rules) or len({(r.weights, r.inputs) for r in rules}) > 1:
        raise ValueError(f"recipe {recipe.name!r} gives different linears different schemes; the simulator gives all "
                         "decoder linears one scheme, so plan each scheme as its own recipe")
    weights = inputs = None
    if rules:
        weights, inputs = rules[0].weights, rules[0].inputs
    if inputs is not None and weights is None:
        raise ValueError(f"recipe {recipe.name!r} quantizes inputs but not weights: no serving kernel does that")
    kv = kv_bits(recipe)
    if kv not in (8.0, 16.0):
        raise ValueError(f"recipe {recipe.name!r}: a KV cache of {kv:g} bits per element on average; the simulator "
                         "models 8-bit (FP8) or 16-bit KV caches, keys and values alike")
    return Plan(name=name, weights=None if weights is None else _preset_name(weights, "weight", recipe.name),
                activations=None if inputs is None else _preset_name(inputs, "input", recipe.name),
                lane="bf16" if inputs is None else _lane(inputs.format), kv_bytes=kv / 8)


def sim_plan_name(plan: Plan) -> str | None:
    """The name ``lowbit simulate --quant`` knows the same plan by (``fp8+kv-fp8``), or ``None``."""
    for key, p in PLANS.items():
        if (p.weights, p.activations, p.lane) == (plan.weights, plan.activations, plan.lane):
            return key + ("+kv-fp8" if plan.kv_bytes == 1.0 else "")
    return None


def _with_kv(recipe: Recipe, kv: Recipe) -> Recipe:
    if recipe.kv_cache is not None:
        raise ValueError(f"recipe {recipe.name!r} already quantizes the KV cache; cannot add {kv.name!r}")
    return replace(recipe, name=f"{recipe.name}+{kv.name}", kv_cache=kv.kv_cache,
                   description=f"{recipe.description}; {kv.description}")


def parse_candidate(text: str) -> Candidate:
    """``fp8-dynamic``, ``fp8-dynamic+kv-fp8``, ``bf16``, ``bf16+kv-fp8`` (= the ``kv-fp8`` preset) or a YAML path.

    The part after ``+`` must be a KV-cache-only recipe.  Errors name the unknown part.
    """
    text = text.strip()
    if not text:
        raise ValueError("empty candidate name")
    base, *extras = text.split("+")
    recipe = None if base == BASELINE else load_recipe(base)
    for e in extras:
        kv = load_recipe(e)
        if kv.rules or kv.kv_cache is None:
            raise ValueError(f"candidate {text!r}: '+{e}' must be a KV-cache-only recipe such as {DEFAULT_KV}")
        recipe = kv if recipe is None else _with_kv(recipe, kv)  # bf16+kv-fp8 is the kv-fp8 preset itself
    return Candidate(text, recipe, recipe_plan(recipe, text), base if extras else None)


def default_candidates(gpu: GPU, pool: tuple[str, ...] = DEFAULT_POOL, kv: str | None = DEFAULT_KV) -> list[Candidate]:
    """BF16 and every recipe of ``pool`` whose math lane ``gpu`` has, each also with ``kv`` (``None``: without)."""
    names = [BASELINE] + [r for r in pool if gpu.has_lane(recipe_plan(RECIPES[r]).lane)]
    out = []
    for n in names:
        out.append(parse_candidate(n))
        if kv is not None:
            out.append(parse_candidate(f"{n}+{kv}"))
    return out
