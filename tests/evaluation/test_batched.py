"""Batched evaluation (several windows per forward, the GPU path) equals the one-window path
to float rounding: reference, PPL, KL, top-1 and calibration statistics, ragged last batches
and BOS-first windows included."""

import pytest
import torch

from lowbit.evaluation.metrics import evaluate, reference_predictions
from lowbit.quantization.calibrate import collect_stats
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import plain_forward, quantized_execution


def _windows(n: int, seq: int, bos: int | None) -> torch.Tensor:
    w = torch.randint(3, 256, (n, seq), generator=torch.Generator().manual_seed(1))
    if bos is not None:
        w[:, 0] = bos  # a BOS-requiring model (Gemma): every window starts with BOS
    return w


def _assert_same(a, b):
    assert a.tokens == b.tokens and a.windows == b.windows
    assert a.ppl == pytest.approx(b.ppl, rel=1e-5)
    assert a.kl_mean == pytest.approx(b.kl_mean, rel=1e-3, abs=1e-7)
    assert a.kl_p99 == pytest.approx(b.kl_p99, rel=1e-3, abs=1e-7)
    # an argmax can flip on a near-tie under float rounding: at most one position in a thousand
    assert abs(a.top1 - b.top1) <= 1e-3
    assert a.delta_pct == pytest.approx(b.delta_pct, abs=1e-3)


@pytest.mark.parametrize("batch", [3, 7])  # 7 windows: a ragged last batch for 3, one batch for 7
def test_batched_evaluation_equals_one_window_at_a_time(tiny_model, batch):
    bos = 2 if tiny_model.config.model_type.startswith("gemma") else None
    windows = _windows(7, 20, bos)
    fwd = plain_forward(tiny_model)
    one = reference_predictions(fwd, windows, k=32, progress=False, workers=1)
    many = reference_predictions(fwd, windows, k=32, progress=False, batch=batch)
    assert torch.allclose(one.nll, many.nll, atol=1e-4)
    assert torch.allclose(one.topk_logprobs, many.topk_logprobs, atol=1e-4)
    assert (one.argmax == many.argmax).float().mean() >= 0.999
    state = quantize(tiny_model, RECIPES["w8a8-int8"], progress=False)  # dynamic per-token activations
    with quantized_execution(tiny_model, state) as q:
        a = evaluate(q, windows, one, progress=False, workers=1)
        b = evaluate(q, windows, one, progress=False, batch=batch)
    _assert_same(a, b)
    assert a.kl_mean > 0  # the quantized model differs from the reference: KL is measured, not zero


def test_batched_calibration_statistics_equal_one_window(tiny_llama):
    windows = _windows(5, 16, None)
    one = collect_stats(tiny_llama, windows, progress=False, workers=1)
    many = collect_stats(tiny_llama, windows, progress=False, batch=2)
    assert one.tokens == many.tokens == windows.numel()
    assert set(one.input_absmax) == set(many.input_absmax)
    for k, v in one.input_absmax.items():
        assert torch.allclose(v, many.input_absmax[k], rtol=1e-5, atol=1e-6), k
    for a, b in ((one.k_absmax, many.k_absmax), (one.v_absmax, many.v_absmax)):
        assert set(a) == set(b)
        for i in a:
            assert torch.allclose(a[i], b[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", ["w8a8-int8-static", "kv-fp8"])
def test_static_kv_and_activation_scales_batched(tiny_llama, recipe):
    """A recipe with calibrated (static) activation and KV scales: the batched path runs the
    same quantization (the calibrated scales broadcast over the batch)."""
    windows = _windows(5, 16, None)
    fwd = plain_forward(tiny_llama)
    ref = reference_predictions(fwd, windows, k=32, progress=False, workers=1)
    state = quantize(tiny_llama, RECIPES[recipe], windows, progress=False)
    assert state.kv is not None or any(a.qparams is not None for a in state.activations.values())
    with quantized_execution(tiny_llama, state) as q:
        _assert_same(evaluate(q, windows, ref, progress=False, workers=1),
                     evaluate(q, windows, ref, progress=False, batch=2))


def test_a_bad_batch_is_refused(tiny_llama):
    windows = _windows(2, 8, None)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        evaluate(plain_forward(tiny_llama), windows, progress=False, batch=0)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        collect_stats(tiny_llama, windows, progress=False, batch=0)
