"""lowbit search on a tiny Llama: units, candidates, the Fisher proxy against measured
single-unit KL, the solve within budget, and the recipe it writes (compare, quantize with
GPTQ, export through compressed-tensors).  The real-model run is in the slow tier."""

import json

import pytest
import torch

from lowbit.checkpoint.write import export
from lowbit.evaluation.compare import Workbench, weight_bits
from lowbit.models.loading import ModelInfo
from lowbit.numerics.scheme import PRESETS
from lowbit.planning.scores import PROXIES, calibrated_errors, fisher_scores, rank_correlation, unit_kl, weight_errors
from lowbit.planning.search import (HIGH, heuristic_recipe, measure, parse_candidates, search, unit_costs,
                                    units_of)
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import load_recipe

from tinymodels import wide_llama

ct = pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("search")
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 256, (6, 32), generator=g)
    calib = torch.randint(0, 256, (8, 32), generator=g)
    info = ModelInfo("wide-llama", tmp / "model", False, "")
    return Workbench(wide_llama(), None, info, windows, calib, "synthetic", 0, tmp / "cache", kl_topk=256,
                     progress=False, workers=1)


CANDS = "int4-channel,w4a16-mxfp4,nvfp4,int8-channel"


def test_candidates():
    c = parse_candidates(CANDS)
    assert [x.name for x in c] == ["int4-channel", "w4a16-mxfp4", "nvfp4", "int8-channel", HIGH]
    assert c[1].scheme == PRESETS["mxfp4"] and c[-1].scheme is None
    assert [x.name for x in parse_candidates("bf16,nvfp4")] == [HIGH, "nvfp4"]


@pytest.mark.parametrize("text, match", [
    ("int4-g100", "unknown candidate"),
    ("int4-tensor", "per tensor"),
    ("fp8-dynamic", "weight formats only"),
    ("int8-token", "activation scheme"),
    ("nvfp4,w4a16-nvfp4", "same format as an earlier candidate"),
    ("bf16", "besides 16 bits"),
    (" , ", "at least one format"),
])
def test_bad_candidates(text, match):
    with pytest.raises(ValueError, match=match):
        parse_candidates(text)


def test_units(bench):
    m = bench.model
    mod, layer, typ = (units_of(m, g) for g in ("module", "layer", "type"))
    assert [u.name for u in mod[:4]] == ["model.layers.0.self_attn.q_proj+k_proj+v_proj", "model.layers.0.self_attn.o_proj",
                                         "model.layers.0.mlp.gate_proj+up_proj", "model.layers.0.mlp.down_proj"]
    assert len(mod) == 8 and len(layer) == 2 and len(typ) == 4
    assert layer[1].targets == ("model.layers.1.*",) and len(layer[1].modules) == 7
    assert typ[0].targets == ("*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj")
    total = sum(p.numel() for n, p in m.named_parameters() if ".layers." in n and n.endswith("proj.weight"))
    assert sum(u.params for u in mod) == sum(u.params for u in layer) == sum(u.params for u in typ) == total
    with pytest.raises(ValueError, match="granularity must be one of"):
        units_of(m, "block")


