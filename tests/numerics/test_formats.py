"""Formats: the value tables, and every fast path checked against them code by code."""

import math

import pytest
import torch

from lowbit.numerics import formats as F

ALL = list(F.FORMATS.values())
FLOATS = [f for f in ALL if f.kind == "float"]


def test_fp4_e2m1_grid_is_the_spec():
    pos = [v for v in F.FP4_E2M1.values[:8]]
    assert pos == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert F.FP4_E2M1.values[8:] == tuple(-v for v in pos)


@pytest.mark.parametrize(
    "fmt, mx, min_normal, min_sub",
    [
        (F.FP8_E4M3, 448.0, 2.0**-6, 2.0**-9),
        (F.FP8_E5M2, 57344.0, 2.0**-14, 2.0**-16),
        (F.FP6_E3M2, 28.0, 2.0**-2, 2.0**-4),
        (F.FP6_E2M3, 7.5, 1.0, 0.125),
        (F.FP4_E2M1, 6.0, 1.0, 0.5),
    ],
)
def test_float_extremes(fmt, mx, min_normal, min_sub):
    assert fmt.max == mx and fmt.min == -mx
    assert fmt.min_normal == min_normal
    assert fmt.min_positive == min_sub


def test_special_values():
    # E4M3 "fn": no inf, NaN only at S.1111.111
    assert not F.FP8_E4M3.has_inf
    assert F.FP8_E4M3.nan_codes == (0x7F, 0xFF)
    # E5M2: IEEE-like, inf at exponent all-ones with zero mantissa
    assert F.FP8_E5M2.values[0x7C] == math.inf and F.FP8_E5M2.values[0xFC] == -math.inf
    assert len(F.FP8_E5M2.nan_codes) == 6
    # MX sub-byte floats have no specials; E8M0 has NaN at 0xFF and 2^(e-127) elsewhere
    for f in (F.FP6_E3M2, F.FP6_E2M3, F.FP4_E2M1):
        assert not f.nan_codes and not f.has_inf
    assert F.E8M0.nan_codes == (255,)
    assert F.E8M0.values[127] == 1.0 and F.E8M0.values[0] == 2.0**-127 and F.E8M0.max == 2.0**127


@pytest.mark.parametrize("bits", range(2, 9))
def test_int_ranges(bits):
    s = F.FORMATS[f"int{bits}"]
    u = F.FORMATS[f"uint{bits}"]
    assert (s.min, s.max) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert (u.min, u.max) == (0, 2**bits - 1)
    assert len(s.finite) == len(u.finite) == 2**bits


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_decode_encode_roundtrip_every_code(fmt):
    codes = torch.arange(2**fmt.bits)
    vals = fmt.decode(codes)
    ok = ~torch.isnan(vals)
    enc = fmt.encode(vals[ok]).long()
    if fmt.has_inf:  # inf saturates to max on encode; compare finite codes only
        fin = torch.isfinite(vals[ok])
        assert torch.equal(enc[fin], codes[ok][fin])
    else:
        assert torch.equal(enc, codes[ok])


def _all_midpoints_and_neighbours(fmt):
    """Every representable value, every midpoint between neighbours, and points just
    around each midpoint, plus values beyond max."""
    fin = torch.tensor(fmt.finite, dtype=torch.float64)
    mids = (fin[1:] + fin[:-1]) / 2
    eps = (fin[1:] - fin[:-1]) * 1e-3
    pts = torch.cat([fin, mids, mids - eps, mids + eps, torch.tensor([fmt.max * 1.5, -fmt.max * 1.5, fmt.max * 1e3])])
    return pts.to(torch.float32)


@pytest.mark.parametrize("fmt", [f for f in ALL if f.kind != "e8m0"], ids=lambda f: f.name)
def test_fast_round_equals_table_round(fmt):
    x = _all_midpoints_and_neighbours(fmt)
    x = torch.cat([x, torch.randn(20000) * fmt.max / 3])
    assert torch.equal(fmt.round(x), fmt.round_by_table(x))


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_table_round_is_nearest_with_ties_to_even_code(fmt):
    fin = torch.tensor(fmt.finite, dtype=torch.float64)
    x = _all_midpoints_and_neighbours(fmt)
    r = fmt.round_by_table(x).to(torch.float64)
    # nearest: no representable value is strictly closer
    dist = (x.to(torch.float64)[:, None] - fin[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.all((x.to(torch.float64) - r).abs() <= best + 0.0)
    # ties: among equally near values, the one chosen has an even code
    for xi, ri, di in zip(x.tolist(), r.tolist(), dist.tolist()):
        near = [fin[j].item() for j, d in enumerate(di) if d == min(di)]
        if len(near) == 2:
            assert int(fmt.encode(torch.tensor([ri]))[0]) % 2 == 0, (fmt.name, xi, near, ri)


@pytest.mark.parametrize("fmt, dtype", [(F.FP8_E4M3, torch.float8_e4m3fn), (F.FP8_E5M2, torch.float8_e5m2)])
def test_fp8_matches_torch_casts_value_for_value(fmt, dtype):
    # every code decodes to what torch says the bit pattern means
    codes = torch.arange(256, dtype=torch.uint8)
    torch_vals = codes.view(dtype).to(torch.float32)
    ours = fmt.decode(codes)
    assert torch.equal(torch.isnan(ours), torch.isnan(torch_vals))
    ok = ~torch.isnan(ours)
    assert torch.equal(ours[ok], torch_vals[ok])
    # rounding of every value, midpoint and subnormal within range agrees with the cast
    x = _all_midpoints_and_neighbours(fmt)
    x = x[x.abs() <= fmt.max]
    x = torch.cat([x, torch.randn(100000) * 4, torch.rand(100000) * fmt.min_normal * 2])
    assert torch.equal(fmt.round(x), x.to(dtype).to(torch.float32))
    # encode gives the hardware bit pattern, -0.0 included
    assert torch.equal(fmt.encode(x), x.to(dtype).view(torch.uint8))


def test_saturation_and_specials_in_round():
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, math.nan, -0.0])
    r = F.FP4_E2M1.round(x)
    assert r[:4].tolist() == [6.0, -6.0, 6.0, -6.0]
    assert math.isnan(r[4]) and math.copysign(1, r[5]) == -1
    assert F.INT4.round(torch.tensor([7.5, -9.0, 2.5, -2.5])).tolist() == [7.0, -8.0, 2.0, -2.0]


def test_fp4_packing_codes_from_reference():
    # docs/references.md §3: [0.5, -1.0] -> 0xA1, [6.0, -0.0] -> 0x87 (even element in the low nibble)
    c = F.FP4_E2M1.encode(torch.tensor([0.5, -1.0, 6.0, -0.0]))
    assert [int(c[0] | (c[1] << 4)), int(c[2] | (c[3] << 4))] == [0xA1, 0x87]


def test_int4_two_complement_codes():
    c = F.INT4.encode(torch.tensor([-8.0, -7, 0, 1, 2, 3, 4, 7]))
    assert c.tolist() == [8, 9, 0, 1, 2, 3, 4, 7]


def test_encode_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        F.FP8_E4M3.encode(torch.tensor([1.0, math.nan]))


def test_step_near_one():
    assert F.FP8_E4M3.step_near_one() == 0.125
    assert F.FP8_E5M2.step_near_one() == 0.25
    assert F.FP4_E2M1.step_near_one() == 0.5
    assert F.INT8.step_near_one() == 1.0
