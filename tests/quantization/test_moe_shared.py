"""Shared experts (Qwen2-MoE: ``mlp.shared_expert`` beside the routed experts, its output
scaled per token by ``sigmoid(mlp.shared_expert_gate(x))``): quantized like a dense MLP
(its gate and up fused siblings, its up → down a balancing group), the shared-expert gate
and the router kept exact."""

import copy

import pytest
import torch

import lowbit as lb
from lowbit.models.arch import arch_of, expert_groups
from lowbit.models.experts import unfuse_experts
from lowbit.quantization.pipeline import quantize, sibling_groups
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.weights import QuantizedWeight, WeightMethod

E, L = 8, 2
SHARED = ("gate_proj", "up_proj", "down_proj")


def _windows(n=4, seq=16, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def test_arch_table_describes_the_shared_expert_and_its_gate(tiny_moe_builder):
    model = tiny_moe_builder("qwen2_moe")
    e = arch_of(model).experts
    assert (e.shared, e.shared_gate, e.router) == ("mlp.shared_expert", "mlp.shared_expert_gate", "mlp.gate")
    unfuse_experts(model)
    groups = expert_groups(model)
    assert len(groups) == L * (E + 1)
    assert ("model.layers.1.mlp.shared_expert.gate_proj", "model.layers.1.mlp.shared_expert.up_proj") in groups
    assert set(groups) <= set(sibling_groups(model))


@pytest.mark.parametrize("recipe", ["w4a16-int4-g64", "w4a16-nvfp4", "fp8-dynamic"])
@torch.no_grad()
def test_rtn_quantizes_the_shared_expert_and_keeps_its_gate(tiny_moe_builder, recipe):
    model = tiny_moe_builder("qwen2_moe")
    before = copy.deepcopy(model)
    state = quantize(model, RECIPES[recipe], keep_qtensors=True, progress=False)
    assert len(state.weight_schemes) == L * (E * 3 + len(SHARED) + 4)  # routed experts, shared expert, q k v o
    scheme = state.weight_schemes["model.layers.0.mlp.shared_expert.down_proj"]
    for i in range(L):
        mlp, ref = model.model.layers[i].mlp, before.model.layers[i].mlp
        assert torch.equal(mlp.shared_expert_gate.weight, ref.shared_expert_gate.weight)  # kept exact
        assert torch.equal(mlp.gate.weight, ref.gate.weight)
        assert not any(n.startswith(f"model.layers.{i}.mlp.shared_expert_gate") or n == f"model.layers.{i}.mlp.gate"
                       for n in state.weight_schemes)
        for lin in SHARED:
            w, w0 = getattr(mlp.shared_expert, lin).weight, getattr(ref.shared_expert, lin).weight
            assert not torch.equal(w, w0)
            if not scheme.global_scale:
                assert torch.equal(w, lb.fake_quantize(w0, scheme)), (i, lin)
        if scheme.global_scale:  # vLLM fuses the shared expert's gate and up: one global scale
            g, u = (state.weights[f"model.layers.{i}.mlp.shared_expert.{n}"].global_scale for n in SHARED[:2])
            assert torch.equal(g, u)


@torch.no_grad()
def test_gptq_and_awq_on_the_shared_expert(tiny_moe_builder, monkeypatch):
    """GPTQ quantizes the shared expert from every token (never the few-token rule); AWQ
    balances its up → down pair, function-preserving, and leaves its gate alone."""
    model = tiny_moe_builder("qwen2_moe")
    state = quantize(model, recipe_from_dict({"name": "g", "weights": "int4-g64", "algorithms": {"gptq": {}}}),
                     _windows(), progress=False)
    assert sum(".shared_expert." in n for n in state.weight_schemes) == L * 3

    model = tiny_moe_builder("qwen2_moe")
    ids = _windows()
    before = model(ids).logits
    reference = copy.deepcopy(model)
    monkeypatch.setattr(WeightMethod, "quantize", lambda self, w, scheme, st, g=None: QuantizedWeight(w, None))
    quantize(model, recipe_from_dict({"name": "a", "weights": "int4-g64-asym", "algorithms": {"awq": {"clip": False}}}),
             ids, progress=False)
    assert torch.allclose(model(ids).logits, before, rtol=0, atol=1e-4)
    moved = 0
    for i in range(L):
        mlp, ref = model.model.layers[i].mlp, reference.model.layers[i].mlp
        assert torch.equal(mlp.shared_expert_gate.weight, ref.shared_expert_gate.weight)
        assert torch.equal(mlp.shared_expert.gate_proj.weight, ref.shared_expert.gate_proj.weight)
        s = mlp.shared_expert.down_proj.weight[0] / ref.shared_expert.down_proj.weight[0]
        moved += not torch.allclose(s, torch.ones_like(s))
        assert torch.allclose(mlp.shared_expert.up_proj.weight * s[:, None], ref.shared_expert.up_proj.weight,
                              rtol=1e-5, atol=1e-6)  # the scale moved from up_proj's rows into down_proj's columns
    assert moved  # AWQ chose a real scale (α > 0) for the shared expert of some layer
