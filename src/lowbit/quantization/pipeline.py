"""``quantize(model, recipe, stats)``: the only code that changes a model.

Weights are fake-quantized in place (the model keeps running in its float dtype, with
weights that are exactly representable in the target scheme); the QTensor of each
weight is kept on request for export.  Input and KV quantization are described in the
returned :class:`~lowbit.runtime.QuantState` and applied by
:func:`~lowbit.runtime.quantized_execution`.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable

import torch
from torch import nn

from .calibrate import CalibStats
from .kv import kv_plan
from ..models.arch import arch_of, decoder_layers
from ..models.offload import LayerStore, is_lazy
from ..util.progress import progress_bar
from ..numerics.qtensor import NonFiniteError, QParams, compute_qparams, dequantize, fake_quantize, quantize as quantize_tensor
from .recipe import Recipe
from .runtime import ActQuant, QuantState
from ..numerics.scheme import Scheme

__all__ = ["quantize", "sibling_groups"]

log = logging.getLogger(__name__)


def _layer_index(layers: str):
    """``name → i`` for a module inside decoder layer ``i`` (``layers`` is the ModuleList's
    path), else ``None``."""
    head = layers + "."

    def index(name: str) -> int | None:
        if not name.startswith(head):
            return None
        return int(name[len(head):].split(".", 1)[0])

    return index


def sibling_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Linears that read the same input and that runtimes fuse into one matmul (q/k/v,
    gate/up): they must share an NVFP4 global scale."""
    arch = arch_of(model)
    prefix = arch.layers
    groups = []
    for i in range(len(decoder_layers(model))):
        for b in arch.balances:
            if len(b.next) > 1:
                groups.append(tuple(f"{prefix}.{i}.{n}" for n in b.next))
    return groups


def shared_global_scales(
    modules: dict[str, nn.Module], plan: dict[str, tuple[Scheme | None, Scheme | None]], groups: list[tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    out = {}
    for g in groups:
        members = [n for n in g if n in plan and plan[n][0] is not None and plan[n][0].global_scale]
        if len(members) < 2:
            continue
        schemes = {plan[n][0] for n in members}
        if len(schemes) > 1:
            continue  # different schemes on fused siblings: nothing to share
        scheme = schemes.pop()
        amax = torch.stack([modules[n].weight.detach().abs().max().float() for n in members]).max()
        for n in members:
            out[n] = scheme.global_scale_from_amax(amax)
    return out


def _act_quant(
    name: str, scheme: Scheme, stats: CalibStats | None, rotation: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> ActQuant:
    if scheme.dynamic and not scheme.global_scale:
        return ActQuant(scheme, rotation=rotation, keep=keep)
    if stats is None or name not in stats.input_absmax:
        raise ValueError(
            f"the input scheme of {name} ({scheme}) needs calibrated scales; run with calibration data"
        )
    absmax = stats.input_absmax[name].float()
    if keep is not None and keep.numel():
        absmax = absmax.clone()
        absmax[keep] = 0  # kept channels stay in high precision: they must not set the scale
    amax = absmax.max()
    if scheme.global_scale:
        return ActQuant(scheme, global_scale=scheme.global_scale_from_amax(amax), rotation=rotation, keep=keep)
    if scheme.granularity.kind != "tensor":
        raise ValueError(
            f"{name}: a static input scale needs tensor granularity, got {scheme.granularity}; "
            "use a dynamic scheme (e.g. fp8-token) for finer granularity"
        )
    scale, zero = scheme.scales_from_range(-amax.reshape(1, 1), amax.reshape(1, 1))
    return ActQuant(scheme, qparams=QParams(scale, zero), rotation=rotation, keep=keep)


def activation_plan(
    plan: dict[str, tuple[Scheme | None, Scheme | None]],
    stats: CalibStats | None,
    rotations: dict[str, torch.Tensor] | None = None,
    keep: dict[str, torch.Tensor] | None = None,
) -> dict[str, ActQuant]:
    """How each Linear's input is quantized (and rotated), from the recipe's plan and the
    calibration statistics."""
    rotations, keep = rotations or {}, keep or {}
    out = {}
    for name, (_, ischeme) in plan.items():
        if ischeme is not None:
            out[name] = _act_quant(name, ischeme, stats, rotations.get(name), keep.get(name))
        elif name in rotations:
            out[name] = ActQuant(None, rotation=rotations[name])
    return out


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


def kv_plan_from(recipe: Recipe, stats: CalibStats | None):
    """The KV plan of ``recipe`` with static scales from ``stats``."""
    if recipe.kv_cache is None:
        return None
    return kv_plan(recipe.kv_cache, stats.k_absmax if stats else {}, stats.v_absmax if stats else {})


@torch.no_grad()
def quantize(
    model: nn.Module,
    recipe: Recipe,
    stats: CalibStats | None = None,
    *,
    keep_qtensors: bool = False,
    only: str | None = None,
    calibration: torch.Tensor | None = None,
    progress: bool = True,
    store: LayerStore | None = None,
    on_layer: Callable[[int, QuantState], None] | None = None,
) -> QuantState:
    """Quantize ``model`` in place by round-to-nearest as ``recipe`` says.

    Args:
        model: a transformers causal LM of a known architecture (``lowbit.models``).
        recipe: which modules get which schemes.
        stats: calibration statistics, required when the recipe has static scales.
        keep_qtensors: keep the :class:`QTensor` of every quantized weight (for export).
        only: a glob over module names: quantize only the matching Linears (and not
            the KV cache) — for sensitivity studies.
        calibration: ``(n, seq)`` calibration windows, required when the recipe has
            calibration algorithms (they run layer by layer, see :mod:`lowbit.layerwise`).
        progress: show a progress bar.
        store: the :class:`~lowbit.offload.LayerStore` of a lazily loaded model: one
            decoder layer is in memory at a time, and the layers are left released
            (``store.materialize()`` loads them back).
        on_layer: called as ``on_layer(i, state)`` when decoder layer ``i`` is done
            (quantized, still in memory; ``state`` has its QTensors, input and KV scales),
            for every layer in order — e.g. :meth:`lowbit.export.stream.LayerwiseExport.layer_done`.

    Returns:
        The :class:`QuantState` that :func:`~lowbit.runtime.quantized_execution` runs.
    """
    arch = arch_of(model)  # unsupported architectures fail here, before any work
    if store is None and is_lazy(model):
        raise ValueError("the model has parameters on the meta device (loaded lazily): pass its LayerStore")
    if recipe.algorithms.layerwise:
        if only is not None:
            raise ValueError("calibration algorithms run on whole models; `only` works with plain rounding")
        if calibration is None:
            raise ValueError(f"recipe {recipe.name!r} uses calibration algorithms; it needs calibration windows")
        from .layerwise import quantize_layerwise

        return quantize_layerwise(model, recipe, calibration, keep_qtensors=keep_qtensors, progress=progress,
                                  store=store, on_layer=on_layer)
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
    layer_of = _layer_index(arch.layers)
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
