"""``lowbit compare``: accuracy of each format side by side, on one model and one text.

The reference model's predictions and the calibration statistics are computed once per
(model, data) and cached; each configuration then quantizes a copy of the model and is
evaluated on the same windows against the same reference.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from torch import nn

from ..models.loading import load_model
from ..quantization.recipe import Recipe, load_recipe
from ..util.device import is_default
from ..util.io import write_json
from .rowcache import cached_row, is_cached
from .workbench import (HIGH_PRECISION_BITS, Comparison, Row, Workbench, kv_bits, model_fingerprint,  # noqa: F401
                        weight_bits)

__all__ = ["Row", "Comparison", "Workbench", "compare", "weight_bits", "kv_bits", "load_candidate",
           "evaluate_against_reference", "save_json"]

log = logging.getLogger(__name__)

def compare(bench: Workbench, recipes: list[str], *, on_row: Callable[[Row], None] | None = None) -> Comparison:
    """The reference and each recipe (a preset name or YAML path), evaluated on ``bench``."""

    parsed = [load_recipe(r) for r in recipes]  # bad names fail before any work
    result = bench.describe()
    result.rows.append(bench.reference_row())
    if any(r.needs_calibration and not r.algorithms.layerwise and not is_cached(bench, r) for r in parsed):
        bench.stats  # calibrate once, up front, so that stage times stay separate
    if on_row:
        on_row(result.rows[-1])
    for i, r in enumerate(parsed, 1):
        log.info("config %d/%d: %s (%s)", i, len(parsed), r.name, r.description or r.summary())
        result.rows.append(cached_row(bench, r))  # a row evaluated before is read from <cache>/rows
        e = result.rows[-1].eval
        log.info("%s: perplexity %.3f (%+.2f%%), KL %.4f, top-1 %.3f", r.name, e.ppl, e.delta_pct, e.kl_mean, e.top1)
        if on_row:
            on_row(result.rows[-1])
    result.stage_seconds = dict(bench.stage_seconds)
    return result


def load_candidate(bench: Workbench, model: str) -> nn.Module:
    """``model`` (a packaged name, folder, GGUF or hub id), loaded as it is, to be evaluated
    against ``bench``'s reference.

    Raises:
        ValueError: ``model`` uses another tokenizer than the reference (KL needs one vocabulary).
    """
    placed = {} if is_default(bench.device, bench.dtype) else {"device": bench.device, "dtype": bench.dtype}
    loaded, tok, _ = load_model(model, cache=bench.cache, **placed)  # where the bench's model is
    if bench.tokenizer.get_vocab() != tok.get_vocab():
        raise ValueError(f"{model} and {bench.info.name} use different tokenizers; KL needs one vocabulary")
    return loaded


def evaluate_against_reference(bench: Workbench, recipe: Recipe | None = None, *, model: nn.Module | None = None,
                               name: str | None = None) -> Comparison:
    """``lowbit eval``: the bench's reference, and ``model`` (default: the bench's own model)
    — quantized with ``recipe`` if given — evaluated against it (as row ``name``)."""
    result = bench.describe()
    result.rows.append(bench.reference_row())
    if model is not None or recipe is not None:
        result.rows.append(bench.run(recipe, model=model, name=name))
    result.stage_seconds = dict(bench.stage_seconds)
    return result


def save_json(result, path: Path, force: bool = False) -> Path:
    """``result.to_dict()`` as JSON at ``path`` (atomically; an existing file only with ``force``)."""
    return write_json(Path(path), result.to_dict(), force=force)
