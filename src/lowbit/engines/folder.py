"""What a lowbit folder records about how it was made, and lowbit's prediction of it.

``lowbit quantize`` writes the recipe into the folder's model card (``README.md``)::

    # smollm2-135m — quantized with lowbit 0.1.0
    Recipe: `w8a8-int8` — `*: W[int8-channel] A[int8-token]`

The name gives the preset back (its summary must equal the card's, or the card describes a
custom recipe and ``--recipe FILE`` must give it).  :func:`prediction_state` then re-creates
the :class:`QuantState` of the checkpoint around its stored weights: each quantized Linear's
input scheme (dynamic, or static with the ``input_scale`` stored in the folder) and the KV
plan from the stored ``k_scale`` / ``v_scale`` — what ``quantize_to_folder`` evaluates.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from ..models.offload import checkpoint_files, read_tensors
from ..numerics.qtensor import QParams
from ..quantization.kv import KVPlan
from ..quantization.recipe import Recipe, load_recipe
from ..quantization.runtime import ActQuant, QuantState

__all__ = ["FolderRecipe", "read_card", "folder_recipe", "prediction_state", "source_model"]

_TITLE = re.compile(r"^# (?P<model>.+?) — quantized with lowbit (?P<version>\S+)\s*$", re.M)
_RECIPE = re.compile(r"^Recipe: `(?P<name>[^`]+)` — `(?P<summary>[^`]*)`\s*$", re.M)


@dataclass(frozen=True)
class FolderRecipe:
    """The model card's record: the source model's name, lowbit's version, the recipe."""

    model: str
    lowbit_version: str
    recipe: str
    summary: str

    def to_dict(self) -> dict:
        return asdict(self)


def read_card(folder: Path) -> FolderRecipe | None:
    """The recipe recorded in ``folder/README.md`` (``None``: no lowbit card there)."""
    path = Path(folder) / "README.md"
    if not path.is_file():
        return None
    text = path.read_text()
    t, r = _TITLE.search(text), _RECIPE.search(text)
    if t is None or r is None:
        return None
    return FolderRecipe(t["model"], t["version"], r["name"], r["summary"])


def folder_recipe(folder: Path, recipe: str | Path | None = None) -> Recipe:
    """The recipe ``folder`` was made with: ``recipe`` if given, else the card's preset.

    Raises:
        ValueError: no lowbit card and no ``recipe``; a card naming a recipe that is not a
            preset, or whose text differs from the preset of that name.
    """
    folder = Path(folder)
    card = read_card(folder)
    if recipe is not None:
        r = load_recipe(recipe)
        if card is not None and card.summary != r.summary():
            raise ValueError(f"{folder}: the model card records `{card.summary}`, the recipe given is "
                             f"`{r.summary()}`; pass the recipe the folder was written with")
        return r
    if card is None:
        raise ValueError(f"{folder}: no lowbit model card (README.md with the recipe); pass --recipe NAME_OR_FILE")
    try:
        r = load_recipe(card.recipe)
    except (ValueError, FileNotFoundError):
        raise ValueError(f"{folder}: the card's recipe {card.recipe!r} is not a preset; pass --recipe FILE") from None
    if r.summary() != card.summary:
        raise ValueError(f"{folder}: the card's recipe {card.recipe!r} reads `{card.summary}` but the preset of that "
                         f"name is `{r.summary()}`; pass --recipe FILE")
    return r


def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def prediction_state(model: nn.Module, folder: Path, recipe: Recipe) -> QuantState:
    """The :class:`QuantState` that runs ``folder``'s activation and KV quantization on
    ``model`` (whose weights are the folder's, see :func:`lowbit.checkpoint.write.read_into`).

    Static scales are the folder's own tensors.  Raises ValueError when the folder and the
    recipe disagree (a Linear the recipe quantizes stores no ``weight_scale``, a static
    input without ``input_scale``, a KV recipe without ``k_scale``).
    """
    from ..models.arch import arch_of

    folder = Path(folder)
    files = checkpoint_files(folder)
    wanted = [k for k in files if k.endswith(("input_scale", "k_scale", "v_scale", "weight_scale",
                                              "input_global_scale"))]
    stored = read_tensors(files, wanted)
    plan = recipe.resolve(_linears(model))
    state = QuantState(recipe)
    for name, (w, i) in plan.items():
        if w is not None:
            if f"{name}.weight_scale" not in stored:
                raise ValueError(f"{folder}: recipe {recipe.name!r} quantizes {name} but the folder stores no "
                                 f"{name}.weight_scale; the folder was not written with this recipe")
            state.weight_schemes[name] = w
        if i is None:
            continue
        if i.dynamic and not i.global_scale:
            state.activations[name] = ActQuant(i)
        elif i.global_scale:
            raise ValueError(f"{folder}: two-level input scales ({i}) are not re-created by lowbit verify")
        else:
            key = f"{name}.input_scale"
            if key not in stored:
                raise ValueError(f"{folder}: {name} has a static input scheme ({i}) but no {key}")
            state.activations[name] = ActQuant(i, qparams=QParams(stored[key].float().reshape(1, 1), None))
    if recipe.kv_cache is not None:
        arch = arch_of(model)
        k_amax, v_amax = {}, {}
        fmt_max = recipe.kv_cache.scheme.format.max
        for layer in range(model.config.num_hidden_layers):
            prefix = f"{arch.layers}.{layer}.{arch.attn}"
            if f"{prefix}.k_scale" not in stored:
                raise ValueError(f"{folder}: recipe {recipe.name!r} quantizes the KV cache but {prefix}.k_scale "
                                 "is not stored")
            # the stored scale is amax / max of the format (kv_args: one per-tensor FP8 scale)
            k_amax[layer] = (stored[f"{prefix}.k_scale"].float() * fmt_max).reshape(1)
            v_amax[layer] = (stored[f"{prefix}.v_scale"].float() * fmt_max).reshape(1)
        state.kv = KVPlan(recipe.kv_cache, k_amax, v_amax)
    return state


def source_model(folder: Path, reference: str | None) -> str:
    """The unquantized model to compare with: ``reference`` if given, else the card's
    model name when it is a packaged model or an existing folder.

    Raises:
        ValueError: neither (the message asks for ``--reference``).
    """
    if reference:
        return reference
    from ..models.assets import MODEL_ASSETS

    card = read_card(folder)
    if card is not None and (card.model in MODEL_ASSETS or Path(card.model).is_dir()):
        return card.model
    named = f" (its card names {card.model!r})" if card else ""
    raise ValueError(f"{folder}: cannot tell the unquantized model{named}; pass --reference MODEL")
