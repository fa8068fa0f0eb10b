"""Metrics: exact properties and agreement with direct computation."""

import math

import pytest
import torch

from lowbit.evaluation.metrics import Eval, evaluate, paired_difference, reference_predictions
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import plain_forward, quantized_execution


def test_kl_of_a_model_with_itself_is_zero(tiny_llama, windows):
    fwd = plain_forward(tiny_llama)
    ref = reference_predictions(fwd, windows, k=16, progress=False)
    ev = evaluate(fwd, windows, ref, progress=False)
    assert ev.kl_mean == 0.0 and ev.kl_p99 == 0.0
    assert ev.top1 == 1.0 and ev.delta_pct == pytest.approx(0.0, abs=1e-9)
    assert ev.tokens == windows.shape[0] * (windows.shape[1] - 1)


def test_uniform_logits_give_vocabulary_size_perplexity(windows):
    V = 256
    ev = evaluate(lambda ids: torch.zeros(1, ids.shape[1], V), windows, progress=False)
    assert ev.ppl == pytest.approx(V, rel=1e-6)
    assert ev.ppl_ci[0] == pytest.approx(V, rel=1e-6) and ev.ppl_ci[1] == pytest.approx(V, rel=1e-6)


def test_metrics_match_direct_computation(tiny_llama, windows):
    ref_fwd = plain_forward(tiny_llama)
    ref = reference_predictions(ref_fwd, windows, k=256, progress=False)  # k = vocabulary: exact KL
    with torch.no_grad():
        ref_logits = [ref_fwd(windows[i : i + 1])[0, :-1] for i in range(len(windows))]
    state = quantize(tiny_llama, RECIPES["w4a16-int4-tensor"], progress=False)
    with quantized_execution(tiny_llama, state) as fwd:
        ev = evaluate(fwd, windows, ref, progress=False)
        with torch.no_grad():
            q_logits = [fwd(windows[i : i + 1])[0, :-1] for i in range(len(windows))]
    P = torch.log_softmax(torch.cat(ref_logits).double(), -1)
    Q = torch.log_softmax(torch.cat(q_logits).double(), -1)
    tgt = windows[:, 1:].reshape(-1)
    nll = -Q.gather(-1, tgt[:, None]).squeeze(-1)
    kl = (P.exp() * (P - Q)).sum(-1)
    assert ev.ppl == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    assert ev.kl_mean == pytest.approx(kl.mean().item(), rel=1e-3)
    assert ev.top1 == pytest.approx((P.argmax(-1) == Q.argmax(-1)).double().mean().item())
    ref_ppl = math.exp(ref.nll.double().mean().item())
    assert ev.delta_pct == pytest.approx(100 * (ev.ppl / ref_ppl - 1), rel=1e-6)
    assert ev.ppl_ci[0] <= ev.ppl <= ev.ppl_ci[1]
    assert ev.kl_mean > 0
    # the per-window sums a paired comparison resamples add up to the totals
    seq = windows.shape[1] - 1
    assert ev.window_tokens == (float(seq),) * len(windows)
    assert sum(ev.window_kl) / ev.tokens == pytest.approx(ev.kl_mean, rel=1e-9)
    assert math.exp(sum(ev.window_nll) / ev.tokens) == pytest.approx(ev.ppl, rel=1e-9)
    assert ev.window_kl[0] == pytest.approx(kl[:seq].sum().item(), rel=1e-3)


def _eval(name, kl, nll, tokens=100.0):
    return Eval(name, 1.0, (1.0, 1.0), len(kl), int(tokens * len(kl)), 0.0, window_nll=tuple(nll),
                window_tokens=(tokens,) * len(kl), window_kl=tuple(kl))


def test_paired_difference_sees_what_two_separate_intervals_cannot():
    """Windows differ in difficulty far more than two configurations differ on one window: the
    paired interval of the KL ratio excludes 1, while each configuration's own interval overlaps
    the other's."""
    import numpy as np

    g = np.random.default_rng(0)
    hard = g.lognormal(0, 0.6, 64) * 10                        # per-window KL sums of configuration a
    a = _eval("a", hard, hard * 30)
    b = _eval("b", hard * 0.92 * g.normal(1, 0.02, 64), hard * 30 - 5)
    p = paired_difference(a, b)
    assert p["kl_ratio"] == pytest.approx(sum(b.window_kl) / sum(a.window_kl))
    assert p["kl_ratio_ci"][1] < 1 and p["kl_diff_ci"][1] < 0
    assert p["ppl_ratio"] == pytest.approx(math.exp(-5 * 64 / (100 * 64))) and p["ppl_ratio_ci"][1] < 1
    idx = g.integers(0, 64, (1000, 64))                        # each one's own bootstrap interval
    ci = [np.percentile(np.asarray(e.window_kl)[idx].sum(1) / 6400, [2.5, 97.5]) for e in (a, b)]
    assert ci[1][1] > ci[0][0]                                 # they overlap
    same = paired_difference(a, a)
    assert same["kl_ratio_ci"] == (1.0, 1.0) and same["kl_diff"] == 0


