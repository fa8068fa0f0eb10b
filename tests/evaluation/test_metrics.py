"""Metrics: exact properties and agreement with direct computation."""

import math

import pytest
import torch

from lowbit.evaluation.metrics import evaluate, reference_predictions
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
