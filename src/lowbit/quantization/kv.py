"""KV-cache quantization where keys and values are written to the cache.

Keys arrive after RoPE (and after QK-norm where the architecture has it), shaped
``(batch, kv_heads, seq, head_dim)``.  They are fake-quantized on the way into the cache,
so attention reads what a quantized cache would hold — the current token's K and V
included, as a paged FP8 cache in vLLM does: every read, in prefill as in decode, sees
quantized K/V.  (vLLM 0.32's CPU backend writes each step's K/V into the paged cache and then
attends over the cache only; its FlashAttention backend does the same, and with an FP8 cache
on FA3 also quantizes the queries to FP8, which this model does not.)  Works with transformers' ``DynamicCache``
built from the model config, so Gemma-3's sliding-window layers keep their own layout.
The one exception is KIVI's full-precision window (:attr:`KVConfig.residual`): there the tokens
of the current write are read as they came (:func:`kv_forward`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..numerics.granularity import TOKEN
from ..numerics.qtensor import QParams, fake_quantize
from .kvconfig import KVConfig
from ..numerics.scheme import Scheme

__all__ = ["KVPlan", "KeyMoments", "kv_plan", "make_cache", "cache_kwarg", "quantize_kv", "KVObserver", "kv_forward"]

OnWrite = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def quantize_kv(t: torch.Tensor, scheme: Scheme, static_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize one layer's keys or values ``(batch, heads, seq, dim)``.

    ``static_amax``: calibrated absmax, a scalar (``tensor``) or one per head (``head``);
    ``None`` computes scales from ``t``.  ``channel`` granularity scales each (head,
    channel) over the tokens of ``t``; ``token`` scales each (head, token) over channels.
    """
    kind = scheme.granularity.kind
    if kind == "channel":
        tt = t.transpose(-1, -2)  # (b, h, dim, seq): one row per channel
        return fake_quantize(tt, replace(scheme, granularity=TOKEN)).transpose(-1, -2)
    if static_amax is None:
        return fake_quantize(t, scheme)
    amax = static_amax.to(t.device, torch.float32).reshape(-1, 1)  # (1, 1) or (heads, 1)
    scale, zero = scheme.scales_from_range(-amax, amax)
    return fake_quantize(t, scheme, QParams(scale, zero))


@dataclass(frozen=True)
class KeyMoments:
    """Per (head, channel) of one layer's keys: the sum, minimum and maximum over ``count``
    tokens — what a calibrated key mean and the range of the centered keys come from."""

    sum: torch.Tensor  # (heads, dim) float64
    min: torch.Tensor  # (heads, dim)
    max: torch.Tensor
    count: int

    @classmethod
    def of(cls, k: torch.Tensor) -> KeyMoments:
        """Of keys ``(batch, heads, seq, dim)``."""
        k = k.detach()
        return cls(k.double().sum(dim=(0, 2)), k.amin(dim=(0, 2)).float(), k.amax(dim=(0, 2)).float(),
                   k.shape[0] * k.shape[2])

    def merge(self, other: KeyMoments) -> KeyMoments:
        return KeyMoments(self.sum + other.sum, torch.minimum(self.min, other.min), torch.maximum(self.max, other.max),
                          self.count + other.count)

    @property
    def mean(self) -> torch.Tensor:
        """``(heads, dim)`` float32."""
        return (self.sum / max(self.count, 1)).float()

    def centered_absmax(self) -> torch.Tensor:
        """Per head, the largest |k − mean| any calibration key had (exact: from each channel's
        minimum and maximum)."""
        m = self.mean
        return torch.maximum(self.max - m, m - self.min).amax(dim=-1)


@dataclass(frozen=True)
class KVPlan:
    """What to do at each layer's cache write: the schemes, calibrated absmax per layer
    (scalar or per head) for static schemes, and the calibrated key means when keys are
    centered (:attr:`KVConfig.center_keys`) — then the keys' absmax is the centered keys'."""

    config: KVConfig
    k_amax: dict[int, torch.Tensor]
    v_amax: dict[int, torch.Tensor]
    k_mean: dict[int, torch.Tensor] | None = None  # (heads, dim) per layer

    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if c.keys:
            amax = None if c.scheme.dynamic else self.k_amax[layer]
            if self.k_mean is not None:
                mu = self.k_mean[layer].to(device=k.device, dtype=k.dtype)[None, :, None, :]
                k = quantize_kv(k - mu, c.scheme, amax) + mu
            else:
                k = quantize_kv(k, c.scheme, amax)
        if c.values:
            v = quantize_kv(v, c.v_scheme, None if c.v_scheme.dynamic else self.v_amax[layer])
        return k, v


