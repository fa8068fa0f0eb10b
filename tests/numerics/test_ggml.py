"""GGUF element types: lowbit's packed bytes, read by the ``gguf`` package's own dequantizers,
give exactly lowbit's fake-quantized values, type by type; round-to-nearest scales equal ggml's
reference quantizer's where the ``gguf`` package has one."""

import numpy as np
import pytest
import torch

from lowbit.numerics import ggml as G
from lowbit.numerics.ggml_pack import pack, subscale_codes
from lowbit.numerics.qtensor import dequantize, fake_quantize, quantize
from lowbit.numerics.scheme import PRESETS, Scheme, bits_per_element
from lowbit.numerics import formats as F
from lowbit.numerics.granularity import group

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q, quants  # noqa: E402

TYPES = list(G.GGML_TYPES)


def _weights(rows=6, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :64] = 0.0                                  # an all-zero block and super-block part
    w[1, 7] = 2.5                                    # an outlier
    w[2, 32:64] = torch.linspace(0.01, 0.02, 32)     # a block of one sign (min > 0)
    w[3, 256:272] = -torch.linspace(0.01, 0.03, 16)
    return w


def _packed(w, name):
    qt = quantize(w, PRESETS[f"gguf-{name}"])
    t = G.get_type(name)
    return qt, pack(qt.values(), t, qt.scale, qt.zero, qt.super_scale, qt.super_min).numpy()


