"""``algorithms.recompute``: the layer pass run by replay (one calibration chunk at a time,
recomputed up to each group) gives what the lockstep pass gives, bit for bit — weights,
QTensors, input and K/V statistics — for every method the pass runs."""

import pytest
import torch

from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import recipe_from_dict
from lowbit.quantization.roundpass import _batches
from tinymodels import token_windows, wide_llama


def _recipe(weights, recompute, inputs=None, kv=None, **algorithms):
    d = {"name": "r", "weights": weights, "algorithms": {"batch": 2, "recompute": recompute, **algorithms}}
    if inputs:
        d["inputs"] = inputs
    if kv:
        d["kv_cache"] = {"scheme": kv}
    return recipe_from_dict(d)


def _same_state(m0, s0, m1, s1):
    p1 = dict(m1.named_parameters())
    for n, p in m0.named_parameters():
        assert torch.equal(p, p1[n]), n
    assert s0.weights.keys() == s1.weights.keys() and s0.weights
    for n, qt in s0.weights.items():
        assert torch.equal(qt.codes, s1.weights[n].codes) and torch.equal(qt.scale, s1.weights[n].scale), n
    c0, c1 = s0.calibration, s1.calibration
    for field in ("input_absmax", "k_absmax", "v_absmax"):
        d0, d1 = getattr(c0, field), getattr(c1, field)
        assert d0.keys() == d1.keys(), field
        for k in d0:
            assert torch.equal(d0[k], d1[k]), (field, k)
    assert c0.k_moments.keys() == c1.k_moments.keys()
    for k, m in c0.k_moments.items():
        o = c1.k_moments[k]
        assert m.count == o.count and torch.equal(m.sum, o.sum) and torch.equal(m.max, o.max), k
    assert s0.activations.keys() == s1.activations.keys()
    for n, aq in s0.activations.items():
        q0, q1 = aq.qparams, s1.activations[n].qparams
        assert (q0 is None) == (q1 is None), n
        if q0 is not None:
            assert torch.equal(q0.scale, q1.scale), n


CASES = {
    "gptq": dict(weights="int4-g64", gptq={}),
    "awq-gptq-asym": dict(weights="int4-g64-asym", awq={}, gptq={}),
    "sq-gptq-static-kv": dict(weights="int8-channel", inputs="int8-tensor", kv="fp8-tensor",
                              smoothquant={}, gptq={}),
    "gptq-round-opt": dict(weights="int4-g64", gptq={}, round_opt={"steps": 3, "windows": 6, "batch": 3}),
}


