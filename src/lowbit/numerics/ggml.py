"""GGUF's element types (llama.cpp's ggml quantization types) as lowbit schemes.

Every type stores a row in blocks of ``block`` elements with one scale each, and, for the
k-quants, groups ``super_block // block`` sub-blocks into a super-block whose sub-block
scales (and mins) are themselves quantized against fp16 super-scales — a second scale
level, as NVFP4's FP8 block scales stand on a global scale.  In lowbit's terms, with
``v`` the element value (``decode(code)``) of a block, ``s`` its effective scale and
``o`` its offset (``QParams.zero`` for these types)::

    x̂ = v · s − o

==========  =====  ======  ==========================================  ===============
type        block  super   effective scale s, offset o                 v
==========  =====  ======  ==========================================  ===============
q8_0          32     32    s = d (fp16)                                int8, [-127, 127]
q4_0 / q5_0   32     32    s = d (fp16, signed: the largest-magnitude  [-8, 7] / [-16, 15]
                           element maps to the lowest value)
q4_1 / q5_1   32     32    s = d, o = −m (both fp16)                   [0, 15] / [0, 31]
q4_k / q5_k   32    256    s = d·sc, o = dmin·mn; sc, mn 6-bit         [0, 15] / [0, 31]
                           unsigned, d, dmin fp16 per super-block
q3_k          16    256    s = d·sc; sc 6-bit signed, d fp16           [-4, 3]
q6_k          16    256    s = d·sc; sc int8 signed, d fp16            [-32, 31]
iq4_nl        32     32    s = d (fp16)                                the 16 int8 entries
                                                                       of ``IQ4_NL_VALUES``
==========  =====  ======  ==========================================  ===============

iq4_nl's elements lie on a fixed non-uniform table (``kvalues_iq4nl`` in ggml), stored as
4-bit indices; lowbit's ``v`` is the table entry itself (an int8 value, so its schemes have
the ``int8`` element format), and rounding goes to the nearest entry (:func:`round_values`).

``s`` and ``o`` are fp32 products of stored numbers (exact: an fp16 times a ≤ 8-bit integer
fits fp32's mantissa), and ``v·s − o`` is evaluated in fp32 in that order, as the ``gguf``
package's dequantizers do, so lowbit's fake-quantized weight *is* what the packed bytes
decode to (``tests/numerics/test_ggml.py`` checks it type by type).  Byte layouts are in
:mod:`lowbit.numerics.ggml_pack`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GGMLType", "GGML_TYPES", "IQ4_NL_VALUES", "FALLBACK", "fallback", "get_type", "minmax_params",
           "block_params", "second_level", "round_values", "grid_index", "element_values", "dequantize_values",
           "subblock_view"]


@dataclass(frozen=True)
class GGMLType:
    """One ggml quantization type.

    ``type_id``: ggml's enum value; ``bits``: bits of ``v``; ``vmin``/``vmax``: the range of
    ``v``; ``has_min``: an offset per block; ``sub_bits``: width of the quantized sub-block
    scales (0: the block scale itself is fp16; signed for the types without a min);
    ``type_size``: bytes per super-block; ``grid``: the values ``v`` may take when they are
    not the integers ``vmin … vmax`` (iq4_nl's table; ``bits`` is then the index width).
    """

    name: str
    type_id: int
    bits: int
    block: int
    super_block: int
    vmin: int
    vmax: int
    has_min: bool
    sub_bits: int
    type_size: int
    grid: tuple[int, ...] = ()

    @property
    def format_name(self) -> str:
        """The element format of ``v`` in :data:`lowbit.numerics.formats.FORMATS` (a table
        type's entries are int8 values)."""
        return "int8" if self.grid else f"{'int' if self.vmin < 0 else 'uint'}{self.bits}"

    @property
    def sub_range(self) -> tuple[int, int]:
        """The range of the integer sub-block scales (and mins): unsigned with a min, signed without."""
        if self.has_min:
            return 0, 2 ** self.sub_bits - 1
        return -(2 ** (self.sub_bits - 1)), 2 ** (self.sub_bits - 1) - 1

    @property
    def two_level(self) -> bool:
        return self.super_block > self.block

    @property
    def bits_per_element(self) -> float:
        return self.type_size * 8 / self.super_block


#: iq4_nl's element values (ggml's ``kvalues_iq4nl``), indexed by the stored 4-bit code
IQ4_NL_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("q4_0", 2, 4, 32, 32, -8, 7, False, 0, 18),
    GGMLType("q4_1", 3, 4, 32, 32, 0, 15, True, 0, 20),
    GGMLType("q5_0", 6, 5, 32, 32, -16, 15, False, 0, 22),
    GGMLType("q5_1", 7, 5, 32, 32, 0, 31, True, 0, 24),
    GGMLType("q8_0", 8, 8, 32, 32, -128, 127, False, 0, 34),
    GGMLType("q3_k", 11, 3, 16, 256, -4, 3, False, 6, 110),
    GGMLType("q4_k", 12, 4, 32, 256, 0, 15, True, 6, 144),
    GGMLType("q5_k", 13, 5, 32, 256, 0, 31, True, 6, 176),
    GGMLType("q6_k", 14, 6, 16, 256, -32, 31, False, 8, 210),
    GGMLType("iq4_nl", 20, 4, 32, 32, -127, 113, False, 0, 18, IQ4_NL_VALUES),
)}


