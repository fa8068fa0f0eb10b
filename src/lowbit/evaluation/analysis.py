"""Where the damage comes from: per-module sensitivity, and the KV cache's signal and error.

``sensitivity`` quantizes one module type (all q_proj, all down_proj, ...), one decoder
layer, or (mixture-of-experts models) one routed expert of one layer at a time and ranks
them by KL divergence from the reference.  ``kv_stats`` looks
at what each layer writes to the KV cache — the keys' range, median and outlier channels,
the values' range — and at the error FP8 makes of it with one scale per layer and with
one per head, next to the perplexity of K-only, V-only and per-head FP8 caches — and at the
error against the signal: each K channel's mean and standard deviation across tokens, the
largest |mean| / std (a channel that is mostly a constant offset), and the error relative to
the across-token variation, for FP8 as is and for the two remedies (a calibrated key mean
subtracted first; INT8 with a scale and zero point per channel).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from .compare import Comparison, Row, Workbench
from ..numerics.granularity import HEAD
from ..quantization.kv import cache_kwarg, make_cache, quantize_kv
from ..models.arch import arch_of, decoder_layers
from ..models.experts import expert_units
from ..quantization.recipe import RECIPES, Recipe
from ..quantization.runtime import input_device
from ..numerics.scheme import PRESETS, Scheme

__all__ = ["SensitivityRow", "Sensitivity", "sensitivity", "KVLayerStats", "KVStats", "kv_stats", "KV_RECIPES"]


@dataclass(frozen=True)
class SensitivityRow:
    kind: str  # "type", "layer" or "expert"
    target: str  # e.g. "mlp.down_proj", "model.layers.3" or "model.layers.3.mlp.experts.5"
    row: Row

    def to_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "row": self.row.to_dict()}


@dataclass
class Sensitivity:
    model: str
    recipe: str
    windows: int
    rows: list[SensitivityRow]

    def to_dict(self) -> dict:
        return {"model": self.model, "recipe": self.recipe, "windows": self.windows,
                "rows": [r.to_dict() for r in self.rows]}


def sensitivity(bench: Workbench, recipe: Recipe, *, by_type: bool = True, by_layer: bool = True,
                by_expert: bool = True) -> Sensitivity:
    """Quantize one module type, then one decoder layer, then (``by_expert``, MoE models
    only) one routed expert — its gate, up and down — at a time; most damaging first.
    Each unit is one evaluation: a MoE model adds one per expert per layer."""
    arch = arch_of(bench.model)
    out = []
    if by_type:
        for rel in (arch.q, arch.k, arch.v, arch.o, arch.gate, arch.up, arch.down):
            if rel is not None:
                out.append(SensitivityRow("type", rel, bench.run(recipe, only=f"*.{rel}")))
    if by_layer:
        for i in range(len(decoder_layers(bench.model))):
            target = f"{arch.layers}.{i}"
            out.append(SensitivityRow("layer", target, bench.run(recipe, only=f"{target}.*")))
    if by_expert:
        for target in expert_units(bench.model):
            out.append(SensitivityRow("expert", target, bench.run(recipe, only=f"{target}.*")))
    ranked = sorted(out, key=lambda r: -(r.row.eval.kl_mean or 0.0))
    return Sensitivity(bench.info.name, recipe.name, len(bench.windows), ranked)


@dataclass(frozen=True)
class KVLayerStats:
    layer: int
    k_absmax: float
    k_median: float  # median |k|
    k_channel_spread: float  # largest channel absmax / median channel absmax (outlier channels)
    k_head_spread: float  # largest head absmax / smallest head absmax
    v_absmax: float
    v_median: float
    k_err_tensor: float  # ‖K − Q(K)‖ / ‖K‖ with FP8 and one scale per layer
    k_err_head: float  # ... with one scale per KV head
    v_err_tensor: float
    # against the signal: what each channel varies by across tokens (σ), not its size
    k_bias_ratio: float  # the largest |mean| / std of a K channel across tokens ("constant bias" channel)
    k_err_signal: float  # ‖K − Q(K)‖ / ‖K − mean‖, FP8 one scale per layer (the mean per channel)
    k_err_signal_worst: float  # the largest channel's RMS error / its own std
    k_err_signal_centered: float  # ... calibrated key mean subtracted before FP8 (kv-fp8-k-centered)
    k_err_signal_int8_asym: float  # ... INT8 with a scale and zero point per channel (kv-int8-k-asym)
    v_err_signal: float  # ‖V − Q(V)‖ / ‖V − mean‖, FP8 one scale per layer

    def to_dict(self) -> dict:
        return asdict(self)


#: the evaluated KV recipes: FP8 on K+V, K, V, per head, and the remedies for keys that carry a
#: constant offset (mean subtraction; per-channel scales with zero points)
KV_RECIPES = ("kv-fp8", "kv-fp8-k", "kv-fp8-v", "kv-fp8-head", "kv-fp8-k-centered", "kv-fp8-centered",
              "kv-int8-k-asym")


def _rel_err(t: torch.Tensor, scheme: Scheme, amax: torch.Tensor) -> float:
    q = quantize_kv(t, scheme, amax)
    return float((t - q).norm() / t.norm())


def _signal(t: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """Error of ``q`` against the across-token variation of ``t`` ``(1, heads, tokens, dim)``:
    ``‖t − q‖ / ‖t − mean‖`` overall, and the largest channel's RMS error / std."""
    centered = t - t.mean(dim=2, keepdim=True)
    err = t - q
    per_chan = err.pow(2).mean(dim=2).sqrt() / centered.pow(2).mean(dim=2).sqrt().clamp(min=1e-12)
    return float(err.norm() / centered.norm().clamp(min=1e-12)), float(per_chan.max())


