"""Learned rounding (SignRound-style): exact at the start, never worse than its start on its
own data, codes on the format's grid, every format lowbit has but GGUF."""

import pytest
import torch
from torch.func import functional_call

from lowbit.numerics import formats as F
from lowbit.numerics.qtensor import QParams, dequantize, quantize
from lowbit.numerics.scheme import PRESETS
from lowbit.quantization.algorithms import LearnedRounding, gptq, optimize_rounding
from lowbit.quantization.algorithms.rtn import mse_qparams

SCHEMES = ["int4-g64", "int4-g64-asym", "int4-channel", "int8-channel", "mxfp4", "nvfp4", "fp8-block", "int2-g64",
           "int4-g64-signed"]


def _w(rows=128, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * (1 + 3 * torch.rand(cols, generator=g))


def _hessian(cols=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, cols, generator=g) * torch.rand(cols, generator=g) * 3
    return x.T @ x


def _inits(w, name):
    scheme = PRESETS[name]
    return {
        "min-max": quantize(w, scheme),
        "mse": quantize(w, scheme, mse_qparams(w, scheme)),
        "gptq": gptq(w, _hessian(w.shape[1]), scheme, act_order=True, static_groups=True),
    }


@pytest.mark.parametrize("name", SCHEMES)
def test_at_the_start_it_is_its_initial_quantization_bit_for_bit(name):
    w = _w()
    for kind, init in _inits(w, name).items():
        r = LearnedRounding(w, init)
        assert torch.equal(r.weight(), dequantize(init)), kind
        qt = r.qtensor()
        assert torch.equal(qt.values(), init.values()), kind  # ±0 may differ in FP codes, not in value
        assert torch.equal(qt.scale, init.scale), kind
        assert (qt.zero is None) == (init.zero is None) and (qt.zero is None or torch.equal(qt.zero, init.zero))
        # min-max and MSE codes are round-to-nearest at their scales: AdaRound's space; GPTQ's are not
        assert r.radius == (1.0 if kind == "gptq" else 0.5), kind


@pytest.mark.parametrize("name", ["int4-g64", "int4-g64-asym", "mxfp4", "nvfp4", "int4-g64-signed"])
def test_gptq_rounding_inputs_round_to_its_codes(name):
    """GPTQ's weights as it rounded them: round-to-nearest of them at GPTQ's scales is GPTQ's
    result, so learned rounding anchored there starts in AdaRound's space (radius ½)."""
    w, scheme = _w(), PRESETS[name]
    qt, anchor = gptq(w, _hessian(), scheme, act_order=True, static_groups=True, rounding_inputs=True)
    assert torch.equal(qt.codes, gptq(w, _hessian(), scheme, act_order=True, static_groups=True).codes)
    assert torch.equal(quantize(anchor, scheme, qt.qparams).values(), qt.values())
    assert not torch.equal(anchor, w)
    r = LearnedRounding(anchor, qt)
    assert r.radius == 0.5 and torch.equal(r.weight(), dequantize(qt))


def test_zero_steps_return_the_inits_themselves():
    w = _w()
    init = quantize(w, PRESETS["int4-g64"])
    x = torch.randn(32, 256)
    res = optimize_rounding(lambda ws, x: x @ ws["w"].T, {"w": w}, {"w": init}, [(x, x @ w.T)], steps=0)
    assert res.qtensors["w"] is init and res.loss_final == res.loss_init and not res.improved


def _mlp_problem(seed=0):
    """A two-Linear block with a nonlinearity and inputs of uneven channel scales."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(128, 64, generator=g) / 8, torch.randn(64, 128, generator=g) / 11
    xs = [torch.randn(64, 64, generator=g) * (0.2 + 3 * torch.rand(64, generator=g)) for _ in range(4)]

    def forward(ws, x):
        return torch.nn.functional.silu(x @ ws["a"].T) @ ws["b"].T

    weights = {"a": a, "b": b}
    return forward, weights, [(x, forward(weights, x)) for x in xs]


@pytest.mark.parametrize("name", ["int4-g64", "int4-g64-asym", "mxfp4", "nvfp4", "int4-g64-signed"])
@pytest.mark.parametrize("learn_clip", [True, False])
def test_it_lowers_the_block_output_error_and_never_raises_it(name, learn_clip):
    forward, weights, batches = _mlp_problem()
    inits = {n: quantize(w, PRESETS[name]) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=60, learn_clip=learn_clip, checks=3)
    loss = sum(float(((forward({n: dequantize(q) for n, q in res.qtensors.items()}, x) - t) ** 2).sum())
               for x, t in batches) / sum(t.numel() for _, t in batches)
    assert loss == pytest.approx(res.loss_final, rel=1e-5)  # what it reports is what its QTensors do
    assert res.loss_final <= res.loss_init
    assert res.loss_final < 0.85 * res.loss_init, (res.loss_init, res.loss_final)


def test_bf16_steps_are_judged_in_the_weights_dtype():
    """Training steps under bf16 autocast still lower the error, and the reported losses (the
    checks that choose the result) are the fp32 ones of the QTensors returned."""
    forward, weights, batches = _mlp_problem()
    inits = {n: quantize(w, PRESETS["int4-g64"]) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=60, checks=3, compute=torch.bfloat16)
    loss = sum(float(((forward({n: dequantize(q) for n, q in res.qtensors.items()}, x) - t) ** 2).sum())
               for x, t in batches) / sum(t.numel() for _, t in batches)
    assert loss == pytest.approx(res.loss_final, rel=1e-5)
    assert res.loss_final < 0.85 * res.loss_init, (res.loss_init, res.loss_final)


def test_a_start_it_cannot_beat_is_kept():
    """With a step size that only thrashes, every check is worse than the start: the inits
    themselves come back."""
    forward, weights, batches = _mlp_problem(1)
    inits = {n: quantize(w, PRESETS["int4-g64"]) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=4, lr=5.0, clip_lr=5.0)
    assert res.loss_final <= res.loss_init
    if not res.improved:
        assert all(res.qtensors[n] is inits[n] for n in inits)


@pytest.mark.parametrize("name", SCHEMES)
def test_codes_and_scales_stay_on_their_grids(name):
    forward, weights, batches = _mlp_problem(2)
    scheme = PRESETS[name]
    inits = {n: quantize(w, scheme) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=24, lr=0.3, clip_lr=0.1, checks=1)
    for n, qt in res.qtensors.items():
        vals = qt.values()
        assert torch.isin(vals, torch.tensor(scheme.format.finite)).all()
        assert torch.equal(scheme.round_scale(qt.scale), qt.scale)      # storable as scale_dtype
        if qt.zero is not None:
            assert torch.equal(qt.zero, qt.zero.round()) and qt.zero.min() >= 0 and qt.zero.max() <= 15
        if scheme.scale_dtype == "e8m0":
            assert torch.equal(torch.exp2(torch.log2(qt.scale).round()), qt.scale)
        back = quantize(dequantize(qt), scheme, QParams(qt.scale, qt.zero, qt.global_scale))
        assert torch.equal(back.values(), vals)                         # the stored tensor is a fixed point


def test_offsets_move_each_code_at_most_one_step_from_round_to_nearest():
    forward, weights, batches = _mlp_problem(3)
    scheme = PRESETS["int4-g64"]
    inits = {n: quantize(w, scheme) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=40, lr=0.1, learn_clip=False, checks=1)
    assert res.improved
    moved = 0
    for n, qt in res.qtensors.items():
        d = (qt.values() - inits[n].values()).abs()
        assert d.max() <= 1                      # floor or ceil of W / s: AdaRound's choice
        moved += int((d > 0).sum())
    assert moved > 0


def test_fp_offsets_are_in_units_of_the_local_grid_step():
    """On E2M1's non-uniform grid an offset of ±½ local step rounds every value to its grid
    neighbour above / below (MXFP4 block with scale 1: the element values are the weights)."""
    w = torch.tensor([[0.3, 1.2, 2.5, 5.1] * 8])   # E2M1 spacing 0.5, 0.5, 1, 2 there
    scheme = PRESETS["mxfp4"]
    init = quantize(w, scheme)
    assert torch.equal(init.scale, torch.ones(1, 1))
    for sign, want in ((0.5, [0.5, 1.5, 3.0, 6.0]), (-0.5, [0.0, 1.0, 2.0, 4.0])):
        r = LearnedRounding(w, init, learn_clip=False)
        with torch.no_grad():
            r.offset.fill_(sign * 0.999)
        assert r.qtensor().values()[0, :4].tolist() == want
        assert torch.equal(r.weight().detach(), dequantize(r.qtensor()))


def test_refused_inputs():
    w = _w(8, 64)
    with pytest.raises(NotImplementedError, match="GGUF"):
        LearnedRounding(w.repeat(1, 4), quantize(w.repeat(1, 4), PRESETS["gguf-q4_0"]))
    with pytest.raises(ValueError, match="clip_min"):
        LearnedRounding(w, quantize(w, PRESETS["int4-g64"]), clip_min=0.0)
    with pytest.raises(ValueError, match="different tensors"):
        optimize_rounding(lambda ws, x: x, {"a": w}, {"b": quantize(w, PRESETS["int4-g64"])}, [(w, w)], steps=1)
    with pytest.raises(ValueError, match="no training batches"):
        optimize_rounding(lambda ws, x: x, {"a": w}, {"a": quantize(w, PRESETS["int4-g64"])}, [], steps=1)


def test_on_a_decoder_layer_of_a_tiny_llama():
    """The block is a real Llama decoder layer run with ``functional_call``; the result never
    has a larger output error than its start on the calibration batches, and here lowers it."""
    from tinymodels import tiny_llama, token_windows
    from lowbit.quantization.layerwise import capture_inputs

    model = tiny_llama()
    model.requires_grad_(False)
    inputs, kwargs = capture_inputs(model, token_windows(8, 32), 2)
    layer = model.model.layers[0]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    mods = dict(layer.named_modules())
    weights = {n: mods[n].weight.detach().clone() for n in names}

    def forward(ws, x):
        out = functional_call(layer, {f"{n}.weight": w for n, w in ws.items()}, (x,), kwargs[0])
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        batches = [(x, forward(weights, x)) for x in inputs]
    inits = {n: quantize(w, PRESETS["int4-g64-asym"] if "mlp" in n else PRESETS["int4-g64"]) for n, w in weights.items()}
    res = optimize_rounding(forward, weights, inits, batches, steps=40, lr=0.05, checks=2)
    assert res.loss_final <= res.loss_init
    assert res.improved, (res.loss_init, res.loss_final)


@pytest.mark.parametrize("name", ["int4-g64", "int2-g64", "int4-g64-signed", "int8-channel", "int4-g128",
                                  "int4-g64-asym", "int4-g128-asym"])
@pytest.mark.parametrize("start", ["min-max", "gptq"])
def test_the_fused_integer_path_is_the_generic_one(name, start):
    """Integers take one fused autograd function; moved off the start (offsets and clip factors),
    it gives the generic composition's weights bit for bit, the same offset gradients bit for bit,
    and the clip factors' gradients to rounding (the same terms summed in another order; for
    asymmetric schemes the zero point's two terms cancel there and are left out here)."""
    w = _w(seed=3)
    init = _inits(w, name)[start]
    anchor = dequantize(init, torch.float32) if start == "gptq" else w
    fused, generic = LearnedRounding(anchor, init), LearnedRounding(anchor, init)
    assert fused.fused
    generic.fused = False
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        move = (torch.rand(fused.offset.shape, generator=g) - 0.5) * 0.9
        clip = 0.6 + 0.4 * torch.rand(fused.alpha.shape, generator=g)
        clip_lo = None if fused.beta is None else 0.6 + 0.4 * torch.rand(fused.alpha.shape, generator=g)
        for r in (fused, generic):
            r.offset.copy_(move)
            r.alpha.copy_(clip)
            if r.beta is not None:
                r.beta.copy_(clip_lo)
    upstream = torch.randn(w.shape, generator=g)
    outs = []
    for r in (fused, generic):
        out = r.weight()
        (out * upstream).sum().backward()
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], dequantize(init, torch.float32))  # the move changed codes and scales
    assert torch.equal(fused.offset.grad, generic.offset.grad)
    for a, b in ((fused.alpha, generic.alpha), (fused.beta, generic.beta)):
        if b is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6 * b.grad.abs().max())
            assert b.grad.abs().max() > 0
    assert fused.qtensor().values().equal(generic.qtensor().values())
    if fused.beta is not None:
        assert fused.qtensor().zero.equal(generic.qtensor().zero)


def test_other_formats_keep_the_generic_path():
    w = _w()
    for name in ("mxfp4", "nvfp4", "fp8-block"):
        assert not LearnedRounding(w, quantize(w, PRESETS[name])).fused, name