def get_type(name: str) -> GGMLType:
    try:
        return GGML_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}; known: {', '.join(GGML_TYPES)}") from None


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def subblock_view(m: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """The ``(rows, cols)`` matrix as ``(rows, cols // block, block)``; refuses a row length
    that is not a whole number of super-blocks (ggml has no ragged blocks)."""
    rows, cols = m.shape
    if cols % t.super_block:
        raise ValueError(f"ggml type {t.name} needs rows of a multiple of {t.super_block} elements; "
                         f"this tensor's rows have {cols}")
    return m.reshape(rows, cols // t.block, t.block)


def _signed_extreme(b: torch.Tensor) -> torch.Tensor:
    """Per block (last dim), the element of largest magnitude with its sign (the first one on a tie)."""
    idx = b.abs().argmax(dim=-1, keepdim=True)
    return b.gather(-1, idx).squeeze(-1)


def minmax_params(m: torch.Tensor, t: GGMLType) -> tuple[torch.Tensor, ...]:
    """Min-max parameters of ``m`` ``(rows, cols)``: each block's own range (lowbit's round to nearest
    for the one-level types; for the k-quants it is :func:`lowbit.numerics.ggml_search.rtn_params`).

    The one-level types follow ggml's reference quantizers (``quantize_row_*_ref``): q8_0
    ``d = amax / 127``; q4_0/q5_0 ``d = max / −8`` (``−16``) with ``max`` the signed
    element of largest magnitude; q4_1/q5_1 ``d = (max − min) / 15`` (31), ``m = min``.
    iq4_nl starts, as ggml's reference does, from ``d = max / −127`` (its table's lowest entry).
    The k-quants take each sub-block's min-max (q4_k/q5_k, the range widened to hold 0 as
    ggml does) or signed extreme (q3_k: ``max / −4``, q6_k: ``max / −32``) and quantize those
    against the super-block (:func:`second_level`).

    Returns ``(scale, zero, super_scale, super_min)``: ``(rows, blocks)`` effective scales,
    offsets (``None`` without a min) and ``(rows, super-blocks)`` fp16 super-scales
    (``None`` for one-level types).
    """
    return block_params(m, t)


def block_params(m: torch.Tensor, t: GGMLType, ratio: float = 1.0,
                 supers: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`minmax_params` with each block's range shrunk by ``ratio`` (a clipping search's
    candidate: symmetric types scale their extreme, types with a min shrink ``[min, max]``
    about its middle) and, for k-quants, the super-scales ``supers = (d, dmin)`` held fixed
    (sub-scales that would exceed their range saturate)."""
    b = subblock_view(m.to(torch.float32), t)
    if t.name == "q8_0":
        return _fp16(b.abs().amax(dim=-1) * ratio / 127), None, None, None
    if not t.has_min:
        first = _signed_extreme(b) * ratio / t.vmin
        return (_fp16(first), None, None, None) if not t.two_level else second_level(first, None, t, supers)
    lo, hi = b.amin(dim=-1), b.amax(dim=-1)
    if ratio != 1.0:
        mid = (lo + hi) / 2
        lo, hi = mid - (mid - lo) * ratio, mid + (hi - mid) * ratio
    if not t.two_level:
        return _fp16((hi - lo) / t.vmax), -_fp16(lo), None, None
    lo = torch.minimum(lo, torch.zeros_like(lo))
    return second_level((hi - lo) / t.vmax, -lo, t, supers)


def second_level(scale: torch.Tensor, mins: torch.Tensor | None, t: GGMLType,
                 supers: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """Quantize float sub-block scales (and mins) of a k-quant against fp16 super-scales.

    q4_k/q5_k: ``d = fp16(max sc_f / 63)``, ``sc = round(sc_f / d)`` in [0, 63], likewise
    ``dmin`` and the (non-negative) mins.  q6_k / q3_k: ``d = fp16(m / lo)`` with ``m`` the
    signed sub-scale of largest magnitude and ``[lo, hi]`` the signed sub-scale range
    (``GGMLType.sub_range``: [−128, 127] for q6_k's 8 bits, [−32, 31] for q3_k's 6),
    ``sc = round(sc_f / d)`` in that range.
    A super-scale of 0 gives sub-scales 0.  ``supers = (d, dmin)`` uses those super-scales
    instead of computing them.

    Returns ``(scale, zero, super_scale, super_min)`` as :func:`minmax_params`.
    """
    rows, nb = scale.shape
    per = t.super_block // t.block
    sf = scale.to(torch.float32).reshape(rows, nb // per, per)
    if t.has_min:
        mf = mins.to(torch.float32).reshape(rows, nb // per, per)
        d, dmin = supers if supers is not None else (_fp16(sf.amax(dim=-1) / 63), _fp16(mf.amax(dim=-1) / 63))
        sc = _sub_codes(sf, d, 0, 63)
        mn = _sub_codes(mf, dmin, 0, 63)
        return (d[..., None] * sc).reshape(rows, nb), (dmin[..., None] * mn).reshape(rows, nb), d, dmin
    lo, hi = t.sub_range
    d = supers[0] if supers is not None else _fp16(_signed_extreme(sf) / lo)
    sc = _sub_codes(sf, d, lo, hi)
    return (d[..., None] * sc).reshape(rows, nb), None, d, None


def _sub_codes(values: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``round(values / d)`` clamped to ``[lo, hi]``; 0 where ``d`` is 0 (fp32 integers)."""
    dd = d[..., None]
    safe = torch.where(dd != 0, dd, torch.ones_like(dd))
    q = torch.round(values / safe).clamp_(lo, hi)
    return torch.where(dd != 0, q, torch.zeros_like(q))


def _expand(p: torch.Tensor, t: GGMLType) -> torch.Tensor:
    return p[..., None]  # (rows, blocks, 1) against (rows, blocks, block)


def _grid_tables(t: GGMLType, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A table type's values and the midpoints between neighbours, in ``like``'s dtype and on its
    device (exact: halves of small integers)."""
    g = torch.tensor(t.grid, dtype=like.dtype, device=like.device)
    return g, (g[1:] + g[:-1]) / 2


def round_values(x: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """``x`` (already divided by the scale) rounded to the nearest element value of ``t``: for the
    integer types ``clamp(round(x), vmin, vmax)`` (ties to even); for a table type (iq4_nl) the
    nearest table entry, saturating at both ends, a tie going to the larger entry as ggml's
    ``best_index_int8`` does; NaN stays NaN.  Of ``x``'s dtype and shape."""
    if not t.grid:
        return torch.round(x).clamp_(t.vmin, t.vmax)
    g, mid = _grid_tables(t, x)
    v = g[torch.bucketize(x.contiguous(), mid, right=True)]
    return torch.where(torch.isnan(x), x, v)


def grid_index(v: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """The stored 4-bit codes (int64) of a table type's element values ``v``; refuses a value that is
    not a table entry."""
    v = v.to(torch.float32)
    g, mid = _grid_tables(t, v)
    idx = torch.bucketize(v, mid, right=True)
    if not torch.equal(g[idx], v):
        raise ValueError(f"{t.name}: element values that are not entries of its table {t.grid}")
    return idx


def element_values(m: torch.Tensor, t: GGMLType, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``v = clamp(round((x + o) / s), vmin, vmax)`` for ``m`` ``(rows, cols)`` (for iq4_nl the
    nearest table entry to ``x / s``, :func:`round_values`): the nearest point of the block's
    stored grid (ties to even); a block with ``s = 0`` gets ``v = 0`` (iq4_nl: the entry nearest
    0, which dequantizes to 0 as well).  Returns fp32 ``(rows, cols)``."""
    b = subblock_view(m.to(torch.float32), t)
    s = _expand(scale, t)
    safe = torch.where(s != 0, s, torch.full_like(s, float("inf")))
    x = b if zero is None else b + _expand(zero, t)
    v = round_values(x / safe, t)
    if t.has_min:  # v = 0 is the lowest level; a zero scale sends the block to it
        v = torch.where(s != 0, v, torch.zeros_like(v))
    return v.reshape(m.shape)


def dequantize_values(v: torch.Tensor, t: GGMLType, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``v · s − o`` in fp32, in that order (the ``gguf`` package's dequantizers' arithmetic)."""
    b = subblock_view(v.to(torch.float32), t)
    out = b * _expand(scale, t)
    if zero is not None:
        out = out - _expand(zero, t)
    return out.reshape(v.shape)


#: what llama.cpp's ``llama-quantize`` writes instead of a k-quant when a row is not a whole
#: number of 256-element super-blocks (``tensor_type_fallback`` in the llama.cpp lowbit builds,
#: 11434; older releases wrote iq4_nl for q3_k)
FALLBACK: dict[str, str] = {"q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def fallback(t: GGMLType, cols: int) -> GGMLType:
    """The type a row of ``cols`` elements is written in: ``t``, or its fallback for a k-quant
    whose super-block does not divide ``cols``.  Raises if not even 32 divides it."""
    if cols % t.super_block == 0:
        return t
    if t.name in FALLBACK and cols % GGML_TYPES[FALLBACK[t.name]].block == 0:
        return GGML_TYPES[FALLBACK[t.name]]
    raise ValueError(f"ggml type {t.name} cannot hold rows of {cols} elements (blocks of {t.super_block})")
