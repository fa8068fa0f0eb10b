"""Element formats of at most 8 bits, each defined by the table of its values.

A :class:`Format` is the list of values its ``2**bits`` codes stand for: code ``c``
means ``values[c]``.  That table *is* the specification; everything else (rounding,
encoding, the numbers in ``lowbit formats``) is derived from it.  Rounding has a fast
arithmetic path for minifloats and integers; the tests check it against the table,
value by value, and the FP8 formats against ``torch.float8_*`` casts.

Rounding is round-to-nearest, ties to the even code, saturating at ``±max`` (``±inf``
saturates too).  NaN stays NaN; callers that must not see NaN (``qtensor.quantize``)
check their input first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = [
    "Format",
    "FORMATS",
    "INT2", "INT3", "INT4", "INT5", "INT6", "INT7", "INT8",
    "UINT2", "UINT3", "UINT4", "UINT5", "UINT6", "UINT7", "UINT8",
    "FP8_E4M3", "FP8_E5M2", "FP6_E3M2", "FP6_E2M3", "FP4_E2M1", "E8M0",
]


@dataclass(frozen=True, eq=False)
class Format:
    """An element format: ``values[code]`` is the number a bit pattern stands for.

    Attributes:
        name: short name, e.g. ``"fp8_e4m3"``.
        bits: code width (1..8).
        kind: ``"int"`` (two's complement or unsigned integer), ``"float"`` (sign,
            exponent, mantissa) or ``"e8m0"`` (unsigned power of two).
        signed: whether negative values exist.
        exponent_bits, mantissa_bits: the float layout (0 for integers).
        values: ``2**bits`` floats, NaN where a code is NaN.
    """

    name: str
    bits: int
    kind: str
    signed: bool
    exponent_bits: int
    mantissa_bits: int
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError(f"{self.name}: bits must be 1..8, got {self.bits}")
        if len(self.values) != 2**self.bits:
            raise ValueError(f"{self.name}: needs {2**self.bits} values, got {len(self.values)}")
        if self.kind not in ("int", "float", "e8m0"):
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")

    def __repr__(self) -> str:
        return f"Format({self.name})"

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Format) and other.name == self.name and other.values == self.values

    # -- facts derived from the table -------------------------------------------------

    @cached_property
    def finite(self) -> tuple[float, ...]:
        """Sorted distinct finite values (``-0.0`` and ``+0.0`` count once)."""
        return tuple(sorted({v for v in self.values if math.isfinite(v)}))

    @property
    def max(self) -> float:
        return self.finite[-1]

    @property
    def min(self) -> float:
        return self.finite[0]

    @property
    def min_positive(self) -> float:
        """Smallest positive value (the smallest subnormal for floats)."""
        return min(v for v in self.finite if v > 0)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value; for integers, 1."""
        if self.kind == "float":
            return 2.0 ** (1 - self.bias) if self.exponent_bits > 0 else self.min_positive
        return self.min_positive

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1 if self.kind == "float" else 127 if self.kind == "e8m0" else 0

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (OCP MX's emax_elem)."""
        return math.floor(math.log2(self.max))

    @property
    def has_inf(self) -> bool:
        return any(math.isinf(v) for v in self.values)

    @property
    def nan_codes(self) -> tuple[int, ...]:
        return tuple(c for c, v in enumerate(self.values) if math.isnan(v))

    def step_near_one(self) -> float:
        """Distance from 1.0 to the next larger value (``nan`` if 1 is not representable)."""
        above = [v for v in self.finite if v > 1.0]
        return above[0] - 1.0 if 1.0 in self.finite and above else math.nan

    @cached_property
    def _tables(self) -> dict[str, torch.Tensor]:
        fin = torch.tensor(self.finite, dtype=torch.float64)
        # For a tie at a midpoint, go to the neighbour with the even code.
        code_of = {}
        for c, v in enumerate(self.values):
            if math.isfinite(v):
                key = v if v != 0 else 0.0
                # +0 has the even code in every format here; prefer the smallest code.
                code_of.setdefault(key, c)
        codes = torch.tensor([code_of[v] for v in self.finite], dtype=torch.int64)
        tie_up = (codes[1:] % 2 == 0) & (codes[:-1] % 2 == 1)
        return {
            "decode": torch.tensor(self.values, dtype=torch.float32),
            "finite": fin.to(torch.float32),
            "mid": ((fin[1:] + fin[:-1]) / 2).to(torch.float32),
            "tie_up": tie_up,
            "codes": codes,
        }

    # -- rounding, encoding, decoding -------------------------------------------------

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Nearest value of this format, ties to the even code, saturating at ±max.

        Returns a tensor of ``x``'s dtype; NaN stays NaN, ``-0.0`` keeps its sign.
        """
        if self.kind == "float":
            return _round_minifloat(x, self)
        if self.kind == "int":
            return torch.round(x).clamp_(self.min, self.max)  # torch.round: half to even
        return self.round_by_table(x)

    def _tables_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """:attr:`_tables` on ``device`` (copied there once per device)."""
        if device.type == "cpu":
            return self._tables
        on = self.__dict__.setdefault("_tables_by_device", {})
        if device not in on:
            on[device] = {k: v.to(device) for k, v in self._tables.items()}
        return on[device]

    def round_by_table(self, x: torch.Tensor) -> torch.Tensor:
        """Reference rounding straight from the value table (slower; used by tests)."""
        t = self._tables_on(x.device)
        xf = x.to(torch.float32)
        a = xf.clamp(self.min, self.max)
        idx = torch.bucketize(a, t["mid"])  # a == mid[i] lands on i (the lower neighbour)
        at_mid = (idx < len(t["mid"])) & (a == t["mid"][idx.clamp(max=len(t["mid"]) - 1)])
        idx = idx + (at_mid & t["tie_up"][idx.clamp(max=len(t["mid"]) - 1)]).long()
        out = t["finite"][idx]
        if self.signed:
            out = torch.copysign(out, xf)
        out = torch.where(torch.isnan(xf), xf, out)
        return out.to(x.dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Round ``x`` and return the bit patterns as ``uint8``."""
        r = self.round(x.to(torch.float32)).contiguous()
        if torch.isnan(r).any():
            raise ValueError(f"{self.name}.encode: input contains NaN")
        t = self._tables_on(r.device)
        if self.kind == "int":
            return (r.to(torch.int16) & (2**self.bits - 1)).to(torch.uint8)
        if self.kind == "e8m0":
            return (torch.log2(r) + self.bias).round().to(torch.uint8)
        mag = t["finite"][t["finite"] >= 0]
        mag_codes = t["codes"][t["finite"] >= 0]
        idx = torch.searchsorted(mag, r.abs())
        code = mag_codes[idx]
        sign = torch.signbit(r).to(torch.int64) << (self.bits - 1)
        return (code | sign).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Values (float32) of bit patterns given as an integer tensor."""
        return self._tables_on(codes.device)["decode"][codes.long()]


def _round_minifloat(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round to a sign/exponent/mantissa format by arithmetic on fp32 bit fields.

    For |x| in the binade [2^e, 2^(e+1)) the spacing is 2^(e−m); below the smallest
    normal it stays at the subnormal spacing.  ``torch.round`` rounds half to even, and
    an even multiple of the spacing is an even code, so ties go to the even code as the
    table rule says.  FP8 uses torch's own casts, which round the same way (tested).
    NaN propagates through every step.
    """
    dtype = _TORCH_CASTS.get(fmt.name)
    if dtype is not None:
        return x.to(torch.float32).clamp(-fmt.max, fmt.max).to(dtype).to(x.dtype)
    xf = x.to(torch.float32)
    a = xf.abs().clamp_(max=fmt.max)
    # unbiased fp32 exponent, floor(log2 a); fp32 subnormals and zero land far below emin
    e = (a.view(torch.int32) >> 23).sub_(127).clamp_(min=1 - fmt.bias)
    inv_step = ((127 + fmt.mantissa_bits) - e).bitwise_left_shift_(23).view(torch.float32)
    q = torch.round(a.mul_(inv_step)).div_(inv_step)  # powers of two: exact
    return torch.copysign(q, xf, out=q).to(x.dtype)


_TORCH_CASTS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# -- the table builders ------------------------------------------------------------


def _int_format(bits: int, signed: bool) -> Format:
    n = 2**bits
    if signed:
        vals = tuple(float(c - n if c >= n // 2 else c) for c in range(n))
    else:
        vals = tuple(float(c) for c in range(n))
    return Format(f"{'int' if signed else 'uint'}{bits}", bits, "int", signed, 0, 0, vals)


def _minifloat(name: str, e: int, m: int, special: str) -> Format:
    """Sign-magnitude float with ``e`` exponent and ``m`` mantissa bits, bias 2^(e-1)-1.

    special: ``"ieee"`` (all-ones exponent is inf/NaN), ``"fn"`` (only S.1..1.1..1 is
    NaN, as FP8 E4M3) or ``"none"`` (every code is finite, as the MX FP6/FP4 types).
    """
    bits = 1 + e + m
    bias = 2 ** (e - 1) - 1
    vals = []
    for c in range(2**bits):
        sign = -1.0 if c >> (bits - 1) else 1.0
        ex = (c >> m) & (2**e - 1)
        man = c & (2**m - 1)
        if special == "ieee" and ex == 2**e - 1:
            v = math.inf if man == 0 else math.nan
        elif special == "fn" and ex == 2**e - 1 and man == 2**m - 1:
            v = math.nan
        elif ex == 0:
            v = man / 2**m * 2.0 ** (1 - bias)
        else:
            v = (1 + man / 2**m) * 2.0 ** (ex - bias)
        vals.append(math.copysign(v, sign) if not math.isnan(v) else v)
    return Format(name, bits, "float", True, e, m, tuple(vals))


def _e8m0() -> Format:
    vals = tuple(math.nan if c == 255 else 2.0 ** (c - 127) for c in range(256))
    return Format("e8m0", 8, "e8m0", False, 8, 0, vals)


INT2, INT3, INT4, INT5, INT6, INT7, INT8 = (_int_format(b, True) for b in range(2, 9))
UINT2, UINT3, UINT4, UINT5, UINT6, UINT7, UINT8 = (_int_format(b, False) for b in range(2, 9))
FP8_E4M3 = _minifloat("fp8_e4m3", 4, 3, "fn")
FP8_E5M2 = _minifloat("fp8_e5m2", 5, 2, "ieee")
FP6_E3M2 = _minifloat("fp6_e3m2", 3, 2, "none")
FP6_E2M3 = _minifloat("fp6_e2m3", 2, 3, "none")
FP4_E2M1 = _minifloat("fp4_e2m1", 2, 1, "none")
E8M0 = _e8m0()

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        INT2, INT3, INT4, INT5, INT6, INT7, INT8,
        UINT2, UINT3, UINT4, UINT5, UINT6, UINT7, UINT8,
        FP8_E4M3, FP8_E5M2, FP6_E3M2, FP6_E2M3, FP4_E2M1, E8M0,
    )
}
