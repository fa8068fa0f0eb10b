"""AWQ and SmoothQuant on tiny MoE models (both layouts, seeded routing): per-expert
``up_proj → down_proj`` scales from each expert's own routed tokens, function-preserving,
the router and the experts' shared norm untouched, the few-token rule (no scale), and
rotations refused with the reason."""

import copy
import logging
import re

import pytest
import torch

from lowbit.models.experts import unfuse_experts
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.transforms import balance, balance_groups
from lowbit.quantization.weights import QuantizedWeight, WeightMethod

from .test_moe import E, L
from .test_moe import _routed_counts as routed_count_hooks
_AWQ_LOG = re.compile(r"AWQ: (\d+) of (\d+) experts in layer (\d+) saw < (\d+) tokens: no scales")


def _windows(n=4, seq=16, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _routed_counts(model, ids):
    """Tokens each layer's router sends to each expert on a plain forward of ``ids``."""
    counts, handles = routed_count_hooks(model)
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def _weights_untouched(monkeypatch):
    """Every weight method leaves the weight as it is: what quantize() changes is then the
    balancing scales alone."""
    monkeypatch.setattr(WeightMethod, "quantize", lambda self, w, scheme, st, g=None: QuantizedWeight(w, None))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@torch.no_grad()
def test_awq_scales_per_expert_keep_the_function_and_follow_the_token_rule(tiny_moe_builder, kind, monkeypatch,
                                                                          caplog):
    model = tiny_moe_builder(kind)
    ids = _windows()
    before = model(ids).logits
    reference = copy.deepcopy(model)
    unfuse_experts(reference)
    counts = _routed_counts(reference, ids)
    _weights_untouched(monkeypatch)
    recipe = recipe_from_dict({"name": "awq", "weights": "int4-g64-asym",
                               "algorithms": {"awq": {"clip": False}, "expert_min_tokens": 14}})
    with caplog.at_level(logging.WARNING, logger="lowbit.quantization.balancing"):
        state = quantize(model, recipe, ids, progress=False)
    assert len(state.weight_schemes) == L * (E * 3 + 4)  # every expert counted
    assert torch.allclose(model(ids).logits, before, rtol=0, atol=1e-4)  # scales only: the same function
    logged = {int(m[3]): (int(m[1]), int(m[2]), int(m[4])) for m in map(_AWQ_LOG.search, caplog.messages) if m}
    for i in range(L):
        layer, ref = model.model.layers[i], reference.model.layers[i]
        assert torch.equal(layer.mlp.gate.weight, ref.mlp.gate.weight)  # router untouched
        assert torch.equal(layer.post_attention_layernorm.weight, ref.post_attention_layernorm.weight)  # shared norm
        assert not torch.equal(layer.input_layernorm.weight, ref.input_layernorm.weight)  # attention balanced
        few = {e for e in range(E) if counts[i][e] < 14}
        assert 0 < len(few) < E, counts[i]
        assert logged[i] == (len(few), E, 14)
        scaled = 0
        for e in range(E):
            ex, rx = layer.mlp.experts[e], ref.mlp.experts[e]
            assert torch.equal(ex.gate_proj.weight, rx.gate_proj.weight)  # nothing folds through the shared norm
            if e in few:
                assert torch.equal(ex.up_proj.weight, rx.up_proj.weight) and \
                    torch.equal(ex.down_proj.weight, rx.down_proj.weight), (i, e)
                continue
            s = ex.down_proj.weight[0] / rx.down_proj.weight[0]  # down_proj's columns × s ...
            assert torch.allclose(ex.down_proj.weight, rx.down_proj.weight * s, rtol=1e-5, atol=1e-6)
            assert torch.allclose(ex.up_proj.weight * s[:, None], rx.up_proj.weight, rtol=1e-5, atol=1e-6)  # ... up's rows ÷ s
            scaled += not torch.allclose(s, torch.ones_like(s))
        assert scaled >= 1, (i, counts[i])  # AWQ chose a real scale for some expert


@torch.no_grad()
def test_awq_quantizes_every_expert_and_keeps_routers(tiny_moe_builder):
    model = tiny_moe_builder("mixtral")
    routers = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    ids = _windows()
    rtn = tiny_moe_builder("mixtral")
    quantize(rtn, RECIPES["w4a16-int4-g64-asym"], progress=False)
    state = quantize(model, RECIPES["w4a16-awq-g64-asym"], ids, keep_qtensors=True, progress=False)
    experts = [n for n in state.weights if ".experts." in n]
    assert len(experts) == L * E * 3
    for i, layer in enumerate(model.model.layers):
        assert torch.equal(layer.mlp.gate.weight, routers[i])
    ref = tiny_moe_builder("mixtral")
    with torch.no_grad():
        want = ref(ids).logits.log_softmax(-1)
        kl = lambda m: float((want.exp() * (want - m(ids).logits.log_softmax(-1))).sum(-1).mean())  # noqa: E731
    assert kl(model) < kl(rtn)  # AWQ (scales + clipping per expert) beats plain rounding on its calibration set


@torch.no_grad()
def test_awq_with_all_tokens_to_every_expert_scales_every_expert(tiny_moe_builder, monkeypatch, caplog):
    model = tiny_moe_builder("qwen3_moe")
    reference = copy.deepcopy(model)
    unfuse_experts(reference)
    _weights_untouched(monkeypatch)
    recipe = recipe_from_dict({"name": "awq", "weights": "int4-g64-asym",
                               "algorithms": {"awq": {"clip": False}, "expert_min_tokens": 14,
                                              "experts_see_all_tokens": True}})
    with caplog.at_level(logging.WARNING, logger="lowbit.quantization.balancing"):
        quantize(model, recipe, _windows(), progress=False)
    assert not [m for m in caplog.messages if _AWQ_LOG.search(m)]
    changed = sum(not torch.equal(layer.mlp.experts[e].down_proj.weight, ref.mlp.experts[e].down_proj.weight)
                  for layer, ref in zip(model.model.layers, reference.model.layers) for e in range(E))
    assert changed > L * E // 2


@torch.no_grad()
def test_smoothquant_smooths_each_experts_down_input_and_keeps_the_function(tiny_moe_builder, monkeypatch):
    model = tiny_moe_builder("qwen3_moe")
    ids = _windows()
    before = model(ids).logits
    reference = copy.deepcopy(model)
    unfuse_experts(reference)
    _weights_untouched(monkeypatch)
    recipe = recipe_from_dict({"name": "sq", "weights": "int8-channel", "inputs": "int8-token",
                               "algorithms": {"smoothquant": {"alpha": 0.8}, "expert_min_tokens": 1}})
    quantize(model, recipe, ids, progress=False)
    assert torch.allclose(model(ids).logits, before, rtol=0, atol=1e-4)
    counts = _routed_counts(reference, ids)
    for i in range(L):
        layer, ref = model.model.layers[i], reference.model.layers[i]
        assert torch.equal(layer.mlp.gate.weight, ref.mlp.gate.weight)
        for e in range(E):
            moved = not torch.equal(layer.mlp.experts[e].down_proj.weight, ref.mlp.experts[e].down_proj.weight)
            assert moved == bool(counts[i][e] > 0), (i, e, int(counts[i][e]))


@torch.no_grad()
def test_expert_balance_groups_preserve_the_function_for_any_scales(tiny_moe):
    unfuse_experts(tiny_moe)
    ids = _windows(1)
    before = tiny_moe(ids).logits
    g = torch.Generator().manual_seed(1)
    groups = [grp for i in range(L) for grp in balance_groups(tiny_moe, i)]
    experts = [grp for grp in groups if ".experts." in grp[1]]
    assert len(experts) == L * E and all(grp[1].endswith("up_proj") and grp[3][0].endswith("down_proj")
                                         for grp in experts)
    for prev, _, nexts, _ in groups:
        s = torch.rand(prev.weight.shape[0], generator=g) * 4 + 0.25
        balance(prev, nexts, s, norm_offset=0.0)  # Llama-like norms: no offset
    assert torch.allclose(tiny_moe(ids).logits, before, rtol=0, atol=1e-4)


def test_rotations_are_refused_on_moe_with_the_reason(tiny_moe_builder):
    recipe = recipe_from_dict({"name": "x", "weights": "int4-g64", "algorithms": {"rotation": {}}})
    with pytest.raises(ValueError, match="rotations: .*router"):
        quantize(tiny_moe_builder("qwen3_moe"), recipe, _windows(2), progress=False)
