"""Properties of every element format and of quantize / dequantize under generated input
(hypothesis; issue 20).

Formats (the module docstring of :mod:`lowbit.numerics.formats`): ``round`` returns a value of
the table, the nearest one, ties to the even code (the table rule), saturating at ±max (±inf
too), NaN stays NaN, ``-0.0`` keeps its sign; ``decode(encode(x)) == round(x)``.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowbit.numerics.formats import FORMATS
from lowbit.numerics.granularity import Granularity, block, group
from lowbit.numerics.qtensor import NonFiniteError, dequantize, fake_quantize, quantize
from lowbit.numerics.scheme import Scheme

FMTS = list(FORMATS.values())
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _specials(fmt):
    """Values where rounding is decided: the table, its midpoints (ties), just beside them."""
    fin = fmt.finite
    mids = [(a + b) / 2 for a, b in zip(fin, fin[1:])]
    near = [math.nextafter(m, s) for m in mids for s in (-math.inf, math.inf)]
    big = min(fmt.max * 1.5, 3.4e38)
    return [*fin, *mids, *near, big, -big]


def floats_for(fmt):
    return st.one_of(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
        st.floats(-min(2 * fmt.max, 3.3999999521443642e+38), min(2 * fmt.max, 3.3999999521443642e+38), width=32),
        st.sampled_from(_specials(fmt)).map(lambda v: float(torch.tensor(v, dtype=torch.float32))),
        st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]),
    )


def _inputs(fmt):
    return st.lists(floats_for(fmt), min_size=1, max_size=64).map(lambda v: torch.tensor(v, dtype=torch.float32))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@settings(max_examples=25, **_SETTINGS)
@given(data=st.data())
def test_round_is_nearest_representable_ties_even_saturating(fmt, data):
    x = data.draw(_inputs(fmt))
    r = fmt.round(x)
    assert r.dtype == x.dtype and r.shape == x.shape
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(r), nan)  # NaN stays NaN and appears nowhere else
    table = torch.tensor(fmt.finite, dtype=torch.float32)
    ok = ~nan
    assert torch.isin(r[ok], table).all()  # a value of the table
    xc = x[ok].clamp(fmt.min, fmt.max)  # saturating (±inf too)
    dist = (table[None, :].double() - xc[:, None].double()).abs()
    assert torch.equal((r[ok].double() - xc.double()).abs(), dist.min(dim=1).values)  # the nearest
    ref = fmt.round_by_table(x)  # ties: the table's even-code rule
    assert torch.equal(r[ok], ref[ok])
    if fmt.signed:
        zero = ok & (r == 0)
        assert torch.equal(torch.signbit(r[zero]), torch.signbit(x[zero]))  # -0.0 keeps its sign
    assert torch.equal(fmt.round(r)[ok], r[ok])  # idempotent


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@settings(max_examples=20, **_SETTINGS)
@given(data=st.data())
def test_encode_decode_round_trip(fmt, data):
    x = data.draw(_inputs(fmt))
    x = x[~torch.isnan(x)]
    if x.numel() == 0:
        with pytest.raises(ValueError):
            fmt.encode(torch.tensor([math.nan]))
        return
    codes = fmt.encode(x)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2**fmt.bits
    assert torch.equal(fmt.decode(codes), fmt.round(x))  # == treats -0.0 and 0.0 alike
    if fmt.signed and fmt.kind == "float":
        assert torch.equal(torch.signbit(fmt.decode(codes)), torch.signbit(fmt.round(x)))


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_every_finite_code_round_trips(fmt):
    codes = torch.arange(2**fmt.bits, dtype=torch.int64)
    vals = fmt.decode(codes)
    fin = torch.isfinite(vals)
    assert torch.equal(fmt.encode(vals[fin]).long(), codes[fin]) or fmt.kind == "int"
    assert torch.equal(fmt.decode(fmt.encode(vals[fin])), vals[fin])
    with pytest.raises(ValueError, match="NaN"):
        fmt.encode(torch.tensor([1.0, math.nan]))


# -- quantize / dequantize over shapes, groups and blocks ---------------------------------

_ELEMENT_SCHEMES = [
    ("int8", True, "fp32"), ("int4", True, "fp32"), ("uint4", False, "fp16"), ("uint8", False, "fp32"),
    ("fp8_e4m3", True, "fp32"), ("fp8_e5m2", True, "bf16"), ("fp4_e2m1", True, "e8m0"),
    ("fp4_e2m1", True, "fp8_e4m3"), ("fp6_e3m2", True, "e8m0"), ("int2", True, "fp32"),
]
granularities = st.one_of(
    st.sampled_from([Granularity("tensor"), Granularity("channel"), Granularity("token")]),
    st.integers(1, 40).map(group),
    st.tuples(st.integers(1, 9), st.integers(1, 9)).map(lambda rc: block(*rc)),
)
element = st.one_of(st.floats(-1e4, 1e4, width=32), st.just(0.0), st.just(-0.0),
                    st.floats(-1.0000000031710769e-30, 1.0000000031710769e-30, width=32, allow_subnormal=True))


@st.composite
def cases(draw):
    fmt, sym, sd = draw(st.sampled_from(_ELEMENT_SCHEMES))
    scheme = Scheme(FORMATS[fmt], draw(granularities), symmetric=sym, scale_dtype=sd)
    shape = tuple(draw(st.lists(st.integers(1, 13), min_size=1, max_size=3)))
    n = math.prod(shape)
    x = torch.tensor(draw(st.lists(element, min_size=n, max_size=n)), dtype=torch.float32).reshape(shape)
    return scheme, x


@settings(max_examples=150, **_SETTINGS)
@given(cases())
def test_quantize_dequantize_nearest_under_the_scale(case):
    scheme, x = case
    qt = quantize(x, scheme)
    assert qt.codes.shape == x.shape and qt.codes.dtype == torch.uint8
    y = dequantize(qt)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))  # zero stays zero (ragged blocks too)
    assert torch.equal(fake_quantize(x, scheme), y)
    # each element's code is the nearest value of the format under its block's scale
    fmt = scheme.format
    from lowbit.numerics.granularity import blocked, matrix_view
    from lowbit.numerics.qtensor import _effective_scale

    m = matrix_view(x, scheme.granularity)
    b = blocked(m, scheme.granularity)
    s = _effective_scale(qt.qparams)[:, None, :, None]
    z = 0 if qt.zero is None else qt.zero[:, None, :, None]
    scaled = torch.where(s > 0, b / s, torch.zeros_like(b)) + z
    chosen = blocked(matrix_view(qt.values(), scheme.granularity), scheme.granularity)
    table = torch.tensor(fmt.finite, dtype=torch.float32)
    best = (table - scaled.clamp(fmt.min, fmt.max).reshape(-1, 1)).abs().min(dim=1).values
    got = (chosen - scaled.clamp(fmt.min, fmt.max)).abs().reshape(-1)
    real = blocked(torch.ones_like(m), scheme.granularity).reshape(-1) > 0  # not the ragged padding
    got, best = got[real], best[real]
    assert torch.allclose(got, best, rtol=1e-5, atol=1e-6 * float(best.max().clamp(min=1)))


@settings(max_examples=40, **_SETTINGS)
@given(cases(), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_non_finite_input_is_a_clear_error(case, bad):
    scheme, x = case
    x = x.clone().reshape(-1)
    x[len(x) // 2] = bad
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        quantize(x.reshape(case[1].shape), scheme)


@pytest.mark.parametrize("size", [0, -1])
def test_bad_group_sizes_are_clear_errors(size):
    with pytest.raises(ValueError, match="positive"):
        group(size)
    with pytest.raises(ValueError, match="positive"):
        block(size, 4)
