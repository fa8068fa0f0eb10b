"""Mixture-of-experts quantization on tiny Qwen3-MoE and Mixtral models (transformers' fused
experts, a seeded router so that routing is real): every expert quantized with its own
scales, the router untouched, the few-token rule, GPTQ with an identity Hessian = RTN."""

import copy
import logging
import re

import pytest
import torch

import lowbit as lb
from lowbit.models.arch import arch_of, checkpoint_name, expert_groups, lowbit_name
from lowbit.models.experts import ExpertLinears, all_tokens_to_every_expert, unfuse_experts
from lowbit.quantization.inputstats import InputStats
from lowbit.quantization.pipeline import quantize, sibling_groups
from lowbit.quantization.recipe import RECIPES, recipe_from_dict

E, L = 8, 2  # experts, layers of the tiny models


def _windows(n=4, seq=16, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _fused(model):
    """Per layer, the fused experts' (gate_up (E, 2I, H), down (E, H, I)) as they are now."""
    return [(layer.mlp.experts.gate_up_proj.detach().clone(), layer.mlp.experts.down_proj.detach().clone())
            for layer in model.model.layers]


def _expert_weights(fused, i, e):
    gate_up, down = fused[i]
    inter = gate_up.shape[1] // 2
    return {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}


@torch.no_grad()
def test_unfused_experts_compute_the_same_function(tiny_moe):
    fused = _fused(tiny_moe)
    ids = _windows(2)
    before = tiny_moe(ids).logits
    assert unfuse_experts(tiny_moe) == L
    assert unfuse_experts(tiny_moe) == 0  # already per expert
    names = {n for n, _ in tiny_moe.named_parameters()}
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    for i, layer in enumerate(tiny_moe.model.layers):
        assert isinstance(layer.mlp.experts, ExpertLinears)
        for e in range(E):
            for lin, w in _expert_weights(fused, i, e).items():
                assert torch.equal(getattr(layer.mlp.experts[e], lin).weight, w)
    after = tiny_moe(ids).logits
    assert torch.allclose(before, after, rtol=0, atol=1e-5)
    with all_tokens_to_every_expert(tiny_moe):  # every expert computes on every token; same outputs
        assert tiny_moe.model.layers[0].mlp.experts.see_all_tokens
        assert torch.allclose(tiny_moe(ids).logits, after, rtol=0, atol=1e-6)
    assert not tiny_moe.model.layers[0].mlp.experts.see_all_tokens


def test_arch_table_names_experts_and_router(tiny_moe):
    arch = arch_of(tiny_moe)
    assert arch.experts is not None and arch.experts.router == "mlp.gate"
    unfuse_experts(tiny_moe)
    groups = expert_groups(tiny_moe)
    assert len(groups) == L * E
    assert groups[3] == ("model.layers.0.mlp.experts.3.gate_proj", "model.layers.0.mlp.experts.3.up_proj")
    assert set(groups) <= set(sibling_groups(tiny_moe))
    n = "model.layers.1.mlp.experts.5.down_proj.weight_packed"
    mixtral = tiny_moe.config.model_type == "mixtral"
    want = "model.layers.1.block_sparse_moe.experts.5.w2.weight_packed" if mixtral else n
    assert checkpoint_name(arch, n) == want and lowbit_name(arch, want) == n
    r = "model.layers.0.mlp.gate.weight"
    assert checkpoint_name(arch, r) == ("model.layers.0.block_sparse_moe.gate.weight" if mixtral else r)
    assert checkpoint_name(arch, "model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


#: a weight-only recipe of every weight format, at shapes the tiny models accept
FORMATS = ["w4a16-int4-g64", "w4a16-int4-g64-asym", "w4a16-int4-channel", "w8a16-int8", "fp8-dynamic",
           "w4a16-mxfp4", "w4a16-nvfp4", "fp8-block"]


@pytest.mark.parametrize("recipe", FORMATS)
@torch.no_grad()
def test_rtn_quantizes_every_expert_with_its_own_scales_and_leaves_routers(tiny_moe_builder, recipe):
    model = tiny_moe_builder("qwen3_moe" if FORMATS.index(recipe) % 2 == 0 else "mixtral")
    fused = _fused(model)
    routers = [layer.mlp.gate.weight.detach().clone() for layer in model.model.layers]
    state = quantize(model, RECIPES[recipe], keep_qtensors=True, progress=False)
    experts = [n for n in state.weight_schemes if ".experts." in n]
    assert len(experts) == L * E * 3  # every expert's gate, up and down, in every layer
    assert len(state.weight_schemes) == L * (E * 3 + 4)  # and q, k, v, o
    scheme = state.weight_schemes[experts[0]]
    for i, layer in enumerate(model.model.layers):
        assert torch.equal(layer.mlp.gate.weight, routers[i])  # router untouched
        assert not any(n.startswith(f"model.layers.{i}.mlp.gate") for n in state.weight_schemes)
        scales = []
        for e in range(E):
            for lin, w0 in _expert_weights(fused, i, e).items():
                name = f"model.layers.{i}.mlp.experts.{e}.{lin}"
                qt = state.weights[name]
                w = getattr(layer.mlp.experts[e], lin).weight
                assert qt.shape == tuple(w0.shape)
                assert torch.equal(lb.dequantize(qt, w.dtype), w), name
                if not scheme.global_scale:  # NVFP4's gate/up share a global scale (checked below)
                    assert torch.equal(w, lb.fake_quantize(w0, scheme)), name  # its own scales, from its own slice
                assert not torch.equal(w, w0)
                scales.append(qt.scale)
        assert len({s.float().numpy().tobytes() for s in scales}) > E  # scales differ from expert to expert
        if scheme.global_scale:
            for e in range(E):
                g, u = (state.weights[f"model.layers.{i}.mlp.experts.{e}.{n}"].global_scale for n in ("gate_proj", "up_proj"))
                assert torch.equal(g, u)  # vLLM fuses each expert's gate and up (w13): one global scale


def test_recipes_address_experts_by_name(tiny_moe):
    recipe = recipe_from_dict({"name": "mixed", "weights": "int4-g64",
                               "rules": [{"targets": ["*.experts.*.down_proj"], "weights": "int8-channel"},
                                         {"targets": ["model.layers.1.mlp.experts.3.*"], "weights": None}]})
    state = quantize(tiny_moe, recipe, progress=False)
    down = {n for n, s in state.weight_schemes.items() if s == lb.PRESETS["int8-channel"]}
    assert down == {f"model.layers.{i}.mlp.experts.{e}.down_proj" for i in range(L) for e in range(E)} - \
        {"model.layers.1.mlp.experts.3.down_proj"}
    assert not any(n.startswith("model.layers.1.mlp.experts.3.") for n in state.weight_schemes)


def _routed_counts(model):
    """Hooks on each layer's router recording how many tokens it sends to each expert."""
    counts = {i: torch.zeros(E, dtype=torch.long) for i in range(L)}

    def hook_for(i):
        def hook(mod, args, out):
            counts[i] += torch.bincount(out[2].flatten(), minlength=E)
        return hook

    handles = [layer.mlp.gate.register_forward_hook(hook_for(i)) for i, layer in enumerate(model.model.layers)]
    return counts, handles


_LOG = re.compile(r"(\d+) of (\d+) experts in layer (\d+) saw < (\d+) tokens: RTN")


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@torch.no_grad()
def test_gptq_rounds_experts_with_few_tokens_and_says_so(tiny_moe_builder, kind, caplog):
    """The rule: an expert whose input got fewer than ``expert_min_tokens`` calibration tokens
    (counted from the router's own choices here) is rounded to nearest (min-max); the others
    get GPTQ; one log line per layer counts them."""
    model = tiny_moe_builder(kind)
    reference = copy.deepcopy(model)
    min_tokens = 14
    recipe = recipe_from_dict({"name": "gptq", "weights": "int4-g64",
                               "algorithms": {"gptq": {}, "expert_min_tokens": min_tokens}})
    counts, handles = _routed_counts(model)
    try:
        with caplog.at_level(logging.WARNING, logger="lowbit.quantization.layerpass"):
            quantize(model, recipe, _windows(), progress=False)
    finally:
        for h in handles:
            h.remove()
    unfuse_experts(reference)
    logged = {int(m[3]): (int(m[1]), int(m[2]), int(m[4])) for m in map(_LOG.search, caplog.messages) if m}
    scheme = lb.PRESETS["int4-g64"]
    for i in range(L):
        few = {e for e in range(E) if counts[i][e] < min_tokens}
        assert 0 < len(few) < E, counts[i]  # the calibration set is sized so that both cases occur
        assert logged[i] == (len(few), E, min_tokens)
        for e in range(E):
            for lin in ("gate_proj", "up_proj", "down_proj"):
                w = getattr(model.model.layers[i].mlp.experts[e], lin).weight
                rtn = lb.fake_quantize(getattr(reference.model.layers[i].mlp.experts[e], lin).weight, scheme)
                assert torch.equal(w, rtn) == (e in few), (i, e, lin, int(counts[i][e]))


@torch.no_grad()
def test_all_tokens_to_every_expert_leaves_no_expert_without_statistics(tiny_moe_builder, caplog):
    model = tiny_moe_builder("qwen3_moe")
    recipe = recipe_from_dict({"name": "gptq", "weights": "int4-g64",
                               "algorithms": {"gptq": {}, "expert_min_tokens": 14, "experts_see_all_tokens": True}})
    with caplog.at_level(logging.WARNING, logger="lowbit.quantization.layerpass"):
        state = quantize(model, recipe, _windows(), progress=False)
    assert not [m for m in caplog.messages if _LOG.search(m)]
    assert len(state.weight_schemes) == L * (E * 3 + 4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@torch.no_grad()
def test_gptq_with_identity_hessian_equals_rtn_per_expert(tiny_moe_builder, kind, monkeypatch, caplog):
    """GPTQ's updates vanish when the Hessian is diagonal: every expert (each from its own
    statistics) must then equal plain rounding bit for bit."""
    monkeypatch.setattr(InputStats, "hessian", property(lambda self: torch.eye(self.gram_upper.shape[0])))
    gptq, rtn = tiny_moe_builder(kind), tiny_moe_builder(kind)
    recipe = recipe_from_dict({"name": "gptq", "weights": "int4-g64",
                               "algorithms": {"gptq": {}, "expert_min_tokens": 1}})
    with caplog.at_level(logging.WARNING, logger="lowbit.quantization.layerpass"):
        quantize(gptq, recipe, _windows(), progress=False)
    rounded = sum(int(m[1]) for m in map(_LOG.search, caplog.messages) if m)
    assert rounded < L * E // 2  # most experts really went through GPTQ
    quantize(rtn, RECIPES["w4a16-int4-g64"], progress=False)
    a, b = dict(gptq.named_parameters()), dict(rtn.named_parameters())
    experts = [n for n in a if ".experts." in n]
    assert len(experts) == L * E * 3
    for n in experts:
        assert torch.equal(a[n], b[n]), n


def test_layerwise_refuses_rotations_on_moe(tiny_moe_builder):
    """AWQ and SmoothQuant work per expert (tests/quantization/test_moe_balancing.py)."""
    recipe = recipe_from_dict({"name": "x", "weights": "int4-g64", "algorithms": {"rotation": {}}})
    with pytest.raises(ValueError, match="rotations"):
        quantize(tiny_moe_builder("qwen3_moe"), recipe, _windows(2), progress=False)


@torch.no_grad()
def test_activation_quantization_of_expert_inputs(tiny_moe_builder):
    model = tiny_moe_builder("mixtral")
    state = quantize(model, RECIPES["fp8-dynamic"], progress=False)
    assert sum(".experts." in n for n in state.activations) == L * E * 3
    with lb.quantization.runtime.quantized_execution(model, state) as fwd:
        logits = fwd(_windows(1))
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_static_input_scales_of_unreached_experts_are_pooled(tiny_moe_builder, caplog):
    """An expert no calibration token reached has no input statistics: its static input
    scale is the max over the experts of its layer that were reached (logged)."""
    from lowbit.quantization.calibrate import collect_stats

    model = tiny_moe_builder("qwen3_moe")
    stats = collect_stats(model, _windows(1, seq=2), progress=False)  # 2 tokens: 4 of 16 (expert, slot) pairs
    reached = {n for n in stats.input_absmax if ".experts." in n}
    assert 0 < len(reached) < L * E * 3
    with caplog.at_level(logging.WARNING, logger="lowbit.quantization.targets"):
        state = quantize(model, RECIPES["fp8-tensor"], stats=stats, progress=False)
    for i in range(L):
        for lin in ("gate_proj", "up_proj", "down_proj"):
            names = [f"model.layers.{i}.mlp.experts.{e}.{lin}" for e in range(E)]
            pooled = torch.stack([stats.input_absmax[n] for n in names if n in reached]).amax().float()
            for n in names:
                scale = state.activations[n].qparams.scale
                own = stats.input_absmax[n].float().max() if n in reached else pooled
                want = lb.PRESETS["fp8-tensor"].scales_from_range(-own.reshape(1, 1), own.reshape(1, 1))[0]
                assert torch.equal(scale, want), n
    assert sum("saw no calibration tokens" in m for m in caplog.messages) == L * E * 3 - len(reached)


def test_lazily_loaded_moe_is_refused_before_work(tiny_moe_builder):
    class Store:  # quantize() refuses before it touches the store
        pass

    with pytest.raises(ValueError, match="lazily loaded mixture-of-experts"):
        quantize(tiny_moe_builder("qwen3_moe"), RECIPES["w4a16-int4-g64"], _windows(2), store=Store(), progress=False)
