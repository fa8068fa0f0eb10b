"""Plain rounding: every weight to its scheme's min-max grid, one decoder layer at a time.

Input and KV quantization are described in the returned :class:`~lowbit.quantization.runtime.QuantState`
(static scales from calibration statistics) and applied by
:func:`~lowbit.quantization.runtime.quantized_execution`.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable

import torch
from torch import nn

from ..models.arch import arch_of, decoder_layers
from ..models.offload import LayerStore
from ..numerics.qtensor import NonFiniteError, compute_qparams, dequantize, fake_quantize, quantize as quantize_tensor
from ..numerics.scheme import Scheme
from ..util.progress import progress_bar
from .calibrate import CalibStats
from .recipe import Recipe
from .runtime import QuantState
from .targets import activation_plan, kv_plan_from, layer_index, shared_global_scales, sibling_groups

__all__ = ["round_model"]

log = logging.getLogger(__name__)


def _round_weight(mod: nn.Module, name: str, scheme: Scheme, global_scale: torch.Tensor | None, keep_qtensor: bool,
                  state: QuantState) -> None:
    """Round ``mod``'s weight to ``scheme`` in place (min-max scales), recording it in ``state``."""
    w = mod.weight.detach()
    try:
        qp = compute_qparams(w, scheme, global_scale)
    except NonFiniteError as e:
        raise NonFiniteError(f"weight of {name}: {e}") from None
    if keep_qtensor:
        qt = quantize_tensor(w, scheme, qp)
        state.weights[name] = qt
        new = dequantize(qt, w.dtype)
    else:
        new = fake_quantize(w, scheme, qp)
    mod.weight.copy_(new)
    state.weight_schemes[name] = scheme


@torch.no_grad()
def round_model(
    model: nn.Module,
    recipe: Recipe,
    stats: CalibStats | None = None,
    *,
    keep_qtensors: bool = False,
    only: str | None = None,
    progress: bool = True,
    store: LayerStore | None = None,
    on_layer: Callable[[int, QuantState], None] | None = None,
) -> QuantState:
    """Round ``model``'s weights in place as ``recipe`` says (min-max scales); inputs and KV
    get the recipe's quantizers, static ones scaled from ``stats``.

    Arguments as :func:`lowbit.quantization.pipeline.quantize`; ``only`` (a glob) restricts
    the weights and inputs quantized to the matching Linears, and leaves the KV cache alone.
    """
    arch = arch_of(model)
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    plan = recipe.resolve(names)
    if only is not None:
        plan = {n: v for n, v in plan.items() if fnmatch.fnmatchcase(n, only)}
    if recipe.needs_calibration and stats is None:
        raise ValueError(f"recipe {recipe.name!r} has static (calibrated) scales; it needs calibration statistics")
    state = QuantState(recipe)
    state.activations = activation_plan(plan, stats)
    if only is None:
        state.kv = kv_plan_from(recipe, stats)
    layer_of = layer_index(arch.layers)
    by_part: dict[int | None, list[str]] = {}  # decoder layer (None: outside the layers) → its Linears
    for n in plan:
        by_part.setdefault(layer_of(n), []).append(n)
    if store is not None or on_layer is not None:  # every layer, also those with nothing to quantize
        by_part = {k: by_part.get(k, []) for k in (None, *range(len(decoder_layers(model))))}
    siblings = sibling_groups(model)
    for part, part_names in progress_bar(list(by_part.items()), f"quantizing ({recipe.name})", enabled=progress):
        if store is not None and part is not None:
            store.load(part)
        # fused siblings share a global scale; they are always in the same layer
        shared = shared_global_scales(modules, {n: plan[n] for n in part_names}, siblings)
        for name in part_names:
            if plan[name][0] is not None:
                _round_weight(modules[name], name, plan[name][0], shared.get(name), keep_qtensors, state)
        if part is not None:
            if on_layer is not None:
                on_layer(part, state)
            if store is not None:
                store.release(part)
    log.info("quantized %d weights, %d inputs with %s", len(state.weight_schemes), len(state.activations), recipe.name)
    return state