@pytest.mark.parametrize("name", TYPES)
def test_packed_bytes_decode_to_lowbits_values(name):
    w = _weights()
    qt, b = _packed(w, name)
    t = G.get_type(name)
    assert b.shape == (w.shape[0], w.shape[1] // t.super_block * t.type_size)
    assert b.shape[1] == gguf.GGML_QUANT_SIZES[Q(t.type_id)][1] * w.shape[1] // gguf.GGML_QUANT_SIZES[Q(t.type_id)][0]
    ref = quants.dequantize(b, Q(t.type_id))
    mine = fake_quantize(w, PRESETS[f"gguf-{name}"]).numpy()
    assert np.array_equal(ref, mine), f"{name}: {np.abs(ref - mine).max()}"
    assert np.array_equal(dequantize(qt).numpy(), mine)


@pytest.mark.parametrize("name", TYPES)
def test_every_code_and_subscale_survives_packing(name):
    """Codes and sub-block scales at every value of their range, not only what a Gaussian gives."""
    t = G.get_type(name)
    rows, cols = 4, 512
    g = torch.Generator().manual_seed(1)
    if t.grid:                                       # iq4_nl: every table entry, then random ones
        idx = torch.randint(0, len(t.grid), (rows, cols), generator=g)
        idx[0, :len(t.grid)] = torch.arange(len(t.grid))
        v = torch.tensor(t.grid, dtype=torch.float32)[idx]
    else:
        v = torch.randint(t.vmin, t.vmax + 1, (rows, cols), generator=g).float()
    nb, ns = cols // t.block, cols // t.super_block
    if t.two_level:
        d = (torch.rand(rows, ns, generator=g) * 1e-3 + 1e-4).half().float()
        lo, hi = t.sub_range
        sc = torch.randint(lo, hi + 1, (rows, nb), generator=g).float()
        k = min(hi - lo + 1, sc.numel())             # as many codes as fit, from the lowest, and the highest
        sc.view(-1)[:k] = torch.arange(lo, lo + k).float()
        sc[-1, -1] = hi
        scale = (d.repeat_interleave(t.super_block // t.block, 1) * sc)
        zero = dmin = None
        if t.has_min:
            dmin = (torch.rand(rows, ns, generator=g) * 1e-3).half().float()
            mn = torch.randint(0, 64, (rows, nb), generator=g).float()
            zero = dmin.repeat_interleave(t.super_block // t.block, 1) * mn
            assert torch.equal(subscale_codes(zero, dmin, t).float(), mn)
        assert torch.equal(subscale_codes(scale, d, t).float(), sc)
    else:
        d = dmin = None
        scale = (torch.randn(rows, nb, generator=g) * 1e-3).half().float()
        zero = -(torch.randn(rows, nb, generator=g) * 1e-2).half().float() if t.has_min else None
    b = pack(v, t, scale, zero, d, dmin).numpy()
    assert np.array_equal(quants.dequantize(b, Q(t.type_id)), G.dequantize_values(v, t, scale, zero).numpy())


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_rtn_matches_ggml_reference_quantizer(name):
    """Same stored scales (and mins) byte for byte as gguf's port of ggml's reference quantizer;
    lowbit rounds to the nearest point of the *stored* grid (the reference divides by the
    unrounded scale), so codes may differ only where that is closer, never farther."""
    w = _weights(rows=16, cols=1024, seed=3)
    t = G.get_type(name)
    _, mine = _packed(w, name)
    ref = quants.quantize(w.numpy(), Q(t.type_id))
    hdr = {"q8_0": 2, "q4_0": 2, "q5_0": 2, "q4_1": 4, "q5_1": 4}[name]
    blocks = lambda b: b.reshape(-1, t.type_size)  # noqa: E731
    assert np.array_equal(blocks(mine)[:, :hdr], blocks(ref)[:, :hdr])
    x = w.numpy()
    e_mine = np.abs(quants.dequantize(mine, Q(t.type_id)) - x)
    e_ref = np.abs(quants.dequantize(ref, Q(t.type_id)) - x)
    assert (e_mine <= e_ref + 1e-9).all()
    assert np.mean(quants.dequantize(mine, Q(t.type_id)) == quants.dequantize(ref, Q(t.type_id))) > 0.98


def test_q3_k_bytes_at_the_extremes():
    """Q3_K's layout by hand: all elements at −4 (high bit clear, low bits 0) or at 3 (high bit set,
    low bits 3), sub-scales at −32 (stored 0) and 31 (stored 63), a super-block with d = 0; the
    bytes decode through gguf to lowbit's values."""
    t = G.get_type("q3_k")
    v = torch.full((3, 256), -4.0)
    v[1] = 3.0
    v[2, 1::2] = 3.0                                  # odd elements at the top, even ones at the bottom
    sc = torch.tensor([-32.0, 31.0]).repeat(3, 8)     # sub-blocks alternate the two extreme codes
    d = torch.tensor([[2.0 ** -10], [0.5], [0.0]])
    scale = d * sc
    b = pack(v, t, scale, None, d).numpy()
    assert b.shape == (3, 110)
    assert (b[0, :96] == 0).all() and (b[1, :96] == 0xFF).all()           # hmask and 2-bit pairs
    assert np.array_equal(b[2, :96], np.tile([0, 0xFF], 48))               # byte i holds elements i, i + 32, ...
    assert np.array_equal(b[0, 96:108], np.tile([0, 0xFF], 6))             # codes 0 (even sub-blocks), 63 (odd)
    assert np.array_equal(quants.dequantize(b, Q.Q3_K), G.dequantize_values(v, t, scale, None).numpy())
    assert (quants.dequantize(b, Q.Q3_K)[2] == 0).all()
    v2 = v.clone()
    v2[2, 1::2] = -3.0
    b2 = pack(v2, t, scale, None, d).numpy()
    assert np.array_equal(quants.dequantize(b2, Q.Q3_K), G.dequantize_values(v2, t, scale, None).numpy())


def test_q3_k_sub_scales_are_signed_6_bit():
    """The second level follows the type's sub-scale width: q3_k's codes are signed 6-bit, the
    sub-scale of largest magnitude at −32 (q6_k's at −128)."""
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(4)) * 0.02
    for name, lo in (("q3_k", -32), ("q6_k", -128)):
        t = G.get_type(name)
        qt = quantize(w, PRESETS[f"gguf-{name}"])
        sc = subscale_codes(qt.scale, qt.super_scale, t)
        assert t.sub_range == (lo, -lo - 1) and sc.min() >= lo and sc.max() <= -lo - 1
        assert (sc.reshape(8, 2, -1).abs().amax(-1) == -lo).all()   # each super-block's extreme sub-scale
    assert G.get_type("q4_k").sub_range == (0, 63)


def test_iq4_nl_rounds_to_the_nearest_table_entry():
    """Rounding on the table: the nearest entry (a tie goes to the larger one, as ggml's
    ``best_index_int8``), saturating at both ends, NaN kept; an all-zero block gives v = 1 (the
    entry nearest 0) times d = 0."""
    t = G.get_type("iq4_nl")
    grid = torch.tensor(t.grid, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.linspace(-200, 200, 4001), mids, grid, torch.tensor([-1e4, 1e4])])
    got = G.round_values(x, t)
    dist = (x[:, None] - grid).abs()
    nearest = grid[(dist == dist.min(dim=1, keepdim=True).values).float().cumsum(1).argmax(1)]  # the last, larger, on a tie
    assert torch.equal(got, nearest)
    assert torch.equal(G.round_values(mids, t), grid[1:])
    assert torch.isnan(G.round_values(torch.tensor([float("nan")]), t)).all()
    assert torch.equal(G.grid_index(grid, t), torch.arange(16))
    with pytest.raises(ValueError, match="not entries of its table"):
        G.grid_index(torch.tensor([2.0]), t)
    z = torch.zeros(2, 64)
    qt = quantize(z, PRESETS["gguf-iq4_nl"])
    assert (qt.values() == 1).all() and torch.equal(dequantize(qt), z)
    assert PRESETS["gguf-iq4_nl"].format.name == "int8"


def test_gptq_with_identity_hessian_is_rtn_on_the_new_grids():
    """GPTQ's per-column rounding goes through the same element rounding (the table for iq4_nl):
    with H = I it gives round to nearest bit for bit."""
    from lowbit.quantization.algorithms.gptq import gptq

    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(5)) * 0.05
    for name in ("iq4_nl", "q3_k"):
        scheme = PRESETS[f"gguf-{name}"]
        got, want = gptq(w, 2.0 * torch.eye(512), scheme, damp=0.01, block_size=64), quantize(w, scheme)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale), name
        assert torch.equal(dequantize(got), dequantize(want)), name