def kv_plan(config: KVConfig, k_absmax: dict[int, torch.Tensor], v_absmax: dict[int, torch.Tensor],
            k_moments: dict[int, KeyMoments] | None = None) -> KVPlan:
    """A plan from per-layer, per-head calibrated absmax (see :class:`KVObserver`), and the
    keys' moments when ``config.center_keys``."""

    def reduce(amax: dict[int, torch.Tensor], scheme: Scheme, needed: bool) -> dict[int, torch.Tensor]:
        if not needed or scheme.dynamic:
            return {}
        if not amax:
            raise ValueError("static KV scales need calibration statistics (K/V absmax per layer)")
        if scheme.granularity.kind == "tensor":
            return {i: a.max().reshape(1) for i, a in amax.items()}
        return dict(amax)  # per head

    mean = None
    if config.center_keys:
        if not k_moments:
            raise ValueError("center_keys needs calibration statistics (the keys' per-channel mean per layer)")
        mean = {i: m.mean for i, m in k_moments.items()}
        k_absmax = {i: m.centered_absmax() for i, m in k_moments.items()}
    return KVPlan(config, reduce(k_absmax, config.scheme, config.keys), reduce(v_absmax, config.v_scheme, config.values),
                  mean)


class KVObserver:
    """Records per-layer, per-head absmax of keys and values at the cache write, and the
    keys' per-channel moments (:class:`KeyMoments`)."""

    def __init__(self) -> None:
        self.k_absmax: dict[int, torch.Tensor] = {}
        self.v_absmax: dict[int, torch.Tensor] = {}
        self.k_moments: dict[int, KeyMoments] = {}

    def on_write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for store, t in ((self.k_absmax, k), (self.v_absmax, v)):
            a = t.detach().abs().amax(dim=(0, 2, 3)).float()
            store[layer] = torch.maximum(store[layer], a) if layer in store else a
        m = KeyMoments.of(k)
        self.k_moments[layer] = self.k_moments[layer].merge(m) if layer in self.k_moments else m
        return k, v


def make_cache(config, on_write: OnWrite, *, store: bool = True, fresh_exact: bool = False):
    """A transformers ``DynamicCache`` (laid out from ``config``: sliding-window layers
    included) that passes every write through ``on_write(layer, k, v)``.

    With ``store=False`` nothing is kept: each write returns what ``on_write`` gave, as
    the forward without a cache would use it — for one-shot passes that only observe
    keys and values, which would otherwise hold every chunk's K and V until it ends.
    With ``fresh_exact`` the cache stores what ``on_write`` gave, but attention reads the
    tokens of the current write as they came (KIVI's full-precision group, see
    :attr:`KVConfig.residual`) and the stored ones before them."""
    from transformers import DynamicCache

    class _WriteHookCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = on_write(layer_idx, key_states, value_states)
            if not store:
                return k, v
            k_all, v_all = super().update(k, v, layer_idx, *args, **kwargs)
            if not fresh_exact:
                return k_all, v_all
            n = key_states.shape[-2]  # the returned states end with this write's tokens
            return (torch.cat([k_all[..., :-n, :], key_states], dim=-2),
                    torch.cat([v_all[..., :-n, :], value_states], dim=-2))

    try:
        return _WriteHookCache(config=config)
    except TypeError:  # transformers releases whose DynamicCache takes no config
        return _WriteHookCache()


def cache_kwarg(model) -> str:
    """The name under which ``model.forward`` takes a cache (``cache`` from transformers
    5.x, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_forward(module, ids: torch.Tensor, kv: KVPlan, config, output: str = "logits") -> torch.Tensor:
    """``module``'s ``output`` (``logits`` of a causal LM, ``last_hidden_state`` of its decoder)
    for ``ids`` with ``kv`` applied at every cache write.  With ``kv.config.residual`` the
    window runs as a prefill in chunks of that many tokens through one cache, so that each
    chunk reads its own tokens exactly and the earlier chunks quantized."""
    r = kv.config.residual
    cache = make_cache(config, kv.on_write, fresh_exact=r > 0)
    kw = {cache_kwarg(module): cache, "use_cache": True}
    if not r:
        return getattr(module(input_ids=ids, **kw), output)
    return torch.cat([getattr(module(input_ids=ids[:, s:s + r], **kw), output)
                      for s in range(0, ids.shape[1], r)], dim=1)
