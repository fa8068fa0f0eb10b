"""A bf16 model on the CPU through quantization (RTN, GPTQ, AWQ, static scales), evaluation and
export: every tensor lowbit creates must follow the model's dtype (a hard-coded fp32 would
fail here or change the weights' dtype), and the result must agree with fp32 to bf16's
precision."""

import copy

import pytest
import torch

from lowbit.checkpoint.write import export
from lowbit.evaluation.metrics import evaluate, reference_predictions
from lowbit.models.loading import read_into
from lowbit.quantization.calibrate import collect_stats
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import plain_forward, quantized_execution
from tinymodels import token_windows, wide_llama

RECIPES_BF16 = ["w4a16-int4-g128", "w4a16-gptq-g128", pytest.param("w4a16-awq-g128-asym", marks=pytest.mark.slow),
                "w8a8-int8-static", "kv-fp8"]


def _dtypes(model) -> set:
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("name", RECIPES_BF16)
def test_bf16_pipeline_evaluation_and_export(name, tmp_path):
    recipe = RECIPES[name]
    calib, windows = token_windows(4, 32, seed=1), token_windows(3, 32, seed=2)
    ref32 = wide_llama()
    m16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ref = reference_predictions(plain_forward(m16), windows, k=32, progress=False, workers=1)
    assert ref.topk_logprobs.dtype == torch.float32  # metrics in fp32 whatever the model's dtype

    q16 = copy.deepcopy(m16)
    stats = collect_stats(q16, calib, progress=False, workers=1) if recipe.needs_calibration else None
    state = quantize(q16, recipe, calib, stats=stats, keep_qtensors=True, progress=False)
    assert _dtypes(q16) == {torch.bfloat16}  # quantization wrote bf16 weights back, changed no dtype
    with quantized_execution(q16, state) as fwd:
        ev = evaluate(fwd, windows, ref, progress=False, workers=1)
        ev_b = evaluate(fwd, windows, ref, progress=False, batch=2)
    assert 0 < ev.kl_mean < 1 and 0 < ev.top1 <= 1
    assert ev_b.ppl == pytest.approx(ev.ppl, rel=1e-2)

    # the same recipe in fp32: the bf16 run agrees to bf16's precision (a wrong dtype
    # somewhere, e.g. scales rounded twice, shows as a far larger difference)
    q32 = copy.deepcopy(ref32)
    stats32 = collect_stats(q32, calib, progress=False, workers=1) if recipe.needs_calibration else None
    state32 = quantize(q32, recipe, calib, stats=stats32, progress=False)
    with quantized_execution(q32, state32) as fwd32:
        ev32 = evaluate(fwd32, windows, None, progress=False, workers=1)
    assert ev.ppl == pytest.approx(ev32.ppl, rel=0.05)

    # export from the bf16 model, read back through compressed-tensors: the stored weights
    # are the bf16 model's quantized weights
    if state.weights:
        out = export(q16, state, tmp_path / "ckpt", force=False)
        back = read_into(copy.deepcopy(m16), out.path)
        for n, qt in list(state.weights.items())[:4]:
            got = back.get_submodule(n).weight
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, q16.get_submodule(n).weight), n
