"""Byte layouts of ggml's quantization types: element values and scales → GGUF tensor bytes.

``pack(v, t, scale, zero, super_scale, super_min)`` returns ``(rows, row_bytes)`` uint8, one
row of the matrix after another, each super-block ``t.type_size`` bytes, little-endian:

* q8_0:  ``d`` fp16, 32 × int8.
* q4_0 / q4_1: ``d`` [, ``m``] fp16, 16 bytes: byte ``i`` holds ``q[i]`` (low nibble) and
  ``q[i + 16]`` (high), ``q = v − vmin`` for q4_0.
* q5_0 / q5_1: ``d`` [, ``m``], a 32-bit word whose bit ``i`` is bit 4 of ``q[i]``, then the
  low nibbles as q4.
* q4_k: ``d``, ``dmin`` fp16, 12 bytes of 6-bit scales and mins (bytes 0–3: ``sc[j]`` in
  bits 0–5 and bits 4–5 of ``sc[j + 4]`` in bits 6–7; bytes 4–7 the same for the mins; bytes
  8–11: the low nibbles of ``sc[j + 4]`` and ``mn[j + 4]``), 128 bytes: byte ``32·j + i``
  holds ``q[64·j + i]`` (low nibble) and ``q[64·j + 32 + i]`` (high).
* q5_k: as q4_k with 32 bytes before the nibbles: bit ``k`` of byte ``i`` is bit 4 of
  ``q[32·k + i]``.
* q3_k: 32 bytes ``hmask`` (bit ``k`` of byte ``i``: bit 2 of ``q[32·k + i]``), 64 bytes of
  2-bit pairs (per half of 128: byte ``32·h + p``, bits ``2·s``, hold the low bits of
  ``q[128·h + 32·s + p]``), 12 bytes of 6-bit scales ``sc + 32`` (bytes 0–7: ``sc[j]`` in the low
  nibble, ``sc[j + 8]`` in the high; bytes 8–11: bits 4–5 of ``sc[j]`` at bits ``2·(j // 4)``
  of byte ``8 + j % 4``), ``d`` fp16; ``q = v + 4``.
* q6_k: 128 bytes of low nibbles (per half of 128: byte ``64·h + p`` holds ``q[128·h + p]``
  and ``q[128·h + 64 + p]``), 64 bytes of high 2-bit pairs (byte ``32·h + p``, bits ``2·s``,
  of ``q[128·h + 32·s + p]``), 16 × int8 scales, ``d`` fp16; ``q = v + 32``.
* iq4_nl: ``d`` fp16, 16 bytes as q4_0's, ``q`` the index of ``v`` in the table.

The tests read the bytes back with the ``gguf`` package's dequantizers.
"""

from __future__ import annotations

import torch

from .ggml import GGMLType, grid_index, subblock_view

__all__ = ["pack", "subscale_codes"]


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``(...)`` fp32 holding fp16 values → ``(..., 2)`` little-endian bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 0x0F) | ((hi & 0x0F) << 4)


