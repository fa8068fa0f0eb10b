"""How to ship the pick: the recipe as YAML (for recipes that are not presets), the exact
``lowbit quantize`` command and the ``vllm serve`` / SGLang commands (from
:func:`lowbit.checkpoint.serve.serve_commands`)."""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ..checkpoint.serve import serve_commands
from ..numerics.scheme import PRESETS, Scheme
from ..quantization.recipe import DEFAULT_IGNORE, RECIPES, Algorithms, Recipe
from .candidates import Candidate

__all__ = ["Commands", "recipe_yaml", "ship_commands"]


@dataclass(frozen=True)
class Commands:
    """``recipe_file``/``recipe_yaml``: set when the recipe is not a preset (write the YAML there first)."""

    candidate: str
    quantize: str | None  # None: nothing to quantize (BF16)
    vllm: str
    sglang: str
    recipe_file: str | None
    recipe_yaml: str | None
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def _scheme(s: Scheme | None):
    if s is None:
        return None
    return next((n for n, p in PRESETS.items() if p == s), None) or s.to_dict()


def recipe_yaml(recipe: Recipe) -> str:
    """``recipe`` as YAML that :func:`lowbit.quantization.recipe.load_recipe` reads back equal."""
    d: dict = {"name": recipe.name, "description": recipe.description}
    if recipe.rules:
        d["rules"] = [{"targets": list(r.targets), "weights": _scheme(r.weights), "inputs": _scheme(r.inputs)}
                      for r in recipe.rules]
    if recipe.ignore != DEFAULT_IGNORE:
        d["ignore"] = list(recipe.ignore)
    if recipe.kv_cache is not None:
        kv = recipe.kv_cache
        d["kv_cache"] = {"scheme": _scheme(kv.scheme), "keys": kv.keys, "values": kv.values}
        if kv.value_scheme is not None:
            d["kv_cache"]["value_scheme"] = _scheme(kv.value_scheme)
    default = Algorithms()
    algos = {k: v for k, v in asdict(recipe.algorithms).items() if v != getattr(default, k)}
    if algos:
        d["algorithms"] = algos
    return yaml.safe_dump(d, sort_keys=False)


def ship_commands(c: Candidate, model: str, served: str | None, tp: int = 1, max_model_len: int = 4096,
                  recipe_dir: str = ".") -> Commands:
    """The commands that turn ``model`` (or, when planning for a sibling, ``served``) into ``c`` and serve it.

    Args:
        c: the candidate.
        model: MODEL as the user gave it (accuracy was measured on it).
        served: the model capacity was planned for when it differs from ``model`` (a built-in
            name or a config.json path), else ``None``.
        tp: tensor-parallel size.
        recipe_dir: where a non-preset recipe's YAML is to be written.
    """
    target = model
    note = ""
    if served is not None:
        p = Path(served)
        target = str(p.parent if p.name == "config.json" else p) if p.exists() else f"path/to/{served}"
        note = (f"accuracy was measured on {model}; these commands quantize and serve {served}, the model capacity "
                f"was planned for — measure it again there (lowbit eval OUT --reference {target}) before serving")
    if c.recipe is None:
        vllm, sglang = serve_commands(target, False, max_model_len, tp)
        return Commands(c.name, None, vllm, sglang, None, None, note or "nothing to quantize")
    preset = RECIPES.get(c.recipe.name) == c.recipe
    file = None if preset else str(Path(recipe_dir) / f"{c.recipe.name}.yaml")
    stem = Path(target).name or "model"
    out = f"{stem}-{c.name}".replace("+", "-")
    quant = (f"lowbit quantize {shlex.quote(target)} --recipe {shlex.quote(c.recipe.name if preset else file)} "
             f"--out {shlex.quote(out)}")
    vllm, sglang = serve_commands(out, c.plan.kv_bytes == 1.0, max_model_len, tp)
    return Commands(c.name, quant, vllm, sglang, file, None if preset else recipe_yaml(c.recipe), note)