@pytest.fixture
def replays(monkeypatch):
    """Counts the layer passes run by replay."""
    from lowbit.quantization import layerpass

    calls = []
    real = layerpass.run_by_replay
    monkeypatch.setattr(layerpass, "run_by_replay", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_lockstep_bit_for_bit(case, replays):
    runs = []
    for recompute in (False, True):
        model = wide_llama().requires_grad_(False)
        state = quantize(model, _recipe(**CASES[case], recompute=recompute), token_windows(8, 16), keep_qtensors=True,
                         progress=False)
        runs.append((model, state))
    assert len(replays) == 2  # one pass per decoder layer, by replay, in the second run only
    _same_state(*runs[0], *runs[1])
    if "kv" in CASES[case]:
        assert runs[1][1].calibration.k_absmax and runs[1][1].calibration.k_moments
        # K/V statistics counted once over the 8 windows, not once per replayed round
        assert all(m.count == runs[0][1].calibration.k_moments[k].count
                   for k, m in runs[1][1].calibration.k_moments.items())


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_replay_equals_lockstep_on_experts(tiny_moe_builder, kind):
    runs = []
    for recompute in (False, True):
        model = tiny_moe_builder(kind).requires_grad_(False)
        recipe = _recipe("int4-g64", recompute, gptq={}, expert_min_tokens=4)
        state = quantize(model, recipe, token_windows(6, 16), keep_qtensors=True, progress=False)
        runs.append((model, state))
    _same_state(*runs[0], *runs[1])


@pytest.mark.parametrize("sizes, n, batch", [([4, 4, 4], 8, 4), ([4, 4, 4], 7, 3), ([2, 3, 4], 9, 2),
                                             ([4, 4], 20, 3), ([5], 5, 8)])
def test_training_batches_equal_cat_then_split(sizes, n, batch):
    torch.manual_seed(0)
    inputs = [torch.randn(s, 3, 2) for s in sizes]
    got = _batches(inputs, n, batch)
    want = torch.cat(inputs)[:n].split(batch)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if sizes[0] % batch == 0 and n >= batch:  # a batch inside one input is a view, not a copy
        assert got[0].data_ptr() == inputs[0].data_ptr()


def test_awq_runs_the_mlp_on_its_sampled_tokens_only_and_chooses_the_same_scales(monkeypatch):
    """AWQ keeps one token in ``sample_every``; the MLP is per token, so running it on those
    tokens only (balancing.SAMPLE_MLP) must give the scales that running it on all gives."""
    from lowbit.quantization import balancing

    runs = []
    for sample in (False, True):
        monkeypatch.setattr(balancing, "SAMPLE_MLP", sample)
        model = wide_llama().requires_grad_(False)
        rows = []
        model.model.layers[0].mlp.gate_proj.register_forward_pre_hook(lambda m, a: rows.append(a[0].numel() // a[0].shape[-1]))
        # 128 calibration tokens, 32 sampled: one in 4
        state = quantize(model, _recipe("int4-g64-asym", False, awq={"tokens": 32, "clip": False}), token_windows(8, 16),
                         keep_qtensors=True, progress=False)
        runs.append((model, state, sum(rows)))
    assert runs[0][2] == 128 + 128 and runs[1][2] == 32 + 128  # balancing's forward, then the layer pass
    _same_state(runs[0][0], runs[0][1], runs[1][0], runs[1][1])


@pytest.mark.parametrize("case, rounds_saved", [("gptq", 2), ("gptq-round-opt", 1)])
def test_replay_hands_back_the_quantized_attention_instead_of_running_it(case, rounds_saved, monkeypatch):
    """Once q/k/v/o are quantized, the attention's output on each chunk is kept from the round that
    runs it in full and handed back in the rounds after (lowbit.quantization.replaycache): the same
    state bit for bit as running it every round, with the attention run that many rounds less."""
    from lowbit.quantization.replaycache import FrozenChildren

    runs, q_runs = [], []
    for enabled in (False, True):
        monkeypatch.setattr(FrozenChildren, "enabled", enabled)
        model = wide_llama().requires_grad_(False)
        seen = []
        hooks = [layer.self_attn.q_proj.register_forward_hook(lambda *a: seen.append(1)) for layer in model.model.layers]
        state = quantize(model, _recipe(**CASES[case], recompute=True), token_windows(8, 16), keep_qtensors=True,
                         progress=False)
        for h in hooks:
            h.remove()
        runs.append((model, state))
        q_runs.append(len(seen))
    _same_state(*runs[0], *runs[1])
    chunks, layers = 8 // 2, len(runs[0][0].model.layers)
    # per layer the attention runs in the rounds that reach o, gate/up, down (and the outputs' round when the
    # pass makes them); with the cache the rounds after gate/up's take it from there
    assert q_runs[0] - q_runs[1] == rounds_saved * chunks * layers


def test_a_child_called_twice_in_one_chunk_is_never_handed_back():
    from torch import nn

    from lowbit.quantization.replaycache import FrozenChildren

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(self.inner(x))

    layer = Twice()
    cache = FrozenChildren(layer, lambda c: {"g"}, {"g", "h"}, final_round=True)
    cache.start_round({"g"})
    x = torch.randn(2, 4)
    with cache.chunk(0):
        want = layer(x)
    cache.start_round({"g", "h"})
    with cache.chunk(0):
        assert "forward" not in layer.inner.__dict__      # not patched: it ran twice when recorded
        assert torch.equal(layer(x), want)
