"""compare / sensitivity / kv-stats on a tiny model (the real-model runs are in the slow tier)."""

import json

import pytest
import torch

from lowbit.evaluation.analysis import kv_stats, sensitivity
from lowbit.models.loading import ModelInfo
from lowbit.evaluation.compare import Workbench, compare, kv_bits, save_json, weight_bits
from lowbit.quantization.recipe import RECIPES


@pytest.fixture
def bench(tiny_llama, windows, tmp_path):
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 256, (4, 24), generator=g)
    info = ModelInfo("tiny-llama", tmp_path / "model", False, "")
    return Workbench(tiny_llama, None, info, windows, calib, "synthetic", 0, tmp_path / "cache", kl_topk=64, progress=False)


def test_compare_rows_and_reference_cache(bench, tmp_path):
    before = {k: v.clone() for k, v in bench.model.state_dict().items()}
    res = compare(bench, ["fp8-dynamic", "w4a16-int4-tensor", "kv-fp8", "fp8-tensor"])
    names = [r.recipe for r in res.rows]
    assert names == ["reference", "fp8-dynamic", "w4a16-int4-tensor", "kv-fp8", "fp8-tensor"]
    ref, fp8, int4 = res.rows[0].eval, res.rows[1].eval, res.rows[2].eval
    assert ref.kl_mean is None and fp8.kl_mean > 0
    assert int4.kl_mean > fp8.kl_mean  # 4-bit per-tensor weights hurt more than FP8
    assert 8 < res.rows[1].weight_bits < 8.5 and res.rows[3].kv_bits == 8  # 8 bits + a bf16 scale per 64-wide row
    assert res.rows[3].weight_bits == 16
    # the bench's own model is never modified: each configuration quantizes a copy
    for k, v in bench.model.state_dict().items():
        assert torch.equal(v, before[k])
    # the reference and the calibration statistics were cached and are reused
    assert list((tmp_path / "cache" / "references").glob("*.safetensors"))
    assert list((tmp_path / "cache" / "calibration").glob("*.safetensors"))
    again = Workbench(bench.model, None, bench.info, bench.windows, bench.calib_windows, "synthetic", 0,
                      bench.cache, kl_topk=64, progress=False)
    assert torch.equal(again.reference.nll, bench.reference.nll)
    assert "reference (cached)" in again.stage_seconds
    out = save_json(res, tmp_path / "r.json")
    assert json.loads(out.read_text())["rows"][1]["eval"]["kl_mean"] == fp8.kl_mean
    with pytest.raises(FileExistsError, match="--force"):
        save_json(res, tmp_path / "r.json")


def test_bad_recipe_fails_before_work(bench):
    with pytest.raises(ValueError, match="unknown recipe 'fp9'"):
        compare(bench, ["fp8-dynamic", "fp9"])
    assert bench._reference is None


def test_sensitivity_ranks_by_kl(bench):
    res = sensitivity(bench, RECIPES["w4a16-int4-tensor"])
    assert len(res.rows) == 7 + 2
    kls = [r.row.eval.kl_mean for r in res.rows]
    assert kls == sorted(kls, reverse=True) and kls[-1] > 0


def test_kv_stats(bench):
    res = kv_stats(bench, windows=2)
    assert [r.layer for r in res.layers] == [0, 1]
    for r in res.layers:
        assert r.k_absmax >= r.k_median > 0 and r.k_channel_spread >= 1
        assert r.k_err_head <= r.k_err_tensor + 1e-9  # a scale per head is never worse
    names = [r.recipe for r in res.comparison.rows]
    assert names == ["reference", "kv-fp8", "kv-fp8-k", "kv-fp8-v", "kv-fp8-head", "kv-fp8-k-centered", "kv-fp8-centered",
                     "kv-int8-k-asym"]
    for r in res.layers:
        assert r.k_bias_ratio > 0 and r.k_err_signal >= r.k_err_tensor - 1e-9  # ‖K − mean‖ ≤ ‖K‖


def test_bits_helpers(tiny_llama):
    assert weight_bits(tiny_llama, None) == 16
    assert kv_bits(RECIPES["kv-fp8-k"]) == 12 and kv_bits(None) == 16


def test_another_calibration_corpus_is_another_cache_entry(bench):
    """Rows and calibration statistics are keyed by the calibration windows, which come from
    the calibration corpus: a bench calibrated elsewhere reads none of the other's entries."""
    from lowbit.evaluation.rowcache import cached_row, row_path

    g = torch.Generator().manual_seed(2)
    other = Workbench(bench.model, None, bench.info, bench.windows, torch.randint(0, 256, (4, 24), generator=g),
                      "synthetic", 0, bench.cache, kl_topk=64, progress=False, calib_corpus="other")
    recipe = RECIPES["fp8-tensor"]  # static activation scales: the statistics matter
    assert row_path(bench, recipe) != row_path(other, recipe)
    mine, theirs = cached_row(bench, recipe), cached_row(other, recipe)
    assert len(list((bench.cache / "calibration").glob("*.safetensors"))) == 2
    assert len(list((bench.cache / "rows").glob("*.json"))) == 2
    assert mine.eval.kl_mean != theirs.eval.kl_mean
    assert other.describe().calib_corpus == "other" and bench.describe().calib_corpus == "synthetic"
    # a loss mask is part of a row's key too
    masked = Workbench(bench.model, None, bench.info, bench.windows, bench.calib_windows, "synthetic", 0,
                       bench.cache, kl_topk=64, progress=False,
                       loss_mask=torch.ones(len(bench.windows), bench.windows.shape[1] - 1, dtype=torch.bool))
    assert row_path(masked, recipe) != row_path(bench, recipe)
    assert masked.describe().loss_on == "assistant"