@dataclass
class KVStats:
    layers: list[KVLayerStats]
    comparison: Comparison  # reference and the KV_RECIPES (no rows without perplexity)

    def to_dict(self) -> dict:
        return {"layers": [r.to_dict() for r in self.layers], "comparison": self.comparison.to_dict()}


@torch.inference_mode()
def kv_stats(bench: Workbench, windows: int = 4, *, perplexity: bool = True) -> KVStats:
    """Per-layer K/V statistics on the first ``windows`` evaluation windows, and (when
    ``perplexity``) the evaluation of the FP8 KV recipes in :data:`KV_RECIPES`."""
    ks: dict[int, list[torch.Tensor]] = {}
    vs: dict[int, list[torch.Tensor]] = {}

    def keep(layer, k, v):
        ks.setdefault(layer, []).append(k[0].float().clone())  # (heads, seq, dim)
        vs.setdefault(layer, []).append(v[0].float().clone())
        return k, v

    model = bench.model
    kw = cache_kwarg(model)
    dev = input_device(model)  # None: accelerate's hooks place the inputs
    for i in range(min(windows, len(bench.windows))):
        ids = bench.windows[i : i + 1]
        model(input_ids=ids if dev is None else ids.to(dev), use_cache=True, **{kw: make_cache(model.config, keep)})
    fp8 = PRESETS["fp8-tensor"]
    fp8_head = replace(fp8, granularity=HEAD)
    int8_asym = RECIPES["kv-int8-k-asym"].kv_cache.scheme
    moments = bench.stats.k_moments  # the calibrated key means, as kv-fp8-k-centered uses them
    rows = []
    for layer in sorted(ks):
        k = torch.cat(ks[layer], dim=1)[None]  # (1, heads, tokens, dim)
        v = torch.cat(vs[layer], dim=1)[None]
        ka, va = k.abs(), v.abs()
        chan = ka.amax(dim=(0, 2)).reshape(-1)  # per (head, channel)
        head = ka.amax(dim=(0, 2, 3))
        mean, std = k.mean(dim=2), k.std(dim=2)
        mu = moments[layer].mean[None, :, None, :]
        k_sig, k_worst = _signal(k, quantize_kv(k, fp8, ka.max().reshape(1)))
        k_cen, _ = _signal(k, quantize_kv(k - mu, fp8, (k - mu).abs().max().reshape(1)) + mu)
        k_asym, _ = _signal(k, quantize_kv(k, int8_asym))
        v_sig, _ = _signal(v, quantize_kv(v, fp8, va.max().reshape(1)))
        rows.append(
            KVLayerStats(
                layer=layer,
                k_absmax=float(ka.max()),
                k_median=float(ka.median()),
                k_channel_spread=float(chan.max() / chan.median().clamp(min=1e-12)),
                k_head_spread=float(head.max() / head.min().clamp(min=1e-12)),
                v_absmax=float(va.max()),
                v_median=float(va.median()),
                k_err_tensor=_rel_err(k, fp8, ka.max().reshape(1)),
                k_err_head=_rel_err(k, fp8_head, head),
                v_err_tensor=_rel_err(v, fp8, va.max().reshape(1)),
                k_bias_ratio=float((mean.abs() / std.clamp(min=1e-12)).max()),
                k_err_signal=k_sig,
                k_err_signal_worst=k_worst,
                k_err_signal_centered=k_cen,
                k_err_signal_int8_asym=k_asym,
                v_err_signal=v_sig,
            )
        )
    comparison = bench.describe()
    if perplexity:
        comparison.rows = [bench.reference_row()] + [bench.run(RECIPES[r]) for r in KV_RECIPES]
        comparison.stage_seconds = dict(bench.stage_seconds)
    return KVStats(rows, comparison)
