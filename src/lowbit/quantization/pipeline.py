"""``quantize(model, recipe, calibration)``: the one entry point that decides how a model is
quantized, and the only code path that changes a model.

- A recipe with calibration methods (rotations, SmoothQuant, AWQ, GPTQ, an MSE observer,
  outlier channels) runs the layer-by-layer pass (:mod:`.layerwise`) over ``calibration``:
  each decoder layer sees the outputs of the quantized layers before it.
- A recipe whose only data-dependent parts are static scales (static activations, a
  calibrated KV cache, NVFP4's activation global scale) rounds weights to nearest
  (:mod:`.rounding`) and takes the scales from calibration statistics of the float model —
  given as ``stats`` (e.g. from a cache), or collected from ``calibration``.  A lazily
  loaded model (``store``) cannot run whole, so there the layer-by-layer pass computes the
  scales layer by layer.
- Anything else is plain rounding and needs no data.

Mixture-of-experts models: transformers' fused experts modules are first replaced by
per-expert Linears computing the same function (:func:`lowbit.models.experts.unfuse_experts`),
so each expert is quantized with its own scales like any Linear, and addressed by name
(``*.experts.*.down_proj``); routers are not Linears and stay in high precision.

Weights are fake-quantized in place (the model keeps running in its float dtype, with
weights exactly representable in the target scheme); the QTensor of each weight is kept on
request for export.  Input and KV quantization are described in the returned
:class:`~lowbit.quantization.runtime.QuantState` and applied by
:func:`~lowbit.quantization.runtime.quantized_execution`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..models.arch import arch_of
from ..models.experts import is_moe, unfuse_experts
from ..models.offload import LayerStore, is_lazy
from .calibrate import CalibStats, collect_stats
from .layerwise import quantize_layerwise
from .recipe import Recipe
from .rounding import round_model
from .runtime import QuantState
from .targets import sibling_groups

log = logging.getLogger(__name__)

__all__ = ["quantize", "sibling_groups", "needs_data", "linear_names"]


def needs_data(recipe: Recipe) -> bool:
    """Whether quantizing with ``recipe`` reads calibration data (windows or statistics)."""
    return recipe.needs_calibration or recipe.algorithms.layerwise


@torch.no_grad()
def _check_targets(model: nn.Module, recipe: Recipe) -> None:
    """Warn about a rule whose targets match no Linear of ``model`` (``lowbit quantize``
    refuses it: :mod:`lowbit.workflows.ship`); a rule matching nothing can still be meant,
    e.g. to run a rotation without quantizing weights."""
    msg = recipe.unmatched(linear_names(model))
    if msg:
        log.warning("%s", msg)


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize(
    model: nn.Module,
    recipe: Recipe,
    calibration: torch.Tensor | None = None,
    *,
    stats: CalibStats | Callable[[], CalibStats] | None = None,
    keep_qtensors: bool = False,
    only: str | None = None,
    progress: bool = True,
    store: LayerStore | None = None,
    on_layer: Callable[[int, QuantState], None] | None = None,
    device: torch.device | str | None = None,
) -> QuantState:
    """Quantize ``model`` in place as ``recipe`` says.

    Args:
        model: a transformers causal LM of a known architecture (:mod:`lowbit.models.arch`).
        recipe: which modules get which schemes, and the calibration methods.
        calibration: ``(n, seq)`` calibration token windows; required when the recipe
            has calibration methods, or static scales and no ``stats``.
        stats: calibration statistics of the float model for static scales, or a
            function returning them (called only if the recipe needs them: a cache can
            be handed over without computing it).
        keep_qtensors: keep the :class:`QTensor` of every quantized weight (for export).
        only: a glob over module names: quantize only the matching Linears (and not the
            KV cache) — for sensitivity studies; plain rounding only.
        progress: show a progress bar.
        store: the :class:`~lowbit.models.offload.LayerStore` of a lazily loaded model:
            one decoder layer is in memory at a time, and the layers are left released
            (``store.materialize()`` loads them back).
        on_layer: called as ``on_layer(i, state)`` when decoder layer ``i`` is done
            (quantized, still in memory; ``state`` has its QTensors, input and KV scales),
            for every layer in order — e.g.
            :meth:`lowbit.checkpoint.stream.LayerwiseExport.layer_done`.
        device: the layer-by-layer pass runs each decoder layer there, one at a time,
            while the model stays where it is (CPU memory, or ``store``'s disk); see
            :func:`~lowbit.quantization.layerwise.quantize_layerwise`.  Plain rounding
            rounds each weight where it is (it reads no data and costs one pass over the
            weights).

    Returns:
        The :class:`QuantState` that :func:`~lowbit.quantization.runtime.quantized_execution` runs.

    Raises:
        ValueError: an unsupported architecture (before any work), missing calibration
            data, ``only`` with calibration methods, a lazy model without its store.
    """
    arch_of(model)  # unsupported architectures fail here, before any work
    if store is not None and is_moe(model):
        raise ValueError("lazily loaded mixture-of-experts models are not supported yet: load the model whole")
    unfuse_experts(model)  # fused MoE experts become per-expert Linears (same function; lowbit.models.experts)
    _check_targets(model, recipe)
    if store is None and is_lazy(model):
        raise ValueError("the model has parameters on the meta device (loaded lazily): pass its LayerStore")
    layer_by_layer = recipe.algorithms.layerwise or (recipe.needs_calibration and store is not None and stats is None)
    if layer_by_layer:
        if only is not None:
            raise ValueError("calibration algorithms run on whole models; `only` works with plain rounding")
        if calibration is None:
            raise ValueError(f"recipe {recipe.name!r} uses calibration algorithms; it needs calibration windows")
        return quantize_layerwise(model, recipe, calibration, keep_qtensors=keep_qtensors, progress=progress,
                                  store=store, on_layer=on_layer, device=device)
    resolved = None
    if recipe.needs_calibration:
        if callable(stats):
            resolved = stats()
        elif stats is not None:
            resolved = stats
        elif calibration is not None:
            resolved = collect_stats(model, calibration, progress=progress)
        else:
            raise ValueError(f"recipe {recipe.name!r} has static (calibrated) scales; "
                             "it needs calibration windows or statistics")
    return round_model(model, recipe, resolved, keep_qtensors=keep_qtensors, only=only, progress=progress,
                       store=store, on_layer=on_layer)
