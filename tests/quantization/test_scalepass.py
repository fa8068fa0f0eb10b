"""End-to-end scale tuning (``algorithms: {tune_scales: ...}``): codes and zero points stay as
the layer-by-layer pass chose them, only scales move; the held-out KL it reports is the real
one and never ends above its start; it lowers the KL where there is something to gain; it
trains through quantized inputs; what it cannot do is refused before any work; it exports."""

import dataclasses

import pytest
import torch

from lowbit.numerics.qtensor import dequantize
from lowbit.numerics.scheme import PRESETS
from lowbit.quantization.algorithms import kl_to_reference, tune_scales
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import recipe_from_dict
from lowbit.quantization.runtime import quantized_execution
from tinymodels import token_windows, wide_llama


def _recipe(weights="int4-g64", inputs=None, kv=None, **algorithms):
    d = {"name": "ts", "weights": weights, "algorithms": algorithms}
    if inputs:
        d["inputs"] = inputs
    if kv:
        d["kv_cache"] = {"scheme": kv}
    return recipe_from_dict(d)


def _run(recipe, n=12, keep=True):
    model = wide_llama().requires_grad_(False)
    state = quantize(model, recipe, token_windows(n, 16), keep_qtensors=keep, progress=False)
    return model, state


def _kl(model, state, windows) -> float:
    ref = wide_llama()
    with torch.no_grad(), quantized_execution(model, state) as fwd:
        return float(kl_to_reference(fwd(windows), ref(windows).logits))


TUNE = {"epochs": 3, "lr": 0.002, "holdout": 4}


@pytest.mark.parametrize("weights, base", [("int4-g64", {}), ("int4-g64-asym", {"awq": {"clip": False}, "gptq": {}}),
                                           ("mxfp4", {"gptq": {}})])
def test_only_scales_move_and_the_weights_are_the_qtensors(weights, base):
    _, s0 = _run(_recipe(weights, **base))
    m1, s1 = _run(_recipe(weights, **base, tune_scales=TUNE))
    assert s0.weights.keys() == s1.weights.keys() and s0.weights
    moved = 0
    for n, qt in s0.weights.items():
        t = s1.weights[n]
        assert torch.equal(qt.codes, t.codes), n
        assert (qt.zero is None and t.zero is None) or torch.equal(qt.zero, t.zero), n
        assert torch.equal(t.scale, qt.scheme.round_scale(t.scale)), n  # stored scales are on the scale grid
        moved += int(not torch.equal(qt.scale, t.scale))
    assert (moved > 0) == (s1.scale_tuning["kept_epoch"] > 0)  # the start kept: nothing moved
    if weights == "int4-g64":
        assert moved > 0  # on this model and these windows the first epoch is kept
    mods = dict(m1.named_modules())
    for n, qt in s1.weights.items():
        assert torch.equal(mods[n].weight, dequantize(qt, mods[n].weight.dtype)), n


def test_the_reported_held_out_kl_is_measured_and_never_ends_above_the_start():
    """The held-out KL the stage reports at the start is the pass's model's, and at the kept
    epoch the returned model's (recomputed here from scratch on the 4 held-out windows)."""
    windows = token_windows(12, 16)
    held = windows[-4:]
    m0, s0 = _run(_recipe())
    m1, s1 = _run(_recipe(tune_scales=TUNE))
    log = s1.scale_tuning
    assert len(log["held_kl"]) == TUNE["epochs"] + 1 and log["steps"] == TUNE["epochs"] * 8
    assert log["held_kl"][0] == pytest.approx(_kl(m0, s0, held), rel=1e-4)
    kept = log["held_kl"][log["kept_epoch"]]
    assert kept == min(log["held_kl"])
    assert _kl(m1, s1, held) == pytest.approx(kept, rel=1e-4)


@pytest.mark.parametrize("preset", ["int4-g64", "int4-g64-asym", "nvfp4", "fp8-channel"])
def test_scales_set_wrong_are_found_again(preset):
    """A linear 'model' whose scales were put off by up to ±20% per block: trained against the
    same codes at the right scales, on inputs it never saw the KL falls to a fraction of the start."""
    from lowbit.numerics.qtensor import quantize as quantize_tensor

    gen = torch.Generator().manual_seed(0)
    w, proj = torch.randn(32, 128, generator=gen), torch.randn(32, 40, generator=gen) / 4
    scheme = PRESETS[preset]
    right = quantize_tensor(w, scheme)
    off = right.scale * (1 + 0.2 * (2 * torch.rand(right.scale.shape, generator=gen) - 1))
    wrong = dataclasses.replace(right, scale=scheme.round_scale(off))
    batches = [torch.randn(16, 128, generator=gen) for _ in range(36)]

    def forward(ws, x):
        return x @ ws["w"].T @ proj

    def ref(x):
        return x @ dequantize(right).T @ proj

    res = tune_scales(forward, ref, {"w": wrong}, {"w": torch.float32}, batches[:32], batches[32:], epochs=3, lr=0.01,
                      progress=False)
    assert res.kept_epoch > 0 and res.held_kl[res.kept_epoch] < 0.25 * res.held_kl[0], res.held_kl
    assert torch.equal(res.qtensors["w"].codes, right.codes)


