"""Slow tier: the real packaged SmolLM2-135M, a few evaluation windows of the wiki corpus.

These load the model and corpus from the lowbit cache (fetched on first use).
"""

import math

import pytest
import torch

from lowbit.evaluation.compare import Workbench
from lowbit.quantization.recipe import RECIPES

pytestmark = pytest.mark.slow

WINDOWS = 4


@pytest.fixture(scope="module")
def bench():
    return Workbench.load("smollm2-135m", corpus="wiki", windows=WINDOWS, calib_windows=8, progress=False)


def test_reference_perplexity_matches_a_plain_transformers_loop(bench):
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in bench.windows:
            out = bench.model(w[None], labels=w[None])
            nll += out.loss.item() * (len(w) - 1)
            n += len(w) - 1
    plain = math.exp(nll / n)
    ours = bench.reference_row().eval.ppl
    assert f"{ours:.4g}" == f"{plain:.4g}"
    assert 5 < ours < 60  # a real language model on real prose


def test_fp8_w8a8_stays_within_a_few_percent(bench):
    row = bench.run(RECIPES["fp8-dynamic"])
    assert abs(row.eval.delta_pct) < 5
    assert row.eval.top1 > 0.85


def test_int4_per_tensor_is_clearly_worse_than_int4_g64(bench):
    per_tensor = bench.run(RECIPES["w4a16-int4-tensor"]).eval
    g64 = bench.run(RECIPES["w4a16-int4-g64"]).eval
    assert per_tensor.ppl > 2 * g64.ppl
    assert per_tensor.kl_mean > 3 * g64.kl_mean


def test_fp8_kv_cache_costs_little(bench):
    row = bench.run(RECIPES["kv-fp8"])
    assert abs(row.eval.delta_pct) < 2 and row.eval.kl_mean < 0.02


def test_low_memory_quantize_writes_the_in_memory_checkpoint(tmp_path, capsys):
    """`lowbit quantize --low-memory` on the real model: the shards hold exactly the tensors
    the in-memory export writes, with one decoder layer in memory at a time."""
    from lowbit.cli import main
    from lowbit.models.offload import checkpoint_files, read_tensors

    args = ["quantize", "smollm2-135m", "--recipe", "w4a16-int4-g64", "--no-eval"]
    assert main(args + ["--out", str(tmp_path / "whole")]) == 0
    assert main(args[:-1] + ["--out", str(tmp_path / "lm"), "--low-memory"]) == 2
    assert "--no-eval" in capsys.readouterr().err
    assert main(args + ["--out", str(tmp_path / "lm"), "--low-memory"]) == 0
    lm, whole = checkpoint_files(tmp_path / "lm"), checkpoint_files(tmp_path / "whole")
    assert len(set(lm.values())) == 31 and len(set(whole.values())) == 1
    a, b = read_tensors(lm, list(lm)), read_tensors(whole, list(whole))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_searched_mix_is_no_worse_than_uniform_nvfp4_at_its_bits(bench):
    """lowbit search at 4.5 average bits (INT4 g128 / NVFP4 / INT8 / bf16 per fused unit) loses no
    more than uniform NVFP4 (4.5 bits), and its prediction is on the measured scale.  Measured on
    2026-12-01: with these 4 scoring windows the mix ties uniform NVFP4 (KL 0.2399 against
    0.2398); with 8 scoring windows and MXFP4 among the candidates it measured 0.195 against 0.215
    (benchmarks/RESULTS.md) — the issue's 0.75× target is not met."""
    from lowbit.planning.search import measure, parse_candidates, search

    res, _ = search(bench, parse_candidates("int4-g128,nvfp4,int8-channel"), 4.5, score_windows=4)
    measure(bench, res)
    uniform = bench.run(RECIPES["w4a16-nvfp4"])
    assert res.measured.weight_bits <= uniform.weight_bits
    assert res.measured.eval.kl_mean <= uniform.eval.kl_mean * 1.02
    assert 0.33 < res.measured.eval.kl_mean / res.predicted_kl < 3
