"""The layer-by-layer pipeline on tiny models: calibration methods run, are exact where
they must be, and reduce error where they should."""

import pytest
import torch

from lowbit.evaluation.metrics import evaluate, reference_predictions
from lowbit.quantization.layerwise import capture_inputs
from lowbit.models.arch import decoder_layers
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.runtime import plain_forward, quantized_execution


@pytest.fixture
def calib():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (32, 24), generator=g)  # 768 tokens: enough that GPTQ does not overfit


def _kl(model, recipe, windows, calib, ref):
    state = quantize(model, recipe, calibration=calib, progress=False)
    with quantized_execution(model, state) as fwd:
        return evaluate(fwd, windows, ref, progress=False).kl_mean, state


def test_capture_inputs_reproduce_the_model(tiny_model, calib):
    inputs, kwargs = capture_inputs(tiny_model, calib, batch=3)
    assert sum(x.shape[0] for x in inputs) == len(calib)
    # running the layers by hand on the captured inputs gives the model's final hidden states
    h = inputs[0]
    for i, layer in enumerate(decoder_layers(tiny_model)):
        out = layer(h, **kwargs[i])
        h = out[0] if isinstance(out, tuple) else out
    with torch.no_grad():
        want = tiny_model.model(input_ids=calib[:3]).last_hidden_state
    assert torch.allclose(tiny_model.model.norm(h), want, atol=1e-5)


def test_layerwise_minmax_equals_plain_rounding(tiny_llama, windows, calib):
    import copy

    a, b = copy.deepcopy(tiny_llama), copy.deepcopy(tiny_llama)
    sa = quantize(a, RECIPES["w8a8-int8"], progress=False)
    # a no-op rotation forces the layer-by-layer path; min-max weights do not depend on inputs
    r = recipe_from_dict({"weights": "int8-channel", "inputs": "int8-token",
                          "algorithms": {"rotation": {"residual": False, "down": False}, "batch": 3}})
    assert r.algorithms.layerwise
    sb = quantize(b, r, calibration=calib, progress=False)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    with quantized_execution(a, sa) as fa, quantized_execution(b, sb) as fb:
        assert torch.equal(fa(windows[:1]), fb(windows[:1]))


@pytest.mark.parametrize("name", ["w4a16-gptq-g64", "w4a16-awq-g64-asym", "w4a16-int4-g64-mse"])
def test_calibration_methods_beat_rtn(tiny_llama, windows, calib, name):
    import copy

    ref = reference_predictions(plain_forward(tiny_llama), windows, k=256, progress=False)
    base = RECIPES["w4a16-int4-g64-asym" if "asym" in name else "w4a16-int4-g64"]
    rtn_kl, _ = _kl(copy.deepcopy(tiny_llama), base, windows, calib, ref)
    kl, state = _kl(copy.deepcopy(tiny_llama), RECIPES[name], windows, calib, ref)
    assert kl < rtn_kl
    assert len(state.weight_schemes) == 14


def test_gptq_defaults_to_activation_order_with_static_groups(tiny_llama, calib):
    import copy

    def weights(algorithms):
        m = copy.deepcopy(tiny_llama)
        quantize(m, recipe_from_dict({"weights": "int4-g64", "algorithms": algorithms}), calibration=calib, progress=False)
        return [p for n, p in m.named_parameters() if "proj" in n]

    default = weights({"gptq": {}})
    explicit = weights({"gptq": {"act_order": True, "static_groups": True}})
    storage_order = weights({"gptq": {"act_order": False, "static_groups": False}})
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))
    assert not all(torch.equal(a, b) for a, b in zip(default, storage_order))


def test_smoothquant_gptq_w8a8_and_static_calibration(tiny_llama, windows, calib):
    import copy

    ref = reference_predictions(plain_forward(tiny_llama), windows, k=256, progress=False)
    kl, state = _kl(copy.deepcopy(tiny_llama), RECIPES["w8a8-int8-sq-gptq"], windows, calib, ref)
    assert kl < 0.05 and len(state.activations) == 14
    kl_s, state_s = _kl(copy.deepcopy(tiny_llama), RECIPES["w8a8-int8-static-sq"], windows, calib, ref)
    assert all(a.qparams is not None for a in state_s.activations.values())


def test_rotation_is_exact_before_quantization(tiny_llama, windows, calib):
    import copy

    r = recipe_from_dict({"rules": [{"targets": ["nothing"], "weights": "int4-g64"}],
                          "algorithms": {"rotation": {"seed": 1}}})
    m = copy.deepcopy(tiny_llama)
    state = quantize(m, r, calibration=calib, progress=False)
    assert len(state.activations) == 2  # the online down_proj rotations of the two layers
    with quantized_execution(m, state) as fwd:
        got = fwd(windows[:1])
    want = plain_forward(tiny_llama)(windows[:1])
    assert torch.allclose(got, want, atol=1e-4)