def test_quantized_inputs_are_measured_and_trained_through():
    """W4A4 NVFP4: the start's held-out KL is the model's with its inputs quantized (not the
    weight-only one), and the returned model's is the kept epoch's."""
    held = token_windows(12, 16)[-4:]
    recipe = _recipe("nvfp4", "nvfp4", gptq={})
    m0, s0 = _run(recipe)
    m1, s1 = _run(_recipe("nvfp4", "nvfp4", gptq={}, tune_scales={**TUNE, "lr": 0.01}))
    log = s1.scale_tuning
    with_inputs = _kl(m0, s0, held)
    weight_only = _kl(m0, dataclasses.replace(s0, activations={}), held)
    assert log["held_kl"][0] == pytest.approx(with_inputs, rel=1e-4)
    assert abs(weight_only / with_inputs - 1) > 0.05  # the check can tell them apart
    assert _kl(m1, s1, held) == pytest.approx(min(log["held_kl"]), rel=1e-4)


def test_qtensors_are_dropped_when_not_kept():
    _, state = _run(_recipe(tune_scales={"epochs": 1, "holdout": 2}), keep=False)
    assert not state.weights and state.scale_tuning["steps"] == 10


@pytest.mark.parametrize("settings, match", [({"epochs": 0}, "epochs"), ({"lr": 0}, "lr"), ({"holdout": 0}, "holdout"),
                                             ({"epoch": 2}, "unknown key")])
def test_bad_settings_are_refused_when_the_recipe_is_read(settings, match):
    with pytest.raises(ValueError, match=match):
        _recipe(tune_scales=settings)


def test_what_it_does_not_do_is_refused_before_any_work():
    with pytest.raises(ValueError, match="tune_scales with rotation"):
        _recipe(rotation={}, tune_scales={})
    model = wide_llama()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="KV cache"):
        quantize(model, _recipe(kv="fp8-tensor", gptq={}, tune_scales={}), token_windows(12, 16), progress=False)
    with pytest.raises(ValueError, match="holdout is 8"):
        quantize(model, _recipe(gptq={}, tune_scales={}), token_windows(8, 16), progress=False)
    with pytest.raises(NotImplementedError, match="layer-by-layer export"):
        quantize(model, _recipe(gptq={}, tune_scales={}), token_windows(12, 16), progress=False,
                 on_layer=lambda i, state: None)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_pure_function_refuses_bad_arguments_and_keeps_a_start_nothing_beats():
    w = torch.randn(8, 64)
    scheme = PRESETS["int4-g64"]
    from lowbit.numerics.qtensor import quantize as q

    qt = q(w, scheme)
    x = torch.randn(4, 64)

    def forward(ws, ids):
        return (x @ ws["w"].T)[None]

    def ref(ids):
        return (x @ dequantize(qt).T)[None]  # the start is exact: nothing can beat it

    res = tune_scales(forward, ref, {"w": qt}, {"w": torch.float32}, [torch.zeros(1)], [torch.zeros(1)], epochs=2,
                      lr=0.1, progress=False)
    assert res.kept_epoch == 0 and res.qtensors["w"] is qt and res.held_kl[0] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="epochs"):
        tune_scales(forward, ref, {"w": qt}, {"w": torch.float32}, [torch.zeros(1)], [torch.zeros(1)], epochs=0)
    with pytest.raises(ValueError, match="held-out"):
        tune_scales(forward, ref, {"w": qt}, {"w": torch.float32}, [torch.zeros(1)], [])
    ggml = dataclasses.replace(qt, scheme=PRESETS["q4_k"]) if "q4_k" in PRESETS else None
    if ggml is not None:
        with pytest.raises(NotImplementedError, match="GGUF"):
            tune_scales(forward, ref, {"w": ggml}, {"w": torch.float32}, [torch.zeros(1)], [torch.zeros(1)])


def test_export_round_trip(tmp_path):
    """compressed-tensors decompresses the written folder to the very weights lowbit ran."""
    pytest.importorskip("compressed_tensors")
    from lowbit.checkpoint.write import export
    from lowbit.models.loading import read_into

    model, state = _run(_recipe("int4-g64-asym", awq={}, tune_scales=TUNE))
    export(model, state, tmp_path / "ts", dtype=torch.float32)
    back = dict(read_into(wide_llama(), tmp_path / "ts").named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(back[n], p), n


@pytest.mark.parametrize("preset", ["int4-g64", "int4-g64-asym", "nvfp4", "mxfp4", "int8-channel", "fp8-block"])
def test_the_trained_weight_starts_as_dequantize_bit_for_bit(preset):
    """The stage's own weight formula (codes decoded once) is ``dequantize``'s at the start."""
    from lowbit.numerics.qtensor import quantize as quantize_tensor
    from lowbit.quantization.algorithms.scaletune import _Scales

    qt = quantize_tensor(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)), PRESETS[preset])
    assert torch.equal(_Scales(qt).weight(torch.float32), dequantize(qt, torch.float32))
