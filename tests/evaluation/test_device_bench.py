"""The workbench with a device, a dtype and a batch: default cache keys are the ones computed
before devices existed; another dtype gets its own reference, statistics and rows; a batch
gives the one-window numbers; a model spread by accelerate's device map evaluates the same."""

import copy

import pytest
import torch

from lowbit.evaluation.compare import Workbench
from lowbit.evaluation.rowcache import row_path
from lowbit.evaluation.workbench import _digest, model_fingerprint, window_bytes
from lowbit.models.loading import ModelInfo
from lowbit.quantization.recipe import RECIPES


def _bench(model, windows, cache, **kw):
    info = ModelInfo("tiny", cache / "no-model", False, "")
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5))
    return Workbench(model, None, info, windows, calib, "synthetic", 0, cache, kl_topk=32, progress=False, **kw)


def test_default_keys_are_unchanged_and_other_dtypes_get_their_own(tiny_llama, windows, tmp_path):
    b32 = _bench(tiny_llama, windows, tmp_path)
    assert b32._key(windows, 32) == _digest(model_fingerprint(b32.info), windows, 32)  # the formula before devices
    b16 = _bench(copy.deepcopy(tiny_llama).to(torch.bfloat16), windows, tmp_path, dtype=torch.bfloat16)
    assert b16._key(windows, 32) != b32._key(windows, 32)
    recipe = RECIPES["w4a16-int4-tensor"]
    assert row_path(b16, recipe) != row_path(b32, recipe)
    r32, r16 = b32.reference, b16.reference
    assert len(list((tmp_path / "references").iterdir())) == 2  # each dtype its own cached reference
    assert not torch.equal(r32.topk_logprobs, r16.topk_logprobs)


def test_a_batched_bench_gives_the_one_window_numbers(tiny_llama, windows, tmp_path):
    one = _bench(tiny_llama, windows, tmp_path / "a", workers=1)
    many = _bench(tiny_llama, windows, tmp_path / "b", batch=4)  # 6 windows: a ragged last batch
    assert one.eval_batch is None and many.eval_batch == 4
    recipe = RECIPES["w8a8-int8-static"]  # calibration batched too
    a, b = one.run(recipe).eval, many.run(recipe).eval
    assert b.ppl == pytest.approx(a.ppl, rel=1e-5)
    assert b.kl_mean == pytest.approx(a.kl_mean, rel=1e-3, abs=1e-7)
    assert abs(a.top1 - b.top1) <= 1e-3


def test_window_memory_estimate_grows_with_the_window(tiny_llama):
    small = window_bytes(tiny_llama.config, 128, torch.float32)
    assert window_bytes(tiny_llama.config, 256, torch.float32) > 2 * small - 1
    assert small >= 128 * 256 * 12  # at least the logits, their fp32 copy and one temporary


def test_a_device_mapped_model_evaluates_the_same(tiny_folder, tmp_path):
    """accelerate's device map (here everything offloaded to disk: the only device this
    machine has besides its memory) through the bench: the same evaluation as loaded whole;
    quantizing it is refused with the way to do it."""
    folder, corpus = tiny_folder
    kw = dict(corpus=str(corpus), windows=3, seq_len=16, calib_windows=0, cache=tmp_path, progress=False, workers=1)
    whole = Workbench.load(str(folder), **kw)
    from lowbit.models.loading import load_model

    spread = Workbench.load(str(folder), loader=lambda m, cache, **_: load_model(
        m, cache=cache, device_map="auto", max_memory={"cpu": 150_000}), **kw)
    assert set(spread.model.hf_device_map.values()) - {"cpu"}  # really dispatched (offloaded)
    a, b = whole.run(None).eval, spread.run(None).eval
    assert a.ppl == pytest.approx(b.ppl, rel=1e-6)
    with pytest.raises(ValueError, match="device map is evaluated as loaded only"):
        spread.run(RECIPES["w4a16-int4-tensor"])


def test_a_reference_that_overflows_its_dtype_is_refused(tiny_llama, windows, tmp_path):
    m = copy.deepcopy(tiny_llama).to(torch.float16)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(1e6)  # tied lm_head: logits beyond fp16's 65504, inf, then NaN
    bench = _bench(m, windows, tmp_path, dtype=torch.float16, workers=1)
    with pytest.raises(ValueError, match="NaN or inf on .* windows in float16.*use --dtype bf16 or fp32"):
        bench.reference
