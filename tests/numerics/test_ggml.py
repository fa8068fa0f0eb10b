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
    v = torch.randint(t.vmin, t.vmax + 1, (rows, cols), generator=g).float()
    nb, ns = cols // t.block, cols // t.super_block
    if t.two_level:
        d = (torch.rand(rows, ns, generator=g) * 1e-3 + 1e-4).half().float()
        lo, hi = (0, 63) if t.sub_bits == 6 else (-128, 127)
        sc = torch.randint(lo, hi + 1, (rows, nb), generator=g).float()
        sc[0, : hi - lo + 1 if hi - lo + 1 <= nb else nb] = torch.arange(lo, hi + 1)[:nb].float()
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
    assert G.fallback(G.get_type("q4_k"), 576).name == "q5_0"
    assert G.fallback(G.get_type("q6_k"), 576).name == "q8_0"
    assert G.fallback(G.get_type("q4_k"), 1536).name == "q4_k"
    with pytest.raises(ValueError, match="cannot hold"):
        G.fallback(G.get_type("q4_0"), 100)
