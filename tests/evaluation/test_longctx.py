"""Long-context buckets: the bucket edges, and on a tiny model folder the chunked-logit pass
equal to the standard evaluator (perplexity and KL of the whole window), per KV recipe."""

import numpy as np
import pytest

from lowbit.cli import main
from lowbit.evaluation import longctx as L
from lowbit.evaluation.compare import Workbench
from lowbit.evaluation.metrics import evaluate, reference_predictions
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import plain_forward, quantized_execution


def test_bucket_edges():
    assert L.buckets_for(8192) == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8191)]
    assert L.buckets_for(600) == [(0, 512), (512, 599)]
    assert L.buckets_for(100) == [(0, 99)]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        L.buckets_for(1)


def test_bucket_statistics_by_hand():
    nll = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    ref = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    kl = np.array([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
    (a, b) = L._buckets(nll, kl, ref, [(0, 1), (1, 3)], bootstrap=200, seed=0)
    assert a.tokens == 2 and a.ppl == pytest.approx(np.e) and a.delta_pct == pytest.approx(0.0)
    assert b.tokens == 4 and b.ppl == pytest.approx(np.exp(7 / 4))
    assert b.delta_pct == pytest.approx((np.exp(3 / 4) - 1) * 100) and b.kl_mean == pytest.approx(0.5 / 4)
    assert b.delta_ci[0] <= b.delta_pct <= b.delta_ci[1]


def test_long_context_equals_the_standard_evaluator(tiny_folder, tmp_path):
    model, corpus = tiny_folder
    bench = Workbench.load(str(model), corpus=str(corpus), windows=1, seq_len=64, calib_windows=4,
                           cache=tmp_path / "cache", progress=False, workers=1)
    recipes = [RECIPES["kv-fp8"], RECIPES["kv-int4-kivi"]]
    res = L.long_context(bench, recipes, length=200, windows=2, topk=320)
    assert [r.recipe for r in res.rows] == ["reference", "kv-fp8", "kv-int4-kivi"] and res.windows == 2
    from lowbit.data import windows as data

    wins = data.eval_windows(data.stream_for(bench.tokenizer, str(corpus), "test", cache=bench.cache), 200, 2)
    ref = reference_predictions(plain_forward(bench.model), wins, 320, progress=False, workers=1)
    (whole,) = res.rows[0].buckets
    assert whole.ppl == pytest.approx(evaluate(plain_forward(bench.model), wins, progress=False, workers=1).ppl,
                                      rel=1e-5)
    for row, recipe in zip(res.rows[1:], recipes):
        m = bench.model.__class__(bench.model.config).eval()
        m.load_state_dict(bench.model.state_dict())
        state = quantize(m, recipe, bench.calibration, stats=lambda: bench.stats, progress=False)
        with quantized_execution(m, state) as fwd:
            ev = evaluate(fwd, wins, ref, progress=False, workers=1)
        (b,) = row.buckets
        assert b.ppl == pytest.approx(ev.ppl, rel=1e-5) and b.kl_mean == pytest.approx(ev.kl_mean, rel=1e-3, abs=1e-7)
        assert b.delta_pct == pytest.approx(ev.delta_pct, abs=1e-3)
    assert res.rows[2].buckets[0].kl_mean > res.rows[1].buckets[0].kl_mean  # INT4 loses more than FP8
    with pytest.raises(ValueError, match="max_position_embeddings"):
        L.long_context(bench, recipes, length=4096, windows=1)


def test_cli_refuses_unknown_recipes_first(capsys):
    assert main(["long-context", "no-such-model", "--recipes", "kv-fp9"]) == 2
    assert "unknown recipe 'kv-fp9'" in capsys.readouterr().err
