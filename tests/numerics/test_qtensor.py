"""Schemes and QTensor: the worked examples of docs/references.md §1, and properties."""

import math

import pytest
import torch

import lowbit as lb
from lowbit.numerics import formats as F
from lowbit.numerics.granularity import parse_granularity

W8 = torch.tensor([[0.12, -0.50, 0.31, 0.90, -0.05, 0.00, 0.44, -0.27]])


def test_worked_example_int4_symmetric():
    qt = lb.quantize_tensor(W8, lb.Scheme(F.INT4, lb.CHANNEL))
    assert qt.scale.item() == pytest.approx(0.9 / 7) and round(qt.scale.item(), 4) == 0.1286
    assert qt.values().tolist() == [[1, -4, 2, 7, 0, 0, 3, -2]]
    mse = ((lb.dequantize(qt) - W8) ** 2).mean().item()
    assert round(mse, 5) == pytest.approx(1.09e-3, abs=5e-6)


def test_worked_example_int4_asymmetric():
    qt = lb.quantize_tensor(W8, lb.Scheme(F.UINT4, lb.CHANNEL, symmetric=False))
    assert round(qt.scale.item(), 4) == 0.0933
    assert qt.zero.item() == 5
    assert qt.values().tolist() == [[6, 0, 8, 15, 4, 5, 10, 2]]
    mse = ((lb.dequantize(qt) - W8) ** 2).mean().item()
    assert mse == pytest.approx(0.82e-3, abs=5e-6)


def test_worked_example_int8_step():
    x = torch.tensor([[2.54, -1.0, 1.0]])
    qt = lb.quantize_tensor(x, lb.Scheme(F.INT8, lb.TENSOR))
    assert qt.scale.item() == pytest.approx(0.02)
    assert qt.values()[0, 2].item() == 50


def test_bits_per_element_worked_examples():
    g64 = lb.Scheme(F.UINT4, lb.group(64), symmetric=False, scale_dtype="fp16")
    assert lb.bits_per_element(g64) == 4 + 20 / 64 == 4.3125
    assert lb.bits_per_element(lb.PRESETS["int4-g128"]) == 4.125
    assert lb.bits_per_element(lb.PRESETS["mxfp4"]) == 4.25
    assert lb.bits_per_element(lb.PRESETS["mxfp8"]) == 8.25
    assert lb.bits_per_element(lb.PRESETS["nvfp4"]) == pytest.approx(4.5, abs=1e-5)


@pytest.mark.parametrize(
    "bits, gb",
    [(16.0, 140), ("fp8-channel", 70), ("int4-g128", 36), ("mxfp4", 37), ("nvfp4", 39)],
)
def test_storage_for_70b_params(bits, gb):
    # docs/references.md §1: BF16 ≈ 140 GB, FP8 ≈ 70 GB, INT4 g128 ≈ 36 GB, MXFP4 ≈ 37 GB, NVFP4 ≈ 39 GB
    bpe = bits if isinstance(bits, float) else lb.bits_per_element(lb.PRESETS[bits], (8192, 8192))
    assert round(70e9 * bpe / 8 / 1e9) == gb


def test_ragged_group_has_ceil_scales():
    x = torch.randn(4, 100)
    s = lb.Scheme(F.INT4, lb.group(32))
    qt = lb.quantize_tensor(x, s)
    assert qt.scale.shape == (4, 4)
    assert s.granularity.scale_shape((4, 100)) == (4, 4)
    # the last (ragged) group's scale comes from its own 4 elements
    assert qt.scale[0, 3].item() == pytest.approx(x[0, 96:].abs().max().item() / 7)
    assert torch.equal(lb.fake_quantize(x, s), lb.dequantize(qt))


def test_block_scale_shape():
    x = torch.randn(300, 260)
    qt = lb.quantize_tensor(x, lb.PRESETS["fp8-block"])
    assert qt.scale.shape == (3, 3)
    assert qt.scale[2, 2].item() == pytest.approx(x[256:, 256:].abs().max().item() / 448)


def _nearest_grid_value(x, scale, zero, fmt):
    """Brute force: the representable value (code−zero)·scale nearest to x."""
    grid = (torch.tensor(fmt.finite, dtype=torch.float64) - zero) * scale
    return grid[(x - grid).abs().argmin()]


