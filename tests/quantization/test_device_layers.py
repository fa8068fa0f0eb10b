"""The layer-by-layer pass on a device: one decoder layer moved there at a time, and what
its pass leaves in the state moved back with it.  There is no GPU here: the moves are
checked with torch's ``meta`` device (a real second device with no data) and the loop's
order with recording wrappers; the results must equal the pass without ``device``."""

import pytest
import torch

from lowbit.models.arch import decoder_layers
from lowbit.quantization import layerwise
from lowbit.quantization.calibrate import CalibStats
from lowbit.quantization.inputstats import InputStats
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import ActQuant, QuantState
from lowbit.numerics.qtensor import quantize as quantize_tensor
from lowbit.numerics.scheme import PRESETS
from tinymodels import token_windows, wide_llama


def test_onload_moves_a_layer_and_reports_where_it_was(tiny_llama):
    layer = decoder_layers(tiny_llama)[0]
    assert layerwise.onload(layer, None) is None  # no device: nothing moves
    assert layerwise.onload(layer, torch.device("cpu")) is None  # already there
    assert layerwise.onload(layer, torch.device("meta")) == torch.device("cpu")
    assert all(p.is_meta for p in layer.parameters())
    assert not any(p.is_meta for p in decoder_layers(tiny_llama)[1].parameters())  # the others stay


def test_offload_moves_the_layers_state_and_nothing_else(tiny_llama):
    layer = decoder_layers(tiny_llama)[0]
    w = torch.randn(8, 128)
    qt = quantize_tensor(w, PRESETS["int4-g64"])
    aq = ActQuant(PRESETS["int8-tensor"], qparams=qt.qparams, global_scale=torch.ones(()), keep=torch.tensor([1]))
    state = QuantState(RECIPES["w4a16-int4-g64"], weights={"model.layers.0.mlp.up_proj": qt,
                                                           "model.layers.1.mlp.up_proj": qt},
                       activations={"model.layers.0.mlp.up_proj": aq, "model.layers.1.mlp.up_proj": aq})
    stats = CalibStats(input_absmax={"model.layers.0.mlp.up_proj": torch.ones(4)}, k_absmax={0: torch.ones(2)})
    layerwise.offload(layer, torch.device("meta"), state, stats, "model.layers.0")
    assert all(p.is_meta for p in layer.parameters())
    mine, other = state.weights["model.layers.0.mlp.up_proj"], state.weights["model.layers.1.mlp.up_proj"]
    assert mine.codes.is_meta and mine.scale.is_meta and not other.codes.is_meta
    a0, a1 = state.activations["model.layers.0.mlp.up_proj"], state.activations["model.layers.1.mlp.up_proj"]
    assert a0.qparams.scale.is_meta and a0.global_scale.is_meta and a0.keep.is_meta
    assert not a1.qparams.scale.is_meta
    assert stats.input_absmax["model.layers.0.mlp.up_proj"].is_meta and stats.k_absmax[0].is_meta


def test_statistics_are_formed_on_the_inputs_device():
    st = InputStats()
    st.add(torch.empty(16, 64, device="meta"), gram=True, sample_every=2)
    assert st.gram_upper.is_meta and st.absmax.is_meta and st.hessian.is_meta and st.x.is_meta


@pytest.mark.parametrize("name", ["w4a16-gptq-g128", "w8a8-int8-static-sq"])
def test_one_layer_on_the_device_at_a_time_and_the_same_result(monkeypatch, name):
    """With ``device``, every decoder layer is onloaded before it runs and offloaded after,
    one at a time, and the quantized model equals the run without ``device``.  (On the CPU
    the move itself is a no-op; the wrapper reports the layer as moved so that the offload
    path — state moved back — runs for real.)"""
    recipe = RECIPES[name]
    calib = token_windows(4, 32, seed=3)
    plain, moved = wide_llama(), wide_llama()
    s_plain = quantize(plain, recipe, calib, keep_qtensors=True, progress=False)

    events, on_device = [], set()
    real_onload, real_offload = layerwise.onload, layerwise.offload
    layers = list(decoder_layers(moved))

    def onload(layer, device):
        assert device == torch.device("cpu")
        real_onload(layer, device)
        on_device.add(layers.index(layer))
        assert len(on_device) == 1, "more than one decoder layer on the device"
        events.append(("on", layers.index(layer)))
        return torch.device("cpu")  # as if it had come from elsewhere: offload runs

    def offload(layer, home, state, stats, prefix):
        real_offload(layer, home, state, stats, prefix)
        on_device.discard(layers.index(layer))
        events.append(("off", layers.index(layer)))

    ran = []
    for i, layer in enumerate(layers):
        # (capturing the first layer's inputs runs before any layer's pass: not counted)
        layer.register_forward_pre_hook(lambda m, a, i=i: ran.append((i, i in on_device)) if events else None)
    monkeypatch.setattr(layerwise, "onload", onload)
    monkeypatch.setattr(layerwise, "offload", offload)
    s_moved = quantize(moved, recipe, calib, keep_qtensors=True, progress=False, device="cpu")

    assert events == [(k, i) for i in range(len(layers)) for k in ("on", "off")]
    assert {i for i, _ in ran} == set(range(len(layers)))
    assert all(on for _, on in ran), "a decoder layer ran its pass while not on the device"
    for (n, p), q in zip(plain.named_parameters(), moved.parameters()):
        assert torch.equal(p, q), n
    assert set(s_plain.weights) == set(s_moved.weights)
    assert set(s_plain.activations) == set(s_moved.activations)
    for n, aq in s_plain.activations.items():
        if aq.qparams is not None:
            assert torch.equal(aq.qparams.scale, s_moved.activations[n].qparams.scale), n


def test_streaming_quantization_on_a_device(tmp_path, tiny_folder, monkeypatch):
    """``--low-memory --device``: the lazily loaded model (layers on disk, loaded to CPU
    memory, then to the device) through the device path — offload before the layer is
    released to disk — writes the same folder as without a device."""
    from lowbit.workflows.ship import quantize_streaming

    model, corpus = tiny_folder
    a = quantize_streaming(str(model), "w4a16-gptq-g64", tmp_path / "a", corpus=str(corpus), calib_windows=4,
                           seq_len=32, progress=False)
    calls = []
    real_onload = layerwise.onload

    def onload(layer, device):
        real_onload(layer, device)
        calls.append(device)
        return torch.device("cpu")  # as if moved: offload runs before the store releases the layer

    monkeypatch.setattr(layerwise, "onload", onload)
    b = quantize_streaming(str(model), "w4a16-gptq-g64", tmp_path / "b", corpus=str(corpus), calib_windows=4,
                           seq_len=32, progress=False, device="cpu")
    assert calls and all(d == torch.device("cpu") for d in calls)
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    ta, tb = tensors(a.path), tensors(b.path)
    assert ta and set(ta) == set(tb)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