def test_rotation_helps_w4a4(tiny_llama, windows, calib):
    import copy

    # give the residual stream a few outlier channels, as real LLMs have
    with torch.no_grad():
        tiny_llama.model.embed_tokens.weight[:, :3] *= 30
    ref = reference_predictions(plain_forward(tiny_llama), windows, k=256, progress=False)
    r4 = recipe_from_dict({"weights": "int4-g64", "inputs": "int4-token"})
    rot = recipe_from_dict({"weights": "int4-g64", "inputs": "int4-token", "algorithms": {"rotation": {}}})
    plain_kl, _ = _kl(copy.deepcopy(tiny_llama), r4, windows, calib, ref)
    rot_kl, _ = _kl(copy.deepcopy(tiny_llama), rot, windows, calib, ref)
    assert rot_kl < plain_kl


def test_outlier_channels_kept(tiny_llama, windows, calib):
    import copy

    ref = reference_predictions(plain_forward(tiny_llama), windows, k=256, progress=False)
    r = recipe_from_dict({"weights": "int8-channel", "inputs": "int8-tensor", "algorithms": {"outliers": {"top_k": 4}}})
    kl, state = _kl(copy.deepcopy(tiny_llama), r, windows, calib, ref)
    a = state.activations["model.layers.0.mlp.down_proj"]
    assert a.keep is not None and a.keep.numel() == 4


def test_layerwise_needs_calibration(tiny_llama):
    with pytest.raises(ValueError, match="needs calibration windows"):
        quantize(tiny_llama, RECIPES["w4a16-gptq-g64"], progress=False)


@pytest.mark.parametrize("d,blocks", [(7, 4), (96, 4), (130, 3), (64, 1)])
def test_gram_from_upper_blocks_equals_xtx(d, blocks):
    from lowbit.quantization.inputstats import InputStats, _add_gram

    g = torch.Generator().manual_seed(d)
    xs = [torch.randn(50, d, generator=g) * torch.logspace(-1, 1, d) for _ in range(3)]
    st = InputStats()
    for x in xs:
        st.add(x, gram=True)
    x = torch.cat(xs).double()
    torch.testing.assert_close(st.hessian.double(), x.T @ x, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st.sq_sum.double(), (x * x).sum(0), rtol=1e-5, atol=1e-4)  # the diagonal
    assert torch.equal(st.hessian, st.hessian.T)
    upper = torch.zeros(d, d)
    _add_gram(upper, xs[0], blocks)
    got = torch.triu(upper) + torch.triu(upper, 1).T
    torch.testing.assert_close(got.double(), xs[0].double().T @ xs[0].double(), rtol=1e-5, atol=1e-4)


def test_gram_in_bf16_products_is_close_and_restores_the_setting():
    from lowbit.quantization.inputstats import _add_gram, _matmul_precision

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 96, generator=g) * torch.logspace(-1, 1, 96)
    x[:, 7] *= 300  # an outlier channel, as in real activations
    before = torch.backends.mkldnn.matmul.fp32_precision
    upper = torch.zeros(96, 96)
    _add_gram(upper, x, bf16=True)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    got = (torch.triu(upper) + torch.triu(upper, 1).T).double()
    want = x.double().T @ x.double()
    scale = want.diagonal().sqrt()
    assert ((got - want).abs() / scale[:, None] / scale[None, :]).max() < 2e-3
    with pytest.raises(RuntimeError, match="boom"):
        with _matmul_precision("bf16"):
            raise RuntimeError("boom")
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_gptq_with_a_bf16_or_fp32_hessian_is_as_accurate(tiny_llama, windows, calib):
    import copy

    ref = reference_predictions(plain_forward(tiny_llama), windows, k=256, progress=False)
    kls = {}
    for h in ("bf16", "fp32"):
        r = recipe_from_dict({"weights": "int4-g64", "algorithms": {"gptq": {"hessian": h}}})
        kls[h], _ = _kl(copy.deepcopy(tiny_llama), r, windows, calib, ref)
    assert kls["bf16"] == pytest.approx(kls["fp32"], rel=0.05)
    with pytest.raises(ValueError, match="hessian must be"):
        recipe_from_dict({"weights": "int4-g64", "algorithms": {"gptq": {"hessian": "fp16"}}})
