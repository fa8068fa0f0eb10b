"""Learned rounding in the layer-by-layer pass (``algorithms: {round_opt: ...}``): with zero
steps it is its weight method bit for bit; with steps no layer ends above its start on its
training windows; what it cannot do yet is refused before any work; it exports."""

import logging
import re

import pytest
import torch

from lowbit.numerics.qtensor import dequantize
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.roundpass import compute_dtype
from tinymodels import token_windows, wide_llama


def _recipe(weights="int4-g64", inputs=None, kv=None, **algorithms):
    d = {"name": "ro", "weights": weights, "algorithms": algorithms}
    if inputs:
        d["inputs"] = inputs
    if kv:
        d["kv_cache"] = {"scheme": kv}
    return recipe_from_dict(d)


def _run(recipe, n=8):
    model = wide_llama().requires_grad_(False)
    state = quantize(model, recipe, token_windows(n, 16), keep_qtensors=True, progress=False)
    return model, state


@pytest.mark.parametrize("base", [{}, {"gptq": {}, "observer": "mse", "mse_importance": True}, {"awq": {}}])
def test_zero_steps_is_the_weight_method_bit_for_bit(base):
    weights = "int4-g64-asym" if "awq" in base else "int4-g64"
    m0, s0 = _run(_recipe(weights, **base))
    m1, s1 = _run(_recipe(weights, **base, round_opt={"steps": 0, "windows": 4}))
    assert s0.weights.keys() == s1.weights.keys() and s0.weights
    for n, qt in s0.weights.items():
        assert torch.equal(qt.codes, s1.weights[n].codes) and torch.equal(qt.scale, s1.weights[n].scale), n
    p1 = dict(m1.named_parameters())
    for n, p in m0.named_parameters():
        assert torch.equal(p, p1[n]), n


_LOSS = re.compile(r"layer (\d+) learned rounding: block-output MSE (\S+) → (\S+)")


@pytest.mark.parametrize("target, base", [("float", {}), ("layer", {}), ("float", {"gptq": {}}),
                                          ("float", {"awq": {"clip": False}, "gptq": {}, "observer": "mse"})])
def test_no_layer_ends_above_its_start_and_the_weights_are_the_qtensors(caplog, target, base):
    caplog.set_level(logging.INFO, logger="lowbit.quantization.roundpass")
    model, state = _run(_recipe(**base, round_opt={"steps": 12, "windows": 4, "batch": 2, "target": target,
                                                   "lr": 0.05}))
    losses = [(int(i), float(a), float(b)) for i, a, b in _LOSS.findall(caplog.text)]
    assert [i for i, _, _ in losses] == [0, 1]
    assert all(b <= a for _, a, b in losses), losses
    mods = dict(model.named_modules())
    for n, qt in state.weights.items():
        assert torch.equal(mods[n].weight, dequantize(qt, mods[n].weight.dtype)), n


@pytest.mark.parametrize("batch", [4, 2])
def test_outputs_taken_from_the_final_check_are_the_recomputed_ones(caplog, monkeypatch, batch):
    """Where the final loss check chose the result, the layer's outputs on the training windows are
    taken from it, not computed again: the run is the recomputing run bit for bit (the next layer's
    start and training losses, every code and scale).  With training batches of 2 windows and input
    chunks of 4 nothing is a whole chunk: no outputs are kept and everything is computed again."""
    import lowbit.quantization.roundpass as rp

    caplog.set_level(logging.INFO, logger="lowbit.quantization.roundpass")
    recipe = _recipe(gptq={}, round_opt={"steps": 8, "windows": 8, "batch": batch, "lr": 0.05})
    seen = []
    real = rp.A.optimize_rounding

    def spy(*args, **kw):
        result = real(*args, **kw)
        seen.append(result.outputs is not None)
        return result

    monkeypatch.setattr(rp.A, "optimize_rounding", spy)
    runs = []
    for reuse in (True, False):
        monkeypatch.setattr(rp.LayerRounding, "reuse_outputs", reuse)
        caplog.clear()
        model, state = _run(recipe, n=12)
        runs.append((_LOSS.findall(caplog.text), state.weights, dict(model.named_parameters())))
    assert seen[2:] == [False, False]                       # not asked for, not kept
    # batches of 4 are whole chunks and the final check chose both layers' result; of 2, none is
    assert seen[:2] == ([True, True] if batch == 4 else [False, False])
    (loss_a, qa, pa), (loss_b, qb, pb) = runs
    assert loss_a == loss_b and len(loss_a) == 2
    for n, qt in qa.items():
        assert torch.equal(qt.codes, qb[n].codes) and torch.equal(qt.scale, qb[n].scale), n
    assert all(torch.equal(p, pb[n]) for n, p in pa.items())


@pytest.mark.parametrize("weights, inputs, base", [
    ("int4-g64", "int8-token", {"gptq": {}}), ("nvfp4", "nvfp4", {"gptq": {}}),
    ("int8-channel", "int8-token", {"smoothquant": {"alpha": 0.8}, "gptq": {}})])
