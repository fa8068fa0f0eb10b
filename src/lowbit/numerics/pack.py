"""Bit packing for export: sub-byte codes into the words runtimes read.

Two layouts, both little-endian (element 0 in the lowest bits):

* ``pack_int32`` — signed integers stored *offset binary* (``q + 2**(bits-1)``), ``32 / bits``
  of them per int32 along one dim.  This is compressed-tensors' ``pack-quantized`` layout
  (vLLM's ``uint4b8``): ``pack_int32([-8, -7, 0, 1, 2, 3, 4, 7], 4) == 0xFCBA9810``.
* ``pack_nibbles`` — 4-bit codes two per byte, the even element in the low nibble
  (NVFP4 / MXFP4 ``weight_packed``): FP4 codes of ``[0.5, -1.0]`` pack to ``0xA1``.

Only widths that divide 32 (2, 4, 8) are packed: for 3/5/6/7 bits compressed-tensors
releases disagree (dense across words from 2026-05, padded per word before), so a
checkpoint would read differently depending on the reader's version.
"""

from __future__ import annotations

import torch

__all__ = ["pack_int32", "unpack_int32", "pack_nibbles", "unpack_nibbles", "PACKABLE_BITS"]

PACKABLE_BITS = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(
            f"cannot pack {bits}-bit values: only widths that divide 32 ({PACKABLE_BITS}) have one layout "
            "across compressed-tensors versions"
        )


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed integers of a 2-D tensor into int32 words along ``dim``.

    Args:
        values: integers in ``[-2**(bits-1), 2**(bits-1) - 1]`` (any integer or float dtype
            holding whole numbers), shape ``(rows, cols)``.
        bits: 2, 4 or 8.
        dim: 1 packs along columns (weights), 0 along rows (compressed-tensors' zero points).

    Returns:
        int32 tensor with ``ceil(n / (32 // bits))`` words along ``dim``; a ragged last word
        is padded with zero bits.  Element ``j`` sits in bits ``[bits·(j % k), …)`` of word
        ``j // k`` (``k = 32 // bits``), stored as ``q + 2**(bits-1)``.
    """
    _check_bits(bits)
    if values.ndim != 2:
        raise ValueError(f"pack_int32 needs a 2-D tensor, got shape {tuple(values.shape)}")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < lo or int(v.max()) > hi):
        raise ValueError(f"values outside the signed {bits}-bit range [{lo}, {hi}]")
    if dim == 0:
        v = v.t()
    raw = v + 2 ** (bits - 1)  # offset binary
    k = 32 // bits
    rows, cols = raw.shape
    pad = (-cols) % k
    if pad:
        raw = torch.nn.functional.pad(raw, (0, pad))
    raw = raw.reshape(rows, -1, k)  # (rows, words, k)
    shifts = torch.arange(k, dtype=torch.int64, device=raw.device) * bits
    words = (raw << shifts).sum(dim=-1)  # fields are disjoint: sum == bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: the first ``n`` signed integers along ``dim`` (int8)."""
    _check_bits(bits)
    w = (words.t() if dim == 0 else words).to(torch.int64) & 0xFFFFFFFF
    k = 32 // bits
    shifts = torch.arange(k, dtype=torch.int64, device=w.device) * bits
    raw = (w[..., None] >> shifts) & (2**bits - 1)  # (rows, words, k)
    out = raw.reshape(w.shape[0], -1)[:, :n] - 2 ** (bits - 1)
    out = out.to(torch.int8)
    return (out.t() if dim == 0 else out).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim, the even element in the low nibble.

    ``codes``: uint8 in ``[0, 15]``, shape ``(..., cols)`` with ``cols`` even.
    Returns uint8 of shape ``(..., cols // 2)``.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    if c.numel() and int(c.max()) > 15:
        raise ValueError("pack_nibbles: codes must be 4-bit (0..15)")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 codes, twice as many columns."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
