"""The KV-cache part of a recipe: which of keys and values are quantized, with which schemes,
and how (centered keys, a full-precision window of recent tokens).  Data only: the cache write
that applies it is :mod:`lowbit.quantization.kv`."""

from __future__ import annotations

from dataclasses import dataclass

from ..numerics.scheme import Scheme

__all__ = ["KVConfig"]


@dataclass(frozen=True)
class KVConfig:
    """KV-cache quantization at the cache write (keys after RoPE and QK-norm).

    ``scheme.granularity``: ``tensor`` (one scale per layer), ``head`` (per KV head),
    ``token`` (per head and token, over the head dim) or ``channel`` (per head and
    channel, over the tokens — KIVI's key layout).  Static schemes (``dynamic: false``)
    take their scales from calibration; only ``tensor`` and ``head`` can be static.

    ``center_keys``: subtract a calibrated per-channel mean of the keys (per head and channel,
    after RoPE) before quantizing, and add it back after.  Exact for attention — a vector
    added to every key shifts all of one query's scores by the same amount, which softmax
    ignores — so only the quantization error changes: it scales with what a channel varies
    by across tokens instead of with its constant offset.  No serving engine applies it at
    the cache write (a k_proj bias cannot carry it: RoPE rotates the bias by position), so it
    is for measurement; the exporter refuses it.

    ``residual``: KIVI's full-precision window of recent tokens.  The cache is written in
    groups of ``residual`` tokens from the first; the group being filled stays in full
    precision and is quantized when it is complete (``channel`` key scales then span one
    group's tokens, as KIVI groups them), so a query reads its own group's keys and values
    exactly and every earlier group quantized.  A window is evaluated as a prefill in chunks
    of ``residual`` tokens.  0 (the default): every read sees the quantized cache.
    """

    scheme: Scheme
    keys: bool = True
    values: bool = True
    value_scheme: Scheme | None = None  # a different scheme for values (KIVI: per-token values)
    center_keys: bool = False
    residual: int = 0

    def __post_init__(self) -> None:
        if not (self.keys or self.values):
            raise ValueError("at least one of keys / values must be quantized")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"residual: a number of tokens >= 0, got {self.residual!r}")
        if self.center_keys and not self.keys:
            raise ValueError("center_keys: needs keys: true (it centers the keys before quantizing them)")
        for s in (self.scheme, self.value_scheme):
            if s is None:
                continue
            if s.granularity.kind not in ("tensor", "head", "token", "channel"):
                raise ValueError(f"granularity {s.granularity} is not one of tensor, head, token, channel")
            if not s.dynamic and s.granularity.kind not in ("tensor", "head"):
                raise ValueError(f"a static (calibrated) scale needs tensor or head granularity, got {s.granularity}")
            if s.global_scale:
                raise ValueError("two-level (global-scale) schemes are not supported for the KV cache")
            if s.signed_scale:
                raise ValueError("signed_scale is for weights; KV-cache scales are positive amax / qmax")

    @property
    def v_scheme(self) -> Scheme:
        return self.value_scheme or self.scheme