def test_quantized_inputs_are_trained_through(caplog, weights, inputs, base):
    """W4A4 / W4A8 / W8A8 with SmoothQuant: with zero steps learned rounding is its weight method bit
    for bit, so the outputs it hands the next layer are the quantized layer's with its inputs quantized
    (the next layer's GPTQ and input scales depend on them); the loss it trains from is the layer's
    with its inputs quantized (the weight-only loss is different); with steps, no layer ends above
    its start."""
    from lowbit.quantization.runtime import quantized_execution

    caplog.set_level(logging.INFO, logger="lowbit.quantization.roundpass")
    m0, s0 = _run(_recipe(weights, inputs, **base))
    m1, s1 = _run(_recipe(weights, inputs, **base, round_opt={"steps": 0, "windows": 4, "batch": 4}))
    assert s0.weights.keys() == s1.weights.keys() and s0.activations.keys() == s1.activations.keys()
    for n, qt in s0.weights.items():
        assert torch.equal(qt.codes, s1.weights[n].codes) and torch.equal(qt.scale, s1.weights[n].scale), n
    for n, aq in s0.activations.items():
        g0, g1 = aq.global_scale, s1.activations[n].global_scale
        assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1)), n
    p1 = dict(m1.named_parameters())
    assert all(torch.equal(p, p1[n]) for n, p in m0.named_parameters())

    # layer 0's starting loss: its output with quantized inputs against the float layer's, on the 4 windows
    start = float(_LOSS.findall(caplog.text)[0][1])
    ids = token_windows(8, 16)[:4]
    outs = {}

    def grab(key):
        return lambda mod, args, out: outs.__setitem__(key, (out[0] if isinstance(out, tuple) else out).float())

    ref = wide_llama().requires_grad_(False)
    h = ref.model.layers[0].register_forward_hook(grab("float"))
    ref(input_ids=ids)
    h.remove()
    h = m1.model.layers[0].register_forward_hook(grab("weights only"))
    m1(input_ids=ids)
    h.remove()
    h = m1.model.layers[0].register_forward_hook(grab("quantized inputs"))
    with quantized_execution(m1, s1) as forward:
        forward(ids)
    h.remove()
    mse = {k: float(torch.nn.functional.mse_loss(outs[k], outs["float"])) for k in ("weights only", "quantized inputs")}
    assert start == pytest.approx(mse["quantized inputs"], rel=2e-3)
    assert abs(mse["weights only"] / mse["quantized inputs"] - 1) > 5e-3, mse  # the check can tell them apart

    caplog.clear()
    _run(_recipe(weights, inputs, **base, round_opt={"steps": 12, "windows": 4, "batch": 2, "lr": 0.05}))
    losses = [(float(a), float(b)) for _, a, b in _LOSS.findall(caplog.text)]
    assert len(losses) == 2 and all(b <= a for a, b in losses) and any(b < a for a, b in losses), losses


def test_qtensors_are_dropped_when_not_kept():
    model = wide_llama().requires_grad_(False)
    state = quantize(model, _recipe(round_opt={"steps": 2, "windows": 2}), token_windows(4, 16), progress=False)
    assert not state.weights


@pytest.mark.parametrize("settings, match", [
    ({"steps": -1}, "steps"), ({"target": "teacher"}, "target"), ({"clip_min": 0.0}, "clip_min"),
    ({"windows": 2, "batch": 4}, "batch"), ({"lr": 0}, "lr"), ({"clip_lr": -1.0}, "clip_lr"), ({"checks": 0}, "checks"),
    ({"stepz": 3}, "unknown key"), ({"steps": "many"}, "expected int"), ({"threads": -1}, "threads"),
    ({"compute": "fp16"}, "compute"),
])
def test_bad_settings_are_refused_when_the_recipe_is_read(settings, match):
    with pytest.raises(ValueError, match=match):
        _recipe(round_opt=settings)


def test_what_it_does_not_do_yet_is_refused_before_any_work():
    with pytest.raises(ValueError, match="round_opt with rotation"):
        _recipe(rotation={}, round_opt={})
    with pytest.raises(ValueError, match="round_opt with outliers"):
        _recipe(outliers={}, round_opt={})
    model = wide_llama()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="KV cache"):
        quantize(model, _recipe(kv="fp8-tensor", round_opt={}), token_windows(2, 16), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_presets():
    for name in ("w4a16-int4-g64-ro", "w4a16-int4-g128-ro", "w4a16-gptq-ro-g64", "w4a16-awq-ro-g64-asym",
                 "w4a16-awq-gptq-ro-g64-asym"):
        algo = RECIPES[name].algorithms
        assert algo.round_opt is not None and algo.layerwise
    assert RECIPES["w4a16-awq-ro-g64-asym"].algorithms.weight_method == "AWQ clipping + learned rounding"


def test_export_round_trip(tmp_path):
    """compressed-tensors decompresses the written folder to the very weights lowbit ran."""
    pytest.importorskip("compressed_tensors")
    from lowbit.checkpoint.write import export
    from lowbit.models.loading import read_into

    model, state = _run(_recipe("int4-g64-asym", awq={}, round_opt={"steps": 6, "windows": 4}))
    export(model, state, tmp_path / "ro", dtype=torch.float32)
    back = dict(read_into(wide_llama(), tmp_path / "ro").named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(back[n], p), n


def test_compute_dtype_settings():
    cpu = torch.device("cpu")
    assert compute_dtype("fp32", cpu) is None
    assert compute_dtype("bf16", cpu) is torch.bfloat16
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert compute_dtype("auto", cpu) is (torch.bfloat16 if native else None)
    assert compute_dtype("auto", torch.device("meta")) is None
