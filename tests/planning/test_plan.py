"""lowbit plan end to end on a tiny Llama (real quantization and evaluation) and the real simulator."""

import json
from dataclasses import replace

import pytest

from lowbit.evaluation.compare import compare
from lowbit.planning import Budget, Target, default_candidates, parse_candidate, plan, recipe_plan
from lowbit.report.plan import REPORT_FILES, write_report
from lowbit.sim.hardware import get_gpu

#: few candidates keep the tiny runs short; int4 per-tensor weights lose far more than FP8 on the tiny model
#: (random weights make perplexity Δ% noise; the tests budget KL, which orders the candidates)
NAMES = ["bf16", "bf16+kv-fp8", "fp8-dynamic", "fp8-dynamic+kv-fp8", "w4a16-int4-tensor", "w8a8-int8"]


def _plan(bench, load, names=NAMES, gpu="h100", serve_as="llama-3.1-8b", budget=Budget("kl", 1e9), **kw):
    target = Target.of(gpu, kw.pop("tp", 1), bench.info.path, serve_as)
    return plan(bench, [parse_candidate(n) for n in names], target, load, budget, progress=False, **kw)


def test_rows_from_compare_are_reused_and_replanning_reads_the_sim_cache(bench, load):
    res = compare(bench, ["fp8-dynamic", "kv-fp8"])
    first = _plan(bench, load, ["bf16", "bf16+kv-fp8", "fp8-dynamic", "w8a8-int8"])
    st = first.stage_seconds
    assert "bench: config fp8-dynamic (cached)" in st and "bench: config kv-fp8 (cached)" in st  # from compare
    assert "bench: config w8a8-int8" in st  # new: measured by the plan
    assert first.option("fp8-dynamic").accuracy == res.rows[1] and first.option("bf16+kv-fp8").accuracy == res.rows[2]
    assert not any(o.capacity.cached for o in first.options)
    again = _plan(bench, load, ["bf16", "bf16+kv-fp8", "fp8-dynamic", "w8a8-int8"])
    assert all(o.capacity.cached for o in again.options)
    assert [o.capacity.max_rate for o in again.options] == [o.capacity.max_rate for o in first.options]
    assert again.recommendation == first.recommendation
    other = _plan(bench, load, ["bf16", "fp8-dynamic"], gpu="h200")  # another GPU: simulated anew
    assert not any(o.capacity.cached for o in other.options)


def test_recommendation_respects_every_budget(bench, load):
    free = _plan(bench, load)
    losses = sorted({o.loss for o in free.options})
    assert losses[-1] > losses[0]  # the budgets below separate the candidates
    for limit in [*losses, 1e9]:
        r = _plan(bench, load, budget=Budget("kl", limit))
        ok = [o for o in r.options if o.capacity.fits and o.loss <= r.budget.limit]
        assert {o.candidate.name for o in ok} == set(r.recommendation.eligible)
        pick = r.option(r.recommendation.pick)
        assert pick.within_budget and pick.loss <= r.budget.limit
        assert pick.capacity.rate == max(o.capacity.rate for o in ok)
    worst = max(free.options, key=lambda o: o.loss)
    assert worst.candidate.name == "w4a16-int4-tensor"
    tight = _plan(bench, load, budget=Budget("kl", losses[0]))
    assert tight.recommendation.pick != "w4a16-int4-tensor"


def test_gpu_without_fp8_lane_never_recommends_fp8(bench, load):
    a100 = get_gpu("a100")
    assert "fp8" not in a100.peak_tflops
    lanes = {recipe_plan(c.recipe).lane if c.recipe else "bf16" for c in default_candidates(a100)}
    assert lanes <= {"bf16", "int8"} and "int8" in lanes
    r = _plan(bench, load, ["bf16", "fp8-dynamic", "fp8-block"], gpu="a100")  # asked for explicitly: falls back
    for o in r.options:
        assert o.capacity.plan.lane in a100.peak_tflops
    fp8 = r.option("fp8-dynamic")
    assert fp8.capacity.fell_back and fp8.capacity.plan.weight_only
    assert any("no fp8 tensor cores" in n for n in r.notes)
    assert r.option(r.recommendation.pick).capacity.plan.lane != "fp8"


def test_candidates_follow_the_gpu_table_not_its_name():
    h100 = get_gpu("h100")
    names = [c.name for c in default_candidates(h100)]
    assert names[:2] == ["bf16", "bf16+kv-fp8"] and "fp8-dynamic+kv-fp8" in names and "nvfp4-gptq" not in names
    no_int8 = replace(h100, peak_tflops={k: v for k, v in h100.peak_tflops.items() if k != "int8"},
                      compute_efficiency={k: v for k, v in h100.compute_efficiency.items() if k != "int8"})
    assert "w8a8-int8" not in [c.name for c in default_candidates(no_int8)]
    assert "nvfp4-gptq" in [c.name for c in default_candidates(get_gpu("b200"))]