def test_fisher_proxy_ranks_like_measured_kl(bench):
    """The proxy against the KL measured with only that unit quantized, over every unit and
    two formats of very different damage."""
    units = units_of(bench.model)
    schemes = [PRESETS["int4-channel"], PRESETS["int8-channel"]]
    names = [n for u in units for n in u.modules]
    before = {k: v.clone() for k, v in bench.model.state_dict().items()}
    sc = fisher_scores(bench.model, names, schemes, bench.calib_windows, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in bench.model.state_dict().items())
    assert all(p.requires_grad for p in bench.model.parameters())  # restored
    assert set(sc.values) == set(PROXIES) and sc.tokens == 8 * 31
    pred, meas = [], []
    for u in units:
        for c, s in enumerate(schemes):
            pred.append(sum(sc.values["token"][n][c] for n in u.modules))
            meas.append(unit_kl(bench, list(u.modules), s, len(bench.windows)))
    assert all(v > 0 for v in pred + meas)  # kl_topk = vocabulary: the measured KL is exact
    assert rank_correlation(pred, meas) > 0.8
    assert 0.3 < sum(pred) / sum(meas) < 3  # the second-order term is on the KL's scale
    assert all(torch.equal(v, before[k]) for k, v in bench.model.state_dict().items())


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert rank_correlation([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1)
    with pytest.raises(ValueError, match="same length"):
        rank_correlation([1, 2], [1, 2])


@pytest.fixture(scope="module")
def searched(bench):
    cands = parse_candidates(CANDS)
    res, scores = search(bench, cands, 6.0, score_windows=4)
    return cands, res, scores


def test_search_within_budget_and_exact_bits(bench, searched):
    cands, res, scores = searched
    assert res.average_bits <= 6.0
    assert len({c.candidate for c in res.choices}) >= 2  # a real mix at 6 bits
    assert res.predicted_kl == pytest.approx(sum(c.predicted_kl for c in res.choices))
    model = wide_llama()
    state = quantize(model, res.recipe, progress=False)
    assert weight_bits(model, state) == pytest.approx(res.average_bits, abs=1e-9)  # the cost model is weight_bits'
    # a larger budget never predicts more loss; the same scores are reused
    more, _ = search(bench, cands, 9.0, scores=scores)
    assert more.predicted_kl <= res.predicted_kl and "scores" not in more.seconds
    with pytest.raises(ValueError, match="infeasible: the cheapest candidates give 4.1"):
        search(bench, cands, 4.0, scores=scores)


def test_recipe_round_trips_and_measures(bench, searched, tmp_path):
    _, res, _ = searched
    path = tmp_path / "mix.yaml"
    path.write_text(res.recipe_yaml)
    back = load_recipe(path)
    names = [n for u in units_of(bench.model) for n in u.modules]
    assert back.resolve(names) == res.recipe.resolve(names)
    measure(bench, res)
    row = res.measured
    assert row.weight_bits == pytest.approx(res.average_bits) and row.eval.kl_mean > 0
    assert json.loads(json.dumps(res.to_dict()))["measured"]["eval"]["kl_mean"] == row.eval.kl_mean


def test_mix_exports_several_config_groups(bench, searched, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    from lowbit.numerics.qtensor import dequantize

    _, res, _ = searched
    model = wide_llama()
    state = quantize(model, res.recipe, keep_qtensors=True, progress=False)
    out = export(model, state, tmp_path / "ckpt", dtype=torch.float32).path
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    used = {c.candidate for c in res.choices if c.candidate != HIGH}
    assert len(parsed.config_groups) == len(used) >= 2
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name, qt in state.weights.items():
        (scheme,) = [g for g in parsed.config_groups.values() if name in g.targets]
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        w = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"]
        assert torch.equal(w, dequantize(qt, w.dtype)), name
    sixteen = [n for c in res.choices if c.candidate == HIGH for n in c.modules]
    assert all(tensors[f"{n}.weight"].dtype == torch.float32 for n in sixteen)


def test_mix_with_gptq(bench):
    """A calibration recipe's algorithms run on the searched mix (layer by layer)."""
    cands = parse_candidates("int4-g128,int8-channel")
    res, scores = search(bench, cands, 6.0, score_windows=4, algorithms="w4a16-gptq-g128")
    assert res.recipe.algorithms.gptq is not None
    rtn, _ = search(bench, cands, 6.0, scores=scores)
    assert [c.candidate for c in rtn.choices] == [c.candidate for c in res.choices]
    measure(bench, res)
    measure(bench, rtn)
    assert res.measured.weight_bits == rtn.measured.weight_bits
    assert res.measured.eval.kl_mean != rtn.measured.eval.kl_mean


def test_scores_from_gptq_errors(bench):
    """Scored by the error GPTQ leaves: each weight's error is GPTQ's (the model quantized whole in
    that format, layer by layer), which the proxy sees as a smaller output error than min-max
    rounding's for every format; the search records the extra pass, the solve stays in budget,
    and methods that change more than the rounding are refused."""
    cands = parse_candidates("int4-channel,int8-channel")
    names = [n for u in units_of(bench.model) for n in u.modules]
    schemes = [c.scheme for c in cands if c.scheme is not None]  # bf16 is always a candidate
    gptq = load_recipe("w4a16-gptq-g128").algorithms
    deltas = calibrated_errors(bench.model, names, schemes, gptq, bench.calibration, progress=False)
    rtn = [weight_errors(bench.model, names, s) for s in schemes]
    for d, r in zip(deltas, rtn):
        assert set(d) == set(names)
        assert all(not torch.equal(d[n], r[n]) for n in names)  # GPTQ moved the codes
    windows = bench.calib_windows[:4]
    by_gptq = fisher_scores(bench.model, names, schemes, windows, deltas=deltas, progress=False)
    by_rtn = fisher_scores(bench.model, names, schemes, windows, progress=False)
    for k in range(len(schemes)):
        g = sum(by_gptq.values["token"][n][k] for n in names)
        r = sum(by_rtn.values["token"][n][k] for n in names)
        assert g < r, (schemes[k], g, r)
    res, _ = search(bench, parse_candidates("int4-channel,int8-channel"), 6.0, score_windows=4,
                    algorithms="w4a16-gptq-g128", score_algorithms=True)
    assert "calibrated errors" in res.seconds and res.average_bits <= 6.0
    assert res.recipe.algorithms.gptq is not None
    with pytest.raises(ValueError, match="awq"):
        calibrated_errors(bench.model, names, schemes, load_recipe("w4a16-awq-g64-asym").algorithms,
                          bench.calibration, progress=False)
    with pytest.raises(ValueError, match="calibration recipe"):
        search(bench, cands, 6.0, score_windows=4, score_algorithms=True)
    with pytest.raises(ValueError, match="2 schemes"):
        fisher_scores(bench.model, names, schemes, windows, deltas=deltas[:1], progress=False)


def test_heuristics(bench):
    base, high = parse_candidates("nvfp4,int8-channel")[:2]
    names = [n for u in units_of(bench.model) for n in u.modules]
    edges = heuristic_recipe(bench.model, base, high, "edges").resolve(names)
    down = heuristic_recipe(bench.model, base, high, "down").resolve(names)
    assert {n for n, (w, _) in edges.items() if w == high.scheme} == set(names)  # two layers: both are edges
    assert {n for n, (w, _) in down.items() if w == high.scheme} == {n for n in names if n.endswith("down_proj")}
    gptq = load_recipe("w4a16-gptq-g128").algorithms
    assert heuristic_recipe(bench.model, base, high, "down", gptq).algorithms == gptq  # GPTQ runs on the mix
    assert heuristic_recipe(bench.model, base, high, "down").algorithms.gptq is None
    with pytest.raises(ValueError, match="edges or down"):
        heuristic_recipe(bench.model, base, high, "middle")


def test_costs_are_integers(bench):
    units = units_of(bench.model)
    costs = unit_costs(units, parse_candidates("int4-channel,bf16"))
    assert costs[0][1] == 16 * units[0].params and all(isinstance(x, int) for r in costs for x in r)


def test_cli_refuses_bad_input_before_loading(tmp_path, capsys):
    from lowbit.cli import main

    args = ["search", "no-such-model", "--budget-bits", "4.5"]
    assert main(args + ["--candidates", "fp8-dynamic"]) == 2
    assert "weight formats only" in capsys.readouterr().err
    out = tmp_path / "mix.yaml"
    out.write_text("name: kept\n")
    assert main(args + ["--candidates", "nvfp4", "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_text() == "name: kept\n"
    assert main(args + ["--candidates", "nvfp4", "--algorithms", "no-such-recipe"]) == 2
    assert "unknown recipe" in capsys.readouterr().err
    assert main(args + ["--candidates", "nvfp4", "--score-algorithms"]) == 2
    assert "--algorithms" in capsys.readouterr().err
