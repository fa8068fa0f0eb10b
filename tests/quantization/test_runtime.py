"""Quantized execution on tiny Llama- and Gemma3-style models: weights, input hooks, KV
quantization at the cache write, calibration."""

import pytest
import torch

import lowbit as lb
from lowbit.quantization.calibrate import collect_stats
from lowbit.quantization.kv import KVObserver, cache_kwarg, make_cache, quantize_kv
from lowbit.quantization.pipeline import quantize, sibling_groups
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.runtime import plain_forward, quantized_activations, quantized_execution


def _hook_count(model):
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_weights_are_fake_quantized_in_place_and_qtensors_kept(tiny_model):
    w0 = tiny_model.model.layers[0].mlp.down_proj.weight.detach().clone()
    state = quantize(tiny_model, RECIPES["w4a16-int4-g64"], keep_qtensors=True, progress=False)
    name = "model.layers.0.mlp.down_proj"
    w1 = tiny_model.get_submodule(name).weight
    assert torch.equal(w1, lb.fake_quantize(w0, lb.PRESETS["int4-g64"]))
    assert torch.equal(lb.dequantize(state.weights[name]), w1)
    assert "lm_head" not in state.weight_schemes  # ignored by default
    assert len(state.weight_schemes) == 7 * len(tiny_model.model.layers)


def test_input_hooks_present_during_gone_after_and_after_exception(tiny_llama, windows):
    state = quantize(tiny_llama, RECIPES["fp8-dynamic"], progress=False)
    assert _hook_count(tiny_llama) == 0
    with quantized_execution(tiny_llama, state) as fwd:
        assert _hook_count(tiny_llama) == 14
        fwd(windows[:1])
    assert _hook_count(tiny_llama) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with quantized_activations(tiny_llama, state.activations):
            assert _hook_count(tiny_llama) == 14
            raise RuntimeError("boom")
    assert _hook_count(tiny_llama) == 0


def test_input_hook_quantizes_what_the_linear_reads(tiny_llama, windows):
    seen = {}
    target = tiny_llama.model.layers[1].mlp.down_proj

    def spy(module, args):
        seen["x"] = args[0].detach().clone()

    state = quantize(tiny_llama, RECIPES["w8a8-int8"], progress=False)
    with quantized_execution(tiny_llama, state) as fwd:
        h = target.register_forward_pre_hook(spy)  # registered after the quantizing hook: sees its output
        try:
            fwd(windows[:1])
        finally:
            h.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1])
    # every row of the input is an int8 grid times its own per-token scale
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(x / scale, torch.round(x / scale), atol=1e-3)


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8-tensor"])
def test_siblings_quantize_their_shared_input_once(tiny_llama, windows, recipe, monkeypatch):
    from lowbit.quantization import runtime

    stats = collect_stats(tiny_llama, windows, progress=False)
    state = quantize(tiny_llama, RECIPES[recipe], stats=stats, progress=False)
    calls = []
    call = runtime.ActQuant.__call__
    monkeypatch.setattr(runtime.ActQuant, "__call__", lambda self, x: calls.append(1) or call(self, x))
    with quantized_execution(tiny_llama, state) as fwd:
        shared = fwd(windows[:2])
    layers = len(tiny_llama.model.layers)
    assert len(calls) == 4 * layers  # q/k/v once, o, gate/up once, down
    # with every Linear quantizing its own input: the same logits from 7 quantizations per layer
    monkeypatch.setattr(runtime, "_pre_hook", lambda aq, last, *_: lambda m, args: (aq(args[0]),) + tuple(args[1:]))
    calls.clear()
    with quantized_execution(tiny_llama, state) as fwd:
        alone = fwd(windows[:2])
    assert len(calls) == 7 * layers
    assert torch.equal(shared, alone)


def test_input_absmax_of_siblings_is_their_common_input(tiny_llama, windows):
    stats = collect_stats(tiny_llama, windows, progress=False)
    q, k, v = (stats.input_absmax[f"model.layers.1.self_attn.{n}_proj"] for n in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v) and not torch.equal(q, stats.input_absmax["model.layers.1.self_attn.o_proj"])


