"""Evaluation on tiny MoE models: compare, sensitivity by expert type, static scales of
expert inputs, and a saved MoE folder loaded as `lowbit compare` / `eval` load one."""

import torch

from lowbit.evaluation.analysis import sensitivity
from lowbit.evaluation.compare import Workbench, compare
from lowbit.models.experts import ExpertLinears, expert_units, unfuse_experts
from lowbit.models.loading import ModelInfo, load_model
from lowbit.quantization.recipe import RECIPES


def _bench(model, tmp_path, windows=(3, 16)):
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, windows, generator=g)
    calib = torch.randint(0, 256, (4, 16), generator=g)
    info = ModelInfo("tiny-moe", tmp_path / "model", False, "")
    return Workbench(model, None, info, windows, calib, "synthetic", 0, tmp_path / "cache", kl_topk=64, progress=False)


def test_compare_and_sensitivity_on_moe(tiny_moe, tmp_path):
    bench = _bench(tiny_moe, tmp_path)
    res = compare(bench, ["w8a16-int8", "w4a16-int4-tensor", "fp8-tensor", "w4a16-gptq-g64"])
    ref, int8, int4, fp8, gptq = (r.eval for r in res.rows)
    assert ref.kl_mean is None and 0 < int8.kl_mean < int4.kl_mean
    assert fp8.kl_mean > 0 and gptq.kl_mean > 0  # static expert-input scales; GPTQ per expert
    sens = sensitivity(bench, RECIPES["w4a16-int4-tensor"], by_layer=False, by_expert=False)
    by_name = {r.target: r.row.eval.kl_mean for r in sens.rows}
    assert set(by_name) >= {"mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj"}
    assert all(v > 0 for v in by_name.values())  # each glob quantized something


def test_moe_folder_loads_with_per_expert_linears(tiny_moe_builder, tmp_path, byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    model = tiny_moe_builder("mixtral")
    model.save_pretrained(tmp_path / "m")
    PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(["some text"] * 4), unk_token="<unk>",
                            bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "m")
    loaded, _, info = load_model(str(tmp_path / "m"))  # "unsupported architecture" before issue 21
    assert not info.needs_bos
    assert all(isinstance(layer.mlp.experts, ExpertLinears) for layer in loaded.model.layers)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_per_layer_sensitivity_ranks_each_expert(tiny_moe, tmp_path):
    """`compare --per-layer` on a MoE: every routed expert of every layer is a unit of its
    own; an expert no evaluation token is routed to changes nothing when quantized (KL 0),
    one that tokens reach does, and the ranking puts the damaging ones first.  (The last
    position of a window predicts nothing, so tokens routed there do not count.)"""
    units = expert_units(tiny_moe)  # named as after unfusing, from the fused layout
    assert units[:2] == ["model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1"] and len(units) == 2 * 8
    unfuse_experts(tiny_moe)  # as load_model leaves a MoE folder
    assert expert_units(tiny_moe) == units
    bench = _bench(tiny_moe, tmp_path, windows=(1, 8))
    routed = {}

    def hook_for(i):
        def hook(mod, args, out):
            for e in out[2][:-1].flatten().tolist():  # (positions, k) of the one window, the last left out
                routed[f"model.layers.{i}.mlp.experts.{e}"] = routed.get(f"model.layers.{i}.mlp.experts.{e}", 0) + 1
        return hook

    handles = [layer.mlp.gate.register_forward_hook(hook_for(i)) for i, layer in enumerate(tiny_moe.model.layers)]
    tiny_moe(bench.windows)
    for h in handles:
        h.remove()
    sens = sensitivity(bench, RECIPES["w4a16-int4-tensor"], by_type=False, by_layer=False)
    assert [r.kind for r in sens.rows] == ["expert"] * len(units)
    kl = {r.target: r.row.eval.kl_mean for r in sens.rows}
    assert set(kl) == set(units)
    unrouted = [u for u in units if u not in routed]
    assert unrouted and len(unrouted) < len(units)  # the windows are sized so that both cases occur
    assert all(kl[u] == 0 for u in unrouted)
    assert all(kl[u] > 0 for u in routed)
    values = [r.row.eval.kl_mean for r in sens.rows]
    assert values == sorted(values, reverse=True)


def test_kv_stats_and_plan_on_moe(tiny_moe, tmp_path):
    """`lowbit kv-stats` and `lowbit plan` run on a MoE model: per-layer K/V statistics and FP8 KV
    rows; a plan for the model's own config (the simulator's MoE shape) with a recommendation."""
    from lowbit.evaluation.analysis import kv_stats
    from lowbit.planning import Budget, Load, Target, parse_candidate, plan
    from lowbit.sim.metrics import SLO
    from lowbit.sim.workload import Lengths

    bench = _bench(tiny_moe, tmp_path)
    ks = kv_stats(bench, windows=2)
    assert len(ks.layers) == tiny_moe.config.num_hidden_layers
    rows = ks.comparison.rows
    assert rows[0].recipe == "reference" and len(rows) > 1 and all(r.eval.kl_mean > 0 for r in rows[1:])
    tiny_moe.config.save_pretrained(bench.info.path)
    target = Target.of("h100", 1, bench.info.path, None)
    cfg = tiny_moe.config
    n_experts = cfg.num_experts if cfg.model_type == "qwen3_moe" else cfg.num_local_experts
    assert target.shape.experts == n_experts
    load = Load(Lengths.fixed(256), Lengths.fixed(32), SLO(ttft=1.0, tpot=0.04), n_requests=100, seeds=(0,))
    r = plan(bench, [parse_candidate(n) for n in ("bf16", "fp8-dynamic")], target, load, Budget("kl", 1e9),
             progress=False, model_arg="tiny-moe")
    assert r.recommendation.pick in ("bf16", "fp8-dynamic")
    assert {c.candidate for c in r.commands} >= {r.recommendation.pick}