@pytest.mark.parametrize("name", ["int4-g128", "int4-g64-asym", "fp8-channel", "mxfp4", "nvfp4", "int8-tensor", "mxfp6"])
def test_dequantize_is_nearest_representable_under_the_scale(name):
    scheme = lb.PRESETS[name]
    torch.manual_seed(0)
    x = torch.randn(4, 256) * torch.tensor([[0.01], [1.0], [30.0], [1e-3]])
    qt = lb.quantize_tensor(x, scheme)
    y = lb.dequantize(qt, torch.float64)
    eff = qt.scale.to(torch.float64)
    if qt.global_scale is not None:
        eff = eff * qt.global_scale.double()
    rows, cols = x.shape
    br, bc = scheme.granularity.block_shape(rows, cols)
    for i in range(0, rows):
        for j in range(0, cols, 7):  # a sample of positions
            s = eff[i // br, j // bc].item()
            z = 0.0 if qt.zero is None else qt.zero[i // br, j // bc].item()
            want = _nearest_grid_value(x[i, j].double(), s, z, scheme.format)
            assert abs(y[i, j].item() - want.item()) <= 1e-6 * abs(want.item()) + 1e-30 or \
                abs(x[i, j].item() - y[i, j].item()) <= abs(x[i, j].item() - want.item()) * (1 + 1e-6)


@pytest.mark.parametrize("name", list(lb.PRESETS))
def test_zero_stays_zero_and_zero_blocks_are_safe(name):
    scheme = lb.PRESETS[name]
    x = torch.randn(8, 256)
    x[:, ::3] = 0.0
    x[2] = 0.0  # an all-zero row: every block in it is all zero
    y = lb.fake_quantize(x, scheme)
    # GGUF's types with a float min (Q4_1, Q5_1, the k-quants' quantized min) and IQ4_NL (its table has no 0)
    # hold no exact zero inside a block that has other values, as in llama.cpp; their all-zero blocks stay zero
    no_zero = scheme.ggml and (scheme.ggml_type.has_min or bool(scheme.ggml_type.grid))
    kept = (x == 0) if not no_zero else (x[2:3] == 0)
    assert torch.all((y if not no_zero else y[2:3])[kept] == 0)
    assert torch.isfinite(y).all()
    assert torch.equal(y, lb.dequantize(lb.quantize_tensor(x, scheme)))
    z = lb.fake_quantize(torch.zeros(4, 256), scheme)
    assert torch.equal(z, torch.zeros(4, 256))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_refused(bad):
    x = torch.randn(4, 64)
    x[1, 5] = bad
    with pytest.raises(lb.numerics.qtensor.NonFiniteError, match="1 of 256 elements are NaN or inf"):
        lb.quantize_tensor(x, lb.PRESETS["int4-g64"])
    with pytest.raises(lb.numerics.qtensor.NonFiniteError):
        lb.fake_quantize(x, lb.PRESETS["nvfp4"])


def test_mx_scale_follows_ocp_rule_and_round_up_option():
    x = torch.zeros(1, 32)
    x[0, 0] = 7.0  # floor(log2 7) = 2; emax(E2M1) = 2 -> scale 2^0; 7 clips to 6
    ocp = lb.Scheme(F.FP4_E2M1, lb.group(32), scale_dtype="e8m0")
    qt = lb.quantize_tensor(x, ocp)
    assert qt.scale.item() == 1.0 and lb.dequantize(qt)[0, 0].item() == 6.0
    # the preset's nearest rule: 7 = 1.75·2^2 counts as 2^3 -> scale 2 -> 3.5 -> 4 (even code) -> 8
    qt = lb.quantize_tensor(x, lb.PRESETS["mxfp4"])
    assert qt.scale.item() == 2.0 and lb.dequantize(qt)[0, 0].item() == 8.0
    x[0, 0] = 6.5  # 1.625·2^2: stays at 2^2 -> scale 1, clips to 6
    assert lb.quantize_tensor(x, lb.PRESETS["mxfp4"]).scale.item() == 1.0
    x[0, 0] = 7.0
    up = lb.Scheme(F.FP4_E2M1, lb.group(32), scale_dtype="e8m0", mx_round_up=True)
    qt = lb.quantize_tensor(x, up)  # ceil(log2(7/6)) = 1 -> scale 2, 7/2 = 3.5 -> 4 (tie to even code) -> 8
    assert qt.scale.item() == 2.0 and lb.dequantize(qt)[0, 0].item() == 8.0


def test_nvfp4_scales_follow_reference():
    torch.manual_seed(1)
    x = torch.randn(2, 64)
    qt = lb.quantize_tensor(x, lb.PRESETS["nvfp4"])
    amax = x.abs().max()
    assert qt.global_scale.item() == pytest.approx(amax.item() / (448 * 6))
    blk = x.reshape(2, 4, 16).abs().amax(-1)
    want = (blk / 6 * (1 / qt.global_scale)).to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(qt.scale, want)
    # the largest block scale uses the top of the FP8 range
    assert qt.scale.max().item() == 448.0


def test_scale_is_stored_rounded():
    x = torch.randn(16, 128) * 3
    qt = lb.quantize_tensor(x, lb.PRESETS["int4-g128"])  # bf16 scales
    assert torch.equal(qt.scale, qt.scale.to(torch.bfloat16).float())


def test_scheme_validation_errors():
    with pytest.raises(ValueError, match="asymmetric quantization needs an integer format"):
        lb.Scheme(F.FP8_E4M3, lb.CHANNEL, symmetric=False)
    with pytest.raises(ValueError, match="scale format"):
        lb.Scheme(F.E8M0, lb.CHANNEL)
    with pytest.raises(ValueError, match="unknown scale_dtype"):
        lb.Scheme(F.INT4, lb.CHANNEL, scale_dtype="fp64")
    with pytest.raises(ValueError, match="group size must be a positive"):
        lb.group(0)
    with pytest.raises(ValueError, match="unknown scheme 'int3-g7'"):
        lb.get_scheme("int3-g7")


def test_scheme_from_dict_names_the_key_path():
    from lowbit.numerics.scheme import scheme_from_dict

    s = scheme_from_dict({"format": "int4", "granularity": "group:64", "scale_dtype": "bf16", "full_range": True},
                         "rules[0].weights")
    assert s == lb.PRESETS["int4-g64"]
    with pytest.raises(ValueError, match=r"rules\[0\].weights: unknown key\(s\) \['bitz'\]"):
        scheme_from_dict({"format": "int4", "granularity": "channel", "bitz": 3}, "rules[0].weights")
    with pytest.raises(ValueError, match=r"w.format: unknown format 'int9'"):
        scheme_from_dict({"format": "int9", "granularity": "channel"}, "w")


def test_parse_granularity():
    assert parse_granularity("group(128)") == lb.group(128)
    assert parse_granularity("block:128x128") == lb.block(128, 128)
    assert parse_granularity("token") == lb.TOKEN
    with pytest.raises(ValueError, match="unknown granularity"):
        parse_granularity("row")


def test_head_granularity_is_per_head():
    k = torch.randn(2, 3, 10, 8)  # (batch, heads, seq, dim)
    k[:, 1] *= 100
    s = lb.Scheme(F.FP8_E4M3, lb.HEAD)
    qt = lb.quantize_tensor(k, s)
    assert qt.scale.shape == (3, 1)
    assert qt.scale[1].item() == pytest.approx(k[:, 1].abs().max().item() / 448)
    assert lb.dequantize(qt).shape == k.shape
    assert torch.equal(lb.fake_quantize(k, s), lb.dequantize(qt))


def test_static_qparams_are_used():
    x = torch.randn(4, 64)
    scheme = lb.PRESETS["fp8-tensor"]
    qp = lb.QParams(scale=torch.tensor([[0.5 / 448]]))  # a calibrated range of 0.5
    y = lb.fake_quantize(x, scheme, qp)
    assert y.abs().max().item() == pytest.approx(0.5)


def test_sqnr():
    x = torch.randn(1000)
    assert lb.sqnr(x, x) == math.inf
    assert lb.sqnr(x, x * 1.1) == pytest.approx(20.0, abs=1e-4)
    # 8-bit beats 4-bit by roughly 6 dB per bit
    w = torch.randn(64, 512)
    d = lb.sqnr(w, lb.fake_quantize(w, lb.PRESETS["int8-channel"])) - lb.sqnr(
        w, lb.fake_quantize(w, lb.PRESETS["int4-channel"])
    )
    assert 20 < d < 28


def test_full_range_int_scale_matches_compressed_tensors():
    """full_range maps amax to 7.5 for INT4 (all 16 levels), as compressed-tensors does."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    full = lb.Scheme(F.INT4, lb.CHANNEL, full_range=True)
    qt = lb.quantize_tensor(W8, full)
    assert qt.scale.item() == pytest.approx(0.9 / 7.5)
    assert qt.values().tolist() == [[1, -4, 3, 7, 0, 0, 4, -2]]  # 0.9 / 0.12 = 7.5 clips to 7; −8 is usable
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    assert torch.allclose(lb.compute_qparams(w, full).scale, scale, rtol=1e-6)
    ct = ct_fake_quantize(w, scale, zp, args)
    assert torch.allclose(lb.fake_quantize(w, full), ct, atol=1e-6)
    with pytest.raises(ValueError, match="full_range applies to symmetric integer formats"):
        lb.Scheme(F.FP8_E4M3, lb.CHANNEL, full_range=True)


def test_signed_scale_puts_each_blocks_extreme_on_the_lowest_level():
    """signed_scale: scale = extreme / qmin, so the largest-magnitude element is exact, every level
    is used, and the scale is negative where the extreme is positive; only elements of the other
    sign beyond qmax + ½ steps saturate (at most one step away)."""
    signed = lb.Scheme(F.INT4, lb.CHANNEL, signed_scale=True)
    qt = lb.quantize_tensor(W8, signed)
    assert qt.scale.item() == pytest.approx(-0.9 / 8)                  # the extreme 0.90 is positive
    assert qt.values().tolist() == [[-1, 4, -3, -8, 0, 0, -4, 2]]
    assert lb.dequantize(qt)[0, 3].item() == pytest.approx(0.9)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g)
    w[0, :64] = -w[0, :64].abs()                                       # a group whose extreme is negative
    for bits, fmt in ((4, F.INT4), (2, F.INT2)):
        s = lb.Scheme(fmt, lb.group(64), signed_scale=True)
        qt = lb.quantize_tensor(w, s)
        scale = qt.scale                                               # (32, 2)
        ext = w.reshape(32, 2, 64).gather(2, w.reshape(32, 2, 64).abs().argmax(2, keepdim=True))[..., 0]
        assert torch.equal(torch.sign(scale), -torch.sign(ext)) and scale[0, 0] > 0
        assert torch.allclose(scale, ext / fmt.min)
        err = (lb.dequantize(qt) - w).abs().reshape(32, 2, 64)
        y = w.reshape(32, 2, 64) / scale[..., None]
        assert (y >= fmt.min - 1e-5).all()
        inside = y <= fmt.max + 0.5
        step = scale.abs()[..., None].expand_as(err)
        assert (err[inside] <= step[inside] / 2 * (1 + 1e-5)).all()
        assert (err[~inside] <= step[~inside] * (1 + 1e-5)).all()
        full = lb.Scheme(fmt, lb.group(64), full_range=True)
        assert ((lb.dequantize(qt) - w) ** 2).mean() < ((lb.fake_quantize(w, full) - w) ** 2).mean()
    assert torch.equal(lb.quantize_tensor(torch.zeros(2, 64), lb.Scheme(F.INT4, lb.group(64), signed_scale=True)).scale,
                       torch.zeros(2, 1))


def test_signed_scale_is_llama_cpp_q4_0s_rule():
    """INT4, groups of 32, fp16 scales, signed: the scales of the gguf package's own Q4_0 quantizer
    (d = max / −8) exactly, and the same codes except at exact half steps (it rounds half up)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, quants

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * 0.02
    s = lb.Scheme(F.INT4, lb.group(32), scale_dtype="fp16", signed_scale=True)
    ref = quants.quantize(w.numpy(), Q.Q4_0).reshape(-1, 18)
    d_ref = ref[:, :2].copy().view(np.float16).astype(np.float32).reshape(64, 8)
    qt = lb.quantize_tensor(w, s)
    assert np.array_equal(qt.scale.numpy(), d_ref)
    same = np.isclose(lb.dequantize(qt).numpy(), quants.dequantize(ref.reshape(64, -1), Q.Q4_0), rtol=0, atol=1e-9)
    assert same.mean() > 0.999


@pytest.mark.parametrize("kw,msg", [
    (dict(format=F.FP8_E4M3), "signed_scale applies to symmetric integer"),
    (dict(format=F.UINT4, symmetric=False), "signed_scale applies to symmetric integer"),
    (dict(full_range=True), "exclude each other"),
    (dict(dynamic=True), "signed_scale is for weights"),
])
def test_signed_scale_refuses_what_it_cannot_mean(kw, msg):
    args = dict(format=F.INT4, granularity=lb.group(64), signed_scale=True) | kw
    with pytest.raises(ValueError, match=msg):
        lb.Scheme(**args)


@pytest.mark.parametrize("bits,preset", [(4, "mxfp4"), (8, "mxfp8")])
def test_mx_nearest_scales_equal_compressed_tensors(bits, preset):
    mx = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    torch.manual_seed(0)
    amax = torch.cat([torch.rand(2000) * 10.0 ** torch.randint(-6, 6, (2000,)),
                      torch.tensor([1.0, 1.5, 1.74, 1.75, 1.76, 1.9999, 3.5, 6.0, 7.0, 448.0])])
    want = torch.exp2(mx.generate_mx_scales(amax, bits) - 127)
    got, _ = lb.PRESETS[preset].scales_from_range(-amax[:, None], amax[:, None], None)
    assert torch.equal(got[:, 0], want)