def test_static_inputs_need_calibration(tiny_llama, windows):
    with pytest.raises(ValueError, match="needs calibration"):
        quantize(tiny_llama, RECIPES["fp8-tensor"], progress=False)
    stats = collect_stats(tiny_llama, windows, progress=False)
    state = quantize(tiny_llama, RECIPES["fp8-tensor"], stats=stats, progress=False)
    aq = state.activations["model.layers.0.self_attn.q_proj"]
    amax = stats.input_absmax["model.layers.0.self_attn.q_proj"].max()
    assert aq.qparams.scale.item() == pytest.approx(amax.item() / 448)


def test_calibration_hooks_removed(tiny_model, windows):
    collect_stats(tiny_model, windows, progress=False)
    assert _hook_count(tiny_model) == 0


def _capture_k(model, ids, on_write=None):
    """Run once; return the keys each layer wrote (after the on_write transform)."""
    written = {}

    def wrap(layer, k, v):
        pre = k.clone()
        if on_write is not None:
            k, v = on_write(layer, k, v)
        written[layer] = (k.clone(), v.clone(), pre)
        return k, v

    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): make_cache(model.config, wrap)})
    return written


def test_kv_quantized_at_cache_write_after_rope(tiny_model, windows):
    ids = windows[:1]
    raw = _capture_k(tiny_model, ids)
    stats = collect_stats(tiny_model, windows, progress=False)
    state = quantize(tiny_model, RECIPES["kv-fp8"], stats=stats, progress=False)
    got = _capture_k(tiny_model, ids, state.kv.on_write)
    for layer, (k_written, _, k_in) in got.items():
        ka = stats.k_absmax[layer].max()
        assert torch.equal(k_written, quantize_kv(k_in, lb.PRESETS["fp8-tensor"], ka.reshape(1)))
        assert not torch.equal(k_written, k_in)
    # the first layer's keys are the model's own post-RoPE keys, as the calibration saw them
    assert torch.equal(got[0][2], raw[0][0])
    obs = KVObserver()
    obs.on_write(0, raw[0][0], raw[0][1])
    assert torch.equal(obs.k_absmax[0], raw[0][0].abs().amax(dim=(0, 2, 3)))
    # and the model output changes, since attention reads the quantized cache
    with quantized_execution(tiny_model, state) as fwd:
        q_logits = fwd(ids)
    ref_logits = plain_forward(tiny_model)(ids)
    assert not torch.equal(q_logits, ref_logits)
    assert torch.allclose(q_logits, ref_logits, atol=0.05)


def test_gemma3_sliding_layers_quantized_too(tiny_gemma3, windows):
    ids = windows[:1]  # 24 tokens, sliding window 8
    stats = collect_stats(tiny_gemma3, windows, progress=False)
    assert set(stats.k_absmax) == {0, 1, 2}  # two sliding layers and one full layer write
    state = quantize(tiny_gemma3, RECIPES["kv-fp8-head"], stats=stats, progress=False)
    got = _capture_k(tiny_gemma3, ids, state.kv.on_write)
    for layer in (0, 1, 2):
        k = got[layer][0]
        scale = stats.k_absmax[layer].reshape(-1, 1, 1) / 448
        assert torch.equal(k, lb.FORMATS["fp8_e4m3"].round(k / scale) * scale)


def test_k_only_and_v_only(tiny_llama, windows):
    stats = collect_stats(tiny_llama, windows, progress=False)
    raw = _capture_k(tiny_llama, windows[:1])
    k_only = quantize(tiny_llama, RECIPES["kv-fp8-k"], stats=stats, progress=False)
    got = _capture_k(tiny_llama, windows[:1], k_only.kv.on_write)
    assert not torch.equal(got[0][0], raw[0][0]) and torch.equal(got[0][1], raw[0][1])
    v_only = quantize(tiny_llama, RECIPES["kv-fp8-v"], stats=stats, progress=False)
    got = _capture_k(tiny_llama, windows[:1], v_only.kv.on_write)
    assert torch.equal(got[0][0], raw[0][0]) and not torch.equal(got[0][1], raw[0][1])