def subscale_codes(scale: torch.Tensor, super_scale: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """The integer sub-block scales (or mins) behind effective ``scale = d · sc``: ``sc = scale / d``
    (exact), checked to be whole numbers in range.  ``(rows, blocks)`` int64."""
    rows, nb = scale.shape
    per = t.super_block // t.block
    d = super_scale[..., None].to(torch.float32)
    s = scale.to(torch.float32).reshape(rows, nb // per, per)
    q = torch.where(d != 0, s / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(s))
    lo, hi = t.sub_range
    r = torch.round(q)
    if not torch.equal(r * d, s) or r.min() < lo or r.max() > hi:
        raise ValueError(f"{t.name}: the sub-block scales are not whole multiples in [{lo}, {hi}] of the super-scale; "
                         "they must come from lowbit.numerics.ggml.second_level")
    return r.to(torch.int64).reshape(rows, nb)


def _k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """``(n, 8)`` 6-bit scales and mins → ``(n, 12)`` bytes (the q4_k / q5_k layout)."""
    out = torch.empty(sc.shape[0], 12, dtype=torch.int64)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def pack(v: torch.Tensor, t: GGMLType, scale: torch.Tensor, zero: torch.Tensor | None = None,
         super_scale: torch.Tensor | None = None, super_min: torch.Tensor | None = None) -> torch.Tensor:
    """Pack element values ``v`` ``(rows, cols)`` and their parameters (as
    :func:`lowbit.numerics.ggml.minmax_params` returns them) into ``(rows, row bytes)`` uint8."""
    rows, cols = v.shape
    vi = subblock_view(v, t).round().to(torch.int64)                       # (rows, blocks, block)
    if vi.min() < t.vmin or vi.max() > t.vmax:
        raise ValueError(f"{t.name}: element values outside [{t.vmin}, {t.vmax}]")
    n_super = cols // t.super_block
    if t.two_level and super_scale is None:
        raise ValueError(f"{t.name} is a two-level type: pass super_scale (and super_min)")
    q = grid_index(vi, t) if t.grid else (vi - t.vmin if t.vmin < 0 and t.name != "q8_0" else vi)
    nb = cols // t.block
    if not t.two_level:
        parts = [_f16_bytes(scale.reshape(rows, nb))]
        if t.has_min:
            parts.append(_f16_bytes(-zero.reshape(rows, nb)))
        if t.name == "q8_0":
            parts.append((q.to(torch.int8).view(torch.uint8)).to(torch.int64))
        else:
            if t.bits == 5:
                bits = (q >> 4) & 1                                           # (rows, nb, 32)
                word = (bits << torch.arange(32)).sum(-1)                     # (rows, nb)
                parts.append((word[..., None] >> torch.tensor([0, 8, 16, 24])) & 0xFF)
            parts.append(_nibbles(q[..., :16], q[..., 16:]))
        out = torch.cat([p.to(torch.int64) for p in parts], dim=-1)
        return out.to(torch.uint8).reshape(rows, nb * t.type_size)
    qs = q.reshape(rows * n_super, t.super_block)
    if t.name == "q3_k":
        sc = subscale_codes(scale, super_scale, t).reshape(rows * n_super, 16) + 32
        hm = ((qs.reshape(-1, 8, 32) >> 2) & 1) << torch.arange(8)[:, None]
        lo2 = (qs.reshape(-1, 2, 4, 32) & 3) << (2 * torch.arange(4))[:, None]
        packed_sc = torch.cat([(sc[:, :8] & 0x0F) | ((sc[:, 8:] & 0x0F) << 4),
                               ((sc.reshape(-1, 4, 4) >> 4) << (2 * torch.arange(4))[:, None]).sum(1)], dim=-1)
        parts = [hm.sum(1), lo2.sum(2).reshape(-1, 64), packed_sc, _f16_bytes(super_scale.reshape(-1)).to(torch.int64)]
    elif t.name == "q6_k":
        sc = subscale_codes(scale, super_scale, t).reshape(rows * n_super, 16)
        h = qs.reshape(-1, 2, 128)
        ql = _nibbles(h[..., :64], h[..., 64:]).reshape(-1, 128)
        hi = (h >> 4).reshape(-1, 2, 4, 32)
        qh = (hi << (2 * torch.arange(4))[:, None]).sum(2).reshape(-1, 64)
        parts = [ql, qh, sc.to(torch.int8).view(torch.uint8).to(torch.int64),
                 _f16_bytes(super_scale.reshape(-1)).to(torch.int64)]
    else:
        sc = subscale_codes(scale, super_scale, t).reshape(-1, 8)
        mn = subscale_codes(zero, super_min, t).reshape(-1, 8)
        parts = [_f16_bytes(super_scale.reshape(-1)), _f16_bytes(super_min.reshape(-1)), _k_scales(sc, mn)]
        g = qs.reshape(-1, 4, 2, 32)
        if t.bits == 5:
            hb = (qs.reshape(-1, 8, 32) >> 4) & 1
            parts.append((hb << torch.arange(8)[:, None]).sum(1))
        parts.append(_nibbles(g[:, :, 0], g[:, :, 1]).reshape(-1, 128))
        parts = [p.to(torch.int64) for p in parts]
    out = torch.cat(parts, dim=-1)
    return out.to(torch.uint8).reshape(rows, n_super * t.type_size)