def test_k_quant_second_level_is_quantized():
    w = _weights()
    qt = quantize(w, PRESETS["gguf-q4_k"])
    assert qt.super_scale.shape == (6, 2) and qt.super_min.shape == (6, 2)
    sc = subscale_codes(qt.scale, qt.super_scale, G.get_type("q4_k"))
    assert sc.min() >= 0 and sc.max() <= 63 and sc.max() >= 62   # the largest sub-scale uses the top of the range
    assert torch.equal(qt.super_scale, qt.super_scale.half().float())


def test_bits_per_element_is_the_file_size():
    for name, t in G.GGML_TYPES.items():
        assert bits_per_element(PRESETS[f"gguf-{name}"]) == t.type_size * 8 / t.super_block
    assert bits_per_element(PRESETS["gguf-q4_k"]) == 4.5 and bits_per_element(PRESETS["gguf-q6_k"]) == 6.5625
    assert bits_per_element(PRESETS["gguf-q3_k"]) == 3.4375 and bits_per_element(PRESETS["gguf-iq4_nl"]) == 4.5


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.randn(4, 288), PRESETS["gguf-q4_k"])
    with pytest.raises(ValueError, match="granularity"):
        Scheme(F.INT4, group(64), scale_dtype="fp16", ggml="q4_0")
    with pytest.raises(ValueError, match="unknown ggml type"):
        Scheme(F.INT4, group(32), scale_dtype="fp16", ggml="q3_q")
    with pytest.raises(NotImplementedError, match="scales_from_range"):
        PRESETS["gguf-q4_0"].scales_from_range(torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="whole multiples"):
        t = G.get_type("q6_k")
        pack(torch.zeros(1, 256), t, torch.full((1, 16), 0.3), None, torch.full((1, 1), 0.7))


def test_fallback_is_llama_quantizes():
    """llama.cpp 11434's ``tensor_type_fallback`` (older releases wrote IQ4_NL for Q3_K)."""
    assert G.fallback(G.get_type("q4_k"), 576).name == "q5_0"
    assert G.fallback(G.get_type("q6_k"), 576).name == "q8_0"
    assert G.fallback(G.get_type("q3_k"), 640).name == "q4_0"
    assert G.fallback(G.get_type("iq4_nl"), 576).name == "iq4_nl"
    assert G.fallback(G.get_type("q4_k"), 1536).name == "q4_k"
    with pytest.raises(ValueError, match="cannot hold"):
        G.fallback(G.get_type("q4_0"), 100)
