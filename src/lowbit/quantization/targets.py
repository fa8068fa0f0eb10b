"""What each Linear of a model gets, before any weight is touched: the recipe's plan
resolved against the model, fused siblings and their shared global scales, the input
quantizers with their calibrated scales, and the KV plan.

Shared by plain rounding (:mod:`.rounding`) and the layer-by-layer pass (:mod:`.layerwise`,
:mod:`.layerpass`); it changes nothing.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from ..models.arch import arch_of, decoder_layers, expert_groups
from ..numerics.qtensor import QParams
from ..numerics.scheme import Scheme
from .calibrate import CalibStats
from .kv import kv_plan
from .recipe import Recipe
from .runtime import ActQuant

__all__ = ["sibling_groups", "shared_global_scales", "activation_plan", "kv_plan_from", "layer_index"]

log = logging.getLogger(__name__)


def layer_index(layers: str):
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
    gate/up, each expert's gate/up): they must share an NVFP4 global scale."""
    arch = arch_of(model)
    prefix = arch.layers
    groups = []
    for i in range(len(decoder_layers(model))):
        for b in arch.balances:
            if len(b.next) > 1:
                groups.append(tuple(f"{prefix}.{i}.{n}" for n in b.next))
    return groups + expert_groups(model)


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


_EXPERT = re.compile(r"(.*\.experts\.)(\d+)(\..*)")


def _pooled_expert_absmax(name: str, stats: CalibStats) -> torch.Tensor | None:
    """For a MoE expert's Linear that no calibration token reached: the channel absmax of
    the same Linear pooled (max) over the layer's experts that were reached (in the
    layer-by-layer pass: those quantized before it), else ``None``."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    head, _, tail = m.groups()
    seen = [v for k, v in stats.input_absmax.items()
            if (mk := _EXPERT.fullmatch(k)) is not None and mk.group(1) == head and mk.group(3) == tail]
    if not seen:
        return None
    log.warning("%s saw no calibration tokens: its static input scale is pooled over the %d experts of its "
                "layer that did", name, len(seen))
    return torch.stack(seen).amax(0)


def _act_quant(
    name: str, scheme: Scheme, stats: CalibStats | None, rotation: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> ActQuant:
    if scheme.dynamic and not scheme.global_scale:
        return ActQuant(scheme, rotation=rotation, keep=keep)
    absmax = None
    if stats is not None:
        absmax = stats.input_absmax.get(name)
        if absmax is None:
            absmax = _pooled_expert_absmax(name, stats)
    if absmax is None:
        raise ValueError(
            f"the input scheme of {name} ({scheme}) needs calibrated scales; run with calibration data"
        )
    absmax = absmax.float()
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


def kv_plan_from(recipe: Recipe, stats: CalibStats | None):
    """The KV plan of ``recipe`` with static scales from ``stats``."""
    if recipe.kv_cache is None:
        return None
    return kv_plan(recipe.kv_cache, stats.k_absmax if stats else {}, stats.v_absmax if stats else {},
                   stats.k_moments if stats else {})
