"""Memory facts, plans, the GPU table, workloads, search and the commands."""

import argparse
import json
import math

import numpy as np
import pytest
import yaml

from lowbit.numerics.scheme import bits_per_element, get_scheme
from lowbit.sim.capacity import scenario_for
from lowbit.cli.sim import register
from lowbit.sim.hardware import parse_hardware
from lowbit.sim.memory import memory_report, weight_bytes
from lowbit.sim.metrics import SLO
from lowbit.sim.plans import parse_plan, resolve_plan
from lowbit.sim.search import max_rate, saturation_bound
from lowbit.sim.shapes import MODELS, get_model, shape_from_config
from lowbit.sim.workload import Lengths, Workload


def test_llama70b_article_figures(hw):
    """AI-infrastructure article: 320 KB/token KV in BF16; 8,000 tokens = 2.6 GB; FP8 on 1 H100 ≈ BF16 on 2."""
    m, g = get_model("llama-3.1-70b"), hw.gpu("h100")
    bf16_2 = memory_report(m, parse_plan("bf16"), g, tp=2, context=8000)
    fp8_1 = memory_report(m, parse_plan("fp8"), g, tp=1, context=8000)
    assert bf16_2.kv_per_token_total == 320 * 1024
    assert bf16_2.conversation_bytes == pytest.approx(2.62e9, rel=0.01)
    assert fp8_1.decode_ms_bound == pytest.approx(bf16_2.decode_ms_bound, rel=0.05)
    assert not memory_report(m, parse_plan("bf16"), g, tp=1).fits
    assert memory_report(m, parse_plan("fp8+kv-fp8"), g).kv_per_token_total == 160 * 1024


def test_weight_bytes_come_from_bits_per_element():
    m = get_model("qwen2.5-7b")
    w = weight_bytes(m, parse_plan("w4a16"))
    expected = sum(m.layers * lin.params * bits_per_element(get_scheme("int4-g128"), (lin.out_features, lin.in_features)) / 8
                   for lin in m.layer_linears() if lin.kind == "mlp")
    assert w["mlp"] == pytest.approx(expected)
    assert w["lm_head"] == m.vocab * m.hidden * 2  # stays BF16
    assert 7.5e9 < m.params < 7.7e9  # Qwen2.5-7B: 7.61B parameters


def test_moe_counts_all_experts_in_memory_but_reads_top_k():
    m = get_model("qwen3-30b-a3b")
    assert 30e9 < m.params < 31e9
    r = memory_report(m, parse_plan("bf16"), parse_hardware(yaml.safe_load(open(_yaml()).read())).gpu("h200"), context=1)
    assert r.decode_bytes_per_token < 0.2 * r.weights_total  # ~3B active of 30B


def _yaml():
    from importlib import resources
    return resources.files("lowbit").joinpath("sim/gpus.yaml")


def test_gpu_table_has_sources_and_is_strict(hw):
    for g in hw.gpus.values():
        assert g.source, g.key
    assert {"a100", "h100", "h200", "b200", "l40s", "rtx4090", "mi300x"} <= set(hw.gpus)
    doc = yaml.safe_load(_yaml().read_text())
    doc["gpus"]["h100"]["bandwith_tbps"] = 3.35
    with pytest.raises(ValueError, match=r"gpus.h100: unknown key.*bandwith_tbps"):
        parse_hardware(doc)


def test_plans_parse_and_fall_back(hw):
    assert parse_plan("fp8+kv-fp8").kv_bytes == 1.0
    with pytest.raises(ValueError, match="unknown quantization plan 'fp9'"):
        parse_plan("fp9")
    with pytest.raises(ValueError, match="suffix 'kv-fp4'"):
        parse_plan("fp8+kv-fp4")
    with pytest.warns(UserWarning, match="no fp8 tensor cores"):
        p = resolve_plan(parse_plan("fp8"), hw.gpu("a100"))
    assert p.weight_only and p.lane == "bf16"
    assert resolve_plan(parse_plan("nvfp4"), hw.gpu("b200")).lane == "fp4"


def test_shape_from_config_matches_table():
    cfg = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
    s = shape_from_config(cfg, name="qwen2.5-7b")
    assert s == MODELS["qwen2.5-7b"]
    with pytest.raises(ValueError, match="no 'vocab_size'"):
        shape_from_config({k: v for k, v in cfg.items() if k != "vocab_size"})


