"""Keys centered before quantizing (``center_keys``) and the KV error against the signal:
attention ignores a constant added to every key, the calibrated moments merge and round-trip,
and on a model whose k_proj has a bias the error relative to the across-token variation makes
the biased layer stand out where the error relative to ‖K‖ does not."""

import pytest
import torch

from lowbit.evaluation.analysis import kv_stats
from lowbit.evaluation.compare import Workbench
from lowbit.models.loading import ModelInfo
from lowbit.quantization.calibrate import CalibStats
from lowbit.quantization.kv import KeyMoments, cache_kwarg, kv_plan, make_cache
from lowbit.quantization.recipe import RECIPES, recipe_from_dict


def _qwen2(bias_layer: int | None = 1, bias: float = 25.0):
    """A tiny Qwen2 (k_proj has a bias); ``bias_layer``'s k_proj bias gets a large constant on
    the lowest-frequency RoPE channels of each head (6, 7, 14, 15 of 16), which RoPE barely
    rotates over a short window — so after RoPE they are nearly constant, as Qwen2.5's are."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg).eval()
    if bias_layer is not None:
        with torch.no_grad():
            b = m.model.layers[bias_layer].self_attn.k_proj.bias.view(2, 16)
            b[:, [6, 7, 14, 15]] = bias
    return m


def test_a_constant_added_to_every_key_changes_no_logit():
    m = _qwen2()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(m)
    with torch.inference_mode():
        plain = m(input_ids=ids).logits
        shift = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)) * 30
        moved = m(input_ids=ids, use_cache=True, **{kw: make_cache(
            m.config, lambda layer, k, v: (k + shift[None, :, None, :], v))}).logits
    assert torch.allclose(plain, moved, atol=2e-4, rtol=1e-4)
    with torch.inference_mode():  # a per-token shift is not invisible: the test can fail
        other = m(input_ids=ids, use_cache=True, **{kw: make_cache(
            m.config, lambda layer, k, v: (k + torch.randn_like(k) * 30, v))}).logits
    assert not torch.allclose(plain, other, atol=1e-2)


def test_key_moments_merge_and_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 2, 7, 4, generator=g) + 3, torch.randn(1, 2, 5, 4, generator=g) - 1
    whole, merged = KeyMoments.of(torch.cat([a, b], dim=2)), KeyMoments.of(a).merge(KeyMoments.of(b))
    assert merged.count == whole.count == 12
    assert torch.allclose(merged.sum, whole.sum) and torch.equal(merged.min, whole.min)
    assert torch.equal(merged.max, whole.max)
    k = torch.cat([a, b], dim=2)
    assert torch.allclose(whole.mean, k.mean(dim=2)[0], atol=1e-6)
    want = (k - k.mean(dim=2, keepdim=True)).abs().amax(dim=(0, 2, 3))
    assert torch.allclose(whole.centered_absmax(), want, atol=1e-5)
    stats = CalibStats(tokens=12, k_moments={3: whole})
    stats.save(tmp_path / "s.safetensors")
    back = CalibStats.load(tmp_path / "s.safetensors").k_moments[3]
    assert back.count == 12 and torch.equal(back.sum, whole.sum) and torch.equal(back.max, whole.max)


def test_centered_plan_quantizes_the_keys_minus_their_mean():
    cfg = RECIPES["kv-fp8-k-centered"].kv_cache
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 9, 4, generator=g) * 0.1 + 40  # a large constant offset, small variation
    m = KeyMoments.of(k)
    plan = kv_plan(cfg, {}, {}, {0: m})
    qk, _ = plan.on_write(0, k, k)
    plain, _ = kv_plan(RECIPES["kv-fp8-k"].kv_cache, {0: k.abs().amax(dim=(0, 2, 3))}, {}).on_write(0, k, k)
    centered_err, plain_err = (qk - k).norm(), (plain - k).norm()
    assert centered_err < plain_err / 20  # FP8's error follows the size it quantizes: 0.1 instead of 40
    with pytest.raises(ValueError, match="center_keys needs calibration statistics"):
        kv_plan(cfg, {}, {}, {})
    with pytest.raises(ValueError, match="center_keys: needs keys"):
        recipe_from_dict({"kv_cache": {"scheme": "fp8-tensor", "keys": False, "center_keys": True}})
    assert RECIPES["kv-fp8-k-centered"].needs_calibration


def test_export_refuses_centered_keys():
    from lowbit.checkpoint.compressed_tensors import UnsupportedScheme, check_recipe

    with pytest.raises(UnsupportedScheme, match="centered keys"):
        check_recipe(RECIPES["kv-fp8-centered"])


def test_the_error_against_the_signal_finds_the_biased_layer(tmp_path):
    g = torch.Generator().manual_seed(0)
    windows, calib = torch.randint(0, 256, (3, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g)
    bench = Workbench(_qwen2(), None, ModelInfo("tiny-qwen2", tmp_path / "m", False, ""), windows, calib,
                      "synthetic", 0, tmp_path / "cache", kl_topk=64, progress=False, workers=1)
    res = kv_stats(bench, windows=3)
    plain, biased = res.layers
    # relative to ‖K‖ the layers look alike; relative to what K varies by, the biased one stands out
    assert biased.k_err_tensor < 2 * plain.k_err_tensor
    assert biased.k_bias_ratio > 5 * plain.k_bias_ratio
    assert biased.k_err_signal > 3 * plain.k_err_signal
    # both remedies bring the biased layer's error back to the signal's scale
    assert biased.k_err_signal_centered < biased.k_err_signal / 3
    assert biased.k_err_signal_int8_asym < biased.k_err_signal / 3
    rows = {r.recipe: r.eval for r in res.comparison.rows}
    assert rows["kv-fp8-k-centered"].kl_mean < rows["kv-fp8-k"].kl_mean