def test_kivi_keys_per_channel_values_per_token(tiny_llama, windows):
    state = quantize(tiny_llama, RECIPES["kv-int4-kivi"], progress=False)  # dynamic: no calibration
    raw = _capture_k(tiny_llama, windows[:1])
    got = _capture_k(tiny_llama, windows[:1], state.kv.on_write)
    k, kq = raw[0][0], got[0][0]
    # each (head, channel) of K over the tokens holds at most 16 distinct values
    for h in range(k.shape[1]):
        for c in range(k.shape[3]):
            assert kq[0, h, :, c].unique().numel() <= 16
    assert not torch.equal(kq, k)


def test_nvfp4_siblings_share_global_scale(tiny_llama):
    assert ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj") in sibling_groups(tiny_llama)
    state = quantize(tiny_llama, RECIPES["w4a16-nvfp4"], keep_qtensors=True, progress=False)
    g = [state.weights[f"model.layers.0.self_attn.{p}_proj"].global_scale for p in "qkv"]
    assert g[0] == g[1] == g[2]
    gu = [state.weights[f"model.layers.0.mlp.{p}_proj"].global_scale for p in ("gate", "up")]
    assert gu[0] == gu[1]
    assert state.weights["model.layers.0.mlp.down_proj"].global_scale != gu[0]


def test_nan_weights_give_a_clear_error(tiny_llama):
    with torch.no_grad():
        tiny_llama.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj"):
        quantize(tiny_llama, RECIPES["w4a16-int4-g64"], progress=False)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        quantize(m, RECIPES["w4a16-int4-g64"], progress=False)


def test_static_granular_input_refused(tiny_llama, windows):
    stats = collect_stats(tiny_llama, windows, progress=False)
    r = recipe_from_dict({"inputs": {"format": "int8", "granularity": "token"}})
    with pytest.raises(ValueError, match="static input scale needs tensor granularity"):
        quantize(tiny_llama, r, stats=stats, progress=False)


def test_cached_keys_carry_rope(tiny_llama):
    ids = torch.full((1, 12), 7)  # one token repeated: before RoPE every position has the same key
    raw = _capture_k(tiny_llama, ids)
    k0 = raw[0][0][0, 0]  # (seq, dim) of head 0, layer 0
    assert not torch.allclose(k0[0], k0[5])
    assert torch.allclose(k0[0].norm(), k0[5].norm(), rtol=1e-4)  # a rotation keeps the norm


def _tiny(kind):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if kind == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common)).eval()  # q/k/v biases
    if kind == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=16, **common)).eval()  # QK-norm
    return T.MistralForCausalLM(T.MistralConfig(head_dim=16, **common)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_other_families_quantize_with_kv_and_calibration_methods(kind, windows):
    import copy

    from lowbit.quantization.recipe import recipe_from_dict

    model = _tiny(kind)
    ids = windows[:1]
    want = plain_forward(model)(ids)
    stats = collect_stats(model, windows, progress=False)
    m = copy.deepcopy(model)
    state = quantize(m, recipe_from_dict({"weights": "fp8-channel", "inputs": "fp8-token",
                                          "kv_cache": {"scheme": "fp8-tensor"}}), stats=stats, progress=False)
    with quantized_execution(m, state) as fwd:
        got = fwd(ids)
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=0.1)
    # residual and down_proj rotations stay exact (biases on q/k/v included)
    m = copy.deepcopy(model)
    r = recipe_from_dict({"rules": [{"targets": ["none"], "weights": "int4-g64"}], "algorithms": {"rotation": {}}})
    state = quantize(m, r, calibration=windows, progress=False)
    with quantized_execution(m, state) as fwd:
        assert torch.allclose(fwd(ids), want, atol=1e-4)