def test_a_candidate_that_does_not_fit_is_marked_and_not_recommended(bench, load):
    # Llama-3.1-70B on one H200: BF16 weights (141 GB) do not fit, FP8 and W4A16 do
    r = _plan(bench, load, ["bf16", "fp8-dynamic", "w4a16-int4-tensor"], gpu="h200", serve_as="llama-3.1-70b")
    bf16 = r.option("bf16")
    assert not bf16.capacity.fits and bf16.capacity.max_rate is None and bf16.loss == 0.0
    assert r.recommendation.pick in ("fp8-dynamic", "w4a16-int4-tensor")
    assert "bf16" not in r.recommendation.eligible and "bf16" not in r.recommendation.front_rate
    none = _plan(bench, load, ["bf16", "fp8-dynamic"], gpu="rtx4090", serve_as="llama-3.1-70b")
    assert none.recommendation.pick is None and none.recommendation.verdict == "nothing fits"
    assert "--tp" in none.recommendation.reason


def test_report_folder_is_complete_and_its_json_parses(bench, load, tmp_path):
    r = _plan(bench, load, ["bf16", "fp8-dynamic", "fp8-dynamic+kv-fp8", "w8a8-int8"], curves=4,
              recipe_dir=str(tmp_path / "rep" / "recipes"))
    out = write_report(r, tmp_path / "rep")
    assert {p.name for p in out.iterdir()} >= set(REPORT_FILES)
    for png in ("pareto.png", "latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads((out / "plan.json").read_text())
    assert [o["candidate"]["name"] for o in d["options"]] == [o.candidate.name for o in r.options]
    assert d["recommendation"]["pick"] == r.recommendation.pick and len(d["curves"]) == 4
    page = (out / "index.md").read_text()
    assert "llama-3.1-8b" in page and "measured on tiny-llama" in page and "pareto.png" in page
    assert r.served_note and "did not measure" in r.served_note
    for c in r.commands:
        assert c.quantize.startswith("lowbit quantize path/to/llama-3.1-8b --recipe")
        if c.recipe_file:  # a recipe that is not a preset ships as YAML in the report
            assert (out / "recipes" / f"{c.candidate}.yaml").exists() and c.recipe_file.startswith(str(out))
    with pytest.raises(FileExistsError, match="--force"):
        write_report(r, tmp_path / "rep")
    write_report(r, tmp_path / "rep", force=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rep")]  # no temporary folder left


def test_own_config_is_planned_without_serve_as(bench, load):
    r = _plan(bench, load, ["fp8-dynamic", "bf16"], serve_as=None, model_arg="tiny-llama")
    assert r.served_note == "" and r.target.shape.hidden == 64 and r.target.shape.layers == 2
    ship = {c.candidate: c for c in r.commands}[r.recommendation.pick]
    if r.recommendation.pick == "fp8-dynamic":
        assert ship.quantize == "lowbit quantize tiny-llama --recipe fp8-dynamic --out tiny-llama-fp8-dynamic"
        assert ship.vllm.startswith("vllm serve tiny-llama-fp8-dynamic ") and "kv-cache-dtype" not in ship.vllm
    else:
        assert ship.quantize is None and ship.vllm.startswith("vllm serve tiny-llama ")


def test_kv_variant_of_a_candidate_certainly_over_budget_is_not_measured(bench, load):
    names = ["bf16", "w4a16-int4-tensor", "w4a16-int4-tensor+kv-fp8", "w8a8-int8"]
    free = _plan(bench, load, names[:2] + names[3:])
    w4 = free.option("w4a16-int4-tensor").accuracy.eval
    limit = w4.kl_ci[0] / 2  # the whole interval of the base is above it
    r = _plan(bench, load, names, budget=Budget("kl", limit))
    skipped = r.option("w4a16-int4-tensor+kv-fp8")
    assert skipped.accuracy is None and not skipped.within_budget and skipped.capacity.fits
    assert "w4a16-int4-tensor+kv-fp8" not in r.recommendation.front_rate + r.recommendation.front_memory
    assert any(n.startswith("not measured: w4a16-int4-tensor+kv-fp8") for n in r.notes)
    json.dumps(r.to_dict(), default=float)
    full = _plan(bench, load, names, budget=Budget("kl", limit), measure_all=True)
    assert full.option("w4a16-int4-tensor+kv-fp8").accuracy.eval.kl_mean > limit


def test_recipes_that_serve_alike_share_one_simulation(bench, load):
    r = _plan(bench, load, ["w4a16-int4-g128", "w4a16-gptq-g128"], gpu="l40s")
    rtn, gptq = r.option("w4a16-int4-g128"), r.option("w4a16-gptq-g128")
    assert not rtn.capacity.cached and gptq.capacity.cached  # same schemes, lane and KV: simulated once
    assert gptq.capacity.max_rate == rtn.capacity.max_rate and gptq.capacity.plan.name == "w4a16-gptq-g128"
    assert gptq.accuracy.eval.kl_mean != rtn.accuracy.eval.kl_mean  # but measured apart
