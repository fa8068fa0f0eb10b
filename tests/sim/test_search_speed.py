"""Early stopping and the bracketing search: faster, with the same answers."""

import math
import warnings

import numpy as np
import pytest

from lowbit.sim.capacity import scenario_for
from lowbit.sim.engine import StopRule
from lowbit.sim.metrics import SLO
from lowbit.sim.search import max_rate, saturation_bound
from lowbit.sim.shapes import shape_from_config
from lowbit.sim.workload import Lengths, Workload


@pytest.mark.parametrize("n", [1, 2, 7, 100, 299, 300, 2000])
@pytest.mark.parametrize("q", [50.0, 90.0, 99.0, 99.9])
def test_percentile_limit_is_sufficient(n, q):
    """k values above the target always push np.percentile above it."""
    k = StopRule(1.0, None, q).limits(n, n)[0]
    assert 1 <= k <= n
    x = np.zeros(n)
    x[: int(k)] = 10.0
    assert np.percentile(x, q) > 1.0


@pytest.mark.parametrize("n", [1, 10, 99, 100, 101, 300, 2000])
@pytest.mark.parametrize("a", [0.5, 0.9, 0.99, 1.0])
def test_goodput_limit_is_exact(n, a):
    k = int(StopRule(1.0, None, None, a).limits(n, n)[2])
    assert (n - k) / n < a
    assert k == 1 or (n - (k - 1)) / n >= a


def test_early_stop_never_changes_the_verdict():
    sc = scenario_for("qwen3-0.6b", "h100", "bf16")
    w = Workload(1.0, 300, Lengths("lognormal", value=400, sigma=1.0, low=1, high=2000),
                 Lengths("lognormal", value=100, sigma=1.0, low=1, high=400))
    bound = saturation_bound(sc, w)
    alone = sc.run(Workload(1.0, 1, Lengths.fixed(400), Lengths.fixed(100)))
    slo = SLO(ttft=4 * float(alone.ttft[0]), tpot=1.5 * float(alone.tpot[0]), percentile=95.0, attainment=0.9)
    stopped = 0
    for form, pct in (("percentile", slo.percentile), ("goodput", None)):
        rule = StopRule(slo.ttft, slo.tpot, pct, slo.attainment)
        for f in (0.3, 0.6, 0.8, 0.9, 1.0, 1.2, 2.0):
            ww = w.with_rate(f * bound)
            full, fast = sc.run(ww), sc.run(ww, stop=rule)
            check = "meets_percentile" if form == "percentile" else "meets_goodput"
            assert getattr(full, check)(slo) == getattr(fast, check)(slo), (form, f)
            stopped += fast.stopped_early
            if not fast.stopped_early:
                np.testing.assert_array_equal(full.finish, fast.finish)
    assert stopped >= 2  # the rule does fire on overloaded runs


def test_search_agrees_with_a_grid_scan():
    sc = scenario_for("qwen3-0.6b", "h100", "bf16")
    w = Workload(1.0, 300, Lengths.fixed(512), Lengths.fixed(64), seed=3)
    alone = sc.run(Workload(1.0, 1, w.prompt, w.output))
    slo = SLO(ttft=3 * float(alone.ttft[0]), tpot=1.5 * float(alone.tpot[0]))
    r = max_rate(sc, w, slo, seeds=(3,), rel_tol=0.02)
    bound = r.bound
    grid = bound * np.geomspace(0.02, 1.0, 120)
    passing = [x for x in grid if sc.run(w.with_rate(x)).meets_percentile(slo)]
    best = max(passing)
    assert r.median == pytest.approx(best, rel=0.035)
    assert sc.run(w.with_rate(r.median)).meets_percentile(slo)
    no_stop = max_rate(sc, w, slo, seeds=(3,), rel_tol=0.02, early_stop=False)
    assert no_stop.per_seed == r.per_seed and no_stop.evaluations == r.evaluations


def test_missing_tie_word_embeddings_follows_transformers():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 1000}
    assert shape_from_config({**base, "model_type": "llama"}).tied_embeddings is False
    assert shape_from_config({**base, "model_type": "gemma3_text"}).tied_embeddings is True
    assert shape_from_config({**base, "model_type": "llama", "tie_word_embeddings": True}).tied_embeddings is True
    multimodal = {"model_type": "gemma3", "text_config": {**base}}
    assert shape_from_config(multimodal).tied_embeddings is True
    with pytest.warns(UserWarning, match="tie_word_embeddings"):
        assert shape_from_config({**base, "model_type": "somethingnew"}).tied_embeddings is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shape_from_config({**base, "model_type": "qwen2"})
    assert math.isfinite(shape_from_config({**base, "model_type": "qwen2"}).hidden)
