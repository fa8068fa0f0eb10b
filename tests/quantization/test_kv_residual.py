"""KIVI's full-precision window (``KVConfig.residual``): a window runs as a prefill in groups of
``residual`` tokens; each group reads its own keys and values exactly and every earlier group as
the quantized cache holds it (key scales per channel over that group's tokens)."""

from types import SimpleNamespace

import pytest
import torch

from lowbit.quantization.kv import cache_kwarg, kv_forward, kv_plan, quantize_kv
from lowbit.quantization.kvconfig import KVConfig
from lowbit.quantization.recipe import RECIPES, recipe_from_dict

R = 8


def _ids(n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def _plan(residual: int):
    base = RECIPES["kv-int2-kivi-r128"].kv_cache  # INT2: the error is large, so a difference cannot hide
    return kv_plan(KVConfig(base.scheme, value_scheme=base.value_scheme, residual=residual), {}, {})


def test_chunked_prefill_through_the_cache_equals_one_pass(tiny_model):
    """The mechanics alone: with a cache write that changes nothing, groups of R tokens through one
    cache give the one-pass logits (positions, masks and sliding windows carried over)."""
    ids = _ids(3 * R + 3, tiny_model.config.vocab_size)
    identity = SimpleNamespace(config=SimpleNamespace(residual=R), on_write=lambda layer, k, v: (k, v))
    with torch.inference_mode():
        one = tiny_model(input_ids=ids, use_cache=False).logits
        chunked = kv_forward(tiny_model, ids, identity, tiny_model.config)
    assert chunked.shape == one.shape
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-5)


def test_each_group_reads_itself_exactly_and_earlier_groups_quantized(tiny_llama):
    from transformers import DynamicCache

    m = tiny_llama
    ids = _ids(2 * R + 5, m.config.vocab_size)
    plan = _plan(R)
    with torch.inference_mode():
        exact = m(input_ids=ids, use_cache=False).logits
        got = kv_forward(m, ids, plan, m.config)
        whole = kv_forward(m, ids, _plan(0), m.config)  # every read quantized, scales over the window
        # by hand: the first group in full precision, then its cache replaced by its quantized K/V
        # (each group's own scales), then the second group, the same way
        cache = DynamicCache(config=m.config)
        kw = {cache_kwarg(m): cache, "use_cache": True}
        parts = []
        for s in range(0, ids.shape[1], R):
            parts.append(m(input_ids=ids[:, s:s + R], **kw).logits)
            for layer in cache.layers:
                n = min(R, layer.keys.shape[-2] - s)
                k_new, v_new = layer.keys[..., s:s + n, :], layer.values[..., s:s + n, :]
                layer.keys[..., s:s + n, :] = quantize_kv(k_new, plan.config.scheme)
                layer.values[..., s:s + n, :] = quantize_kv(v_new, plan.config.v_scheme)
        by_hand = torch.cat(parts, dim=1)
    torch.testing.assert_close(got[:, :R], exact[:, :R], atol=1e-5, rtol=1e-5)  # the first group: exact
    assert (got[:, R:] - exact[:, R:]).abs().max() > 1e-2  # later groups read quantized groups
    torch.testing.assert_close(got, by_hand, atol=1e-5, rtol=1e-5)
    assert (got[:, :R] - whole[:, :R]).abs().max() > 1e-2  # residual 0 quantizes the first group too


def test_a_window_shorter_than_the_residual_is_not_quantized(tiny_llama):
    ids = _ids(R, tiny_llama.config.vocab_size)
    with torch.inference_mode():
        exact = tiny_llama(input_ids=ids, use_cache=False).logits
        got = kv_forward(tiny_llama, ids, _plan(4 * R), tiny_llama.config)
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128"])
def test_residual_must_be_a_token_count(bad):
    with pytest.raises(ValueError, match="residual"):
        recipe_from_dict({"name": "x", "kv_cache": {"scheme": "fp8-tensor", "residual": bad}}, "x")


def test_presets_describe_the_window():
    r = RECIPES["kv-int4-kivi-r128"]
    assert r.kv_cache.residual == 128 and "128" in r.summary()
    assert RECIPES["kv-int4-kivi"].kv_cache.residual == 0


def test_the_exporter_refuses_a_full_precision_window():
    from lowbit.checkpoint.compressed_tensors import check_recipe

    r = recipe_from_dict({"name": "fp8-r", "kv_cache": {"scheme": "fp8-tensor", "residual": 64}}, "x")
    with pytest.raises(ValueError, match="full-precision window of 64 tokens"):
        check_recipe(r)