def test_gamma_arrivals_rate_and_burstiness():
    for b in (1.0, 0.25):
        a = Workload(10.0, 40_000, Lengths.fixed(8), Lengths.fixed(8), burstiness=b, seed=5, normalize=False).sample().arrival
        gaps = np.diff(a)
        assert gaps.mean() == pytest.approx(0.1, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(b), rel=0.05)  # Gamma CV = 1/sqrt(shape)
    w = Workload(5.0, 100, Lengths.fixed(8), Lengths.fixed(8), seed=1)
    assert w.sample().arrival[-1] == pytest.approx(100 / 5.0)  # vLLM's normalization
    assert np.array_equal(w.sample().arrival, w.sample().arrival)


def _tight_slo(sc, w, attainment=0.99):
    """Targets a little above one request's own latency, so queueing decides the max rate."""
    alone = sc.run(Workload(1.0, 1, w.prompt, w.output))
    return SLO(ttft=3 * float(alone.ttft[0]), tpot=1.5 * float(alone.tpot[0]), attainment=attainment)


def test_max_rate_is_below_the_bound_and_meets_the_slo():
    sc = scenario_for("qwen3-0.6b", "h100", "bf16")
    w = Workload(1.0, 400, Lengths.fixed(512), Lengths.fixed(64))
    slo = _tight_slo(sc, w)
    r = max_rate(sc, w, slo, seeds=(0, 1))
    assert 0 < r.low <= r.high < r.bound
    assert sc.run(w.with_seed(0).with_rate(r.per_seed[0])).meets_percentile(slo)
    assert not sc.run(w.with_seed(0).with_rate(r.per_seed[0] * 1.1)).meets_percentile(slo)
    impossible = max_rate(sc, w, SLO(ttft=1e-4, tpot=None), seeds=(0,))
    assert impossible.high == 0.0
    assert saturation_bound(sc, w) == pytest.approx(r.bound)


def test_goodput_form_is_looser_than_all_requests():
    sc = scenario_for("qwen3-0.6b", "h100", "bf16")
    w = Workload(1.0, 400, Lengths.fixed(512), Lengths.fixed(64))
    strict = max_rate(sc, w, _tight_slo(sc, w, 1.0), form="goodput", seeds=(0,))
    loose = max_rate(sc, w, _tight_slo(sc, w, 0.5), form="goodput", seeds=(0,))
    assert loose.median > strict.median


def _run(argv):
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


def test_commands_write_json_and_plot(tmp_path):
    assert _run(["memory", "--model", "qwen3-0.6b", "--gpu", "l40s", "--quant", "bf16,fp8", "--json",
                 str(tmp_path / "m.json")]) == 0
    assert len(json.loads((tmp_path / "m.json").read_text())) == 2
    assert _run(["simulate", "--model", "smollm2-135m", "--gpu", "h100", "--quant", "bf16,fp8", "--prompt", "256",
                 "--output", "32", "--requests", "200", "--seeds", "0", "--json", str(tmp_path / "s.json"),
                 "--plot", str(tmp_path / "s.png")]) == 0
    out = json.loads((tmp_path / "s.json").read_text())
    assert [r["plan"] for r in out["rows"]] == ["bf16", "fp8"] and out["rows"][0]["max_rate"]["median"] > 0
    assert (tmp_path / "s.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown GPU 'h900'"):
        _run(["memory", "--model", "qwen3-0.6b", "--gpu", "h900"])
    # an existing output is never overwritten without --force, and is refused before any work
    with pytest.raises(FileExistsError, match="pass --force"):
        _run(["memory", "--model", "qwen3-0.6b", "--gpu", "l40s", "--json", str(tmp_path / "m.json")])
    with pytest.raises(FileExistsError, match="pass --force"):
        _run(["simulate", "--model", "smollm2-135m", "--gpu", "h100", "--quant", "bf16", "--json",
              str(tmp_path / "s.json")])
    assert _run(["memory", "--model", "qwen3-0.6b", "--gpu", "l40s", "--quant", "bf16", "--json",
                 str(tmp_path / "m.json"), "--force"]) == 0
    assert len(json.loads((tmp_path / "m.json").read_text())) == 1