def test_paired_difference_refuses_unpaired_inputs():
    a = _eval("a", [1.0, 2.0], [3.0, 4.0])
    with pytest.raises(ValueError, match="same windows"):
        paired_difference(a, _eval("b", [1.0, 2.0], [3.0, 4.0], tokens=50.0))
    with pytest.raises(ValueError, match="no per-window KL"):
        paired_difference(a, Eval("old", 1.0, (1.0, 1.0), 2, 200, 0.0))


def test_topk_kl_is_a_lower_bound_of_full_kl(tiny_llama, windows):
    ref_fwd = plain_forward(tiny_llama)
    full = reference_predictions(ref_fwd, windows, k=256, progress=False)
    top = reference_predictions(ref_fwd, windows, k=8, progress=False)
    state = quantize(tiny_llama, RECIPES["w4a16-int4-tensor"], progress=False)
    with quantized_execution(tiny_llama, state) as fwd:
        e_full = evaluate(fwd, windows, full, progress=False)
        e_top = evaluate(fwd, windows, top, progress=False)
    assert 0 < e_top.kl_mean <= e_full.kl_mean
    assert e_top.top1 == e_full.top1 and e_top.ppl == e_full.ppl


def test_reference_window_count_must_match(tiny_llama, windows):
    fwd = plain_forward(tiny_llama)
    ref = reference_predictions(fwd, windows[:2], k=4, progress=False)
    with pytest.raises(ValueError, match="reference covers 2 windows"):
        evaluate(fwd, windows, ref, progress=False)


def _table_forward(probs):
    """A model whose next-token distribution at position t is ``probs[t]``, whatever the input."""
    lp = torch.tensor(probs, dtype=torch.float32).log()

    def fwd(ids):
        return lp[: ids.shape[1]][None]

    return fwd


def test_loss_mask_counts_only_the_masked_positions():
    import math

    from lowbit.evaluation.metrics import summarize_reference

    windows = torch.tensor([[0, 0, 1], [0, 1, 1]])  # targets: w0 (0, 1), w1 (1, 1)
    ref = reference_predictions(_table_forward([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]), windows, k=2, progress=False)
    quant = _table_forward([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    mask = torch.tensor([[False, True], [False, True]])  # the second predicted position of each window
    ev = evaluate(quant, windows, ref, mask=mask, progress=False, workers=1)
    # both counted targets are token 1 at p = 0.75; the reference gives them 0.5
    assert ev.tokens == 2 and ev.ppl == pytest.approx(4 / 3, rel=1e-6)
    assert ev.delta_pct == pytest.approx(100 * ((4 / 3) / 2 - 1), rel=1e-5)
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL at position 1; position 0 is 0
    assert ev.kl_mean == pytest.approx(kl, rel=1e-5)
    assert ev.top1 == 0.0  # the reference's argmax there is token 0 (a tie, first index), the model's 1
    assert summarize_reference(ref, mask=mask).ppl == pytest.approx(2.0, rel=1e-6)
    full = evaluate(quant, windows, ref, progress=False, workers=1)  # unmasked: position 0 counts too
    assert full.tokens == 4 and full.kl_mean == pytest.approx(kl / 2, rel=1e-5) and full.top1 == 0.5
    assert full.ppl == pytest.approx(math.sqrt(2 * 4 / 3), rel=1e-6)  # p = 0.5, 0.75, 0.5, 0.75
    ones = evaluate(quant, windows, ref, mask=torch.ones(2, 2, dtype=torch.bool), progress=False, workers=1)
    assert ones.ppl == full.ppl and ones.kl_mean == full.kl_mean and ones.kl_ci == full.kl_ci


def test_loss_mask_is_checked():
    windows = torch.tensor([[0, 0, 1], [0, 1, 1]])
    fwd = _table_forward([[0.5, 0.5]] * 3)
    with pytest.raises(ValueError, match="selects no token"):
        evaluate(fwd, windows, mask=torch.zeros(2, 2, dtype=torch.bool), progress=False, workers=1)
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        evaluate(fwd, windows, mask=torch.ones(2, 3, dtype=torch.bool), progress=False, workers=1)
