"""Window-parallel workers: the same results as one process, errors surface, hooks and
quantization carry over into the forked workers."""

import os

import pytest
import torch

from lowbit.quantization.calibrate import collect_stats
from lowbit.evaluation.metrics import evaluate, reference_predictions
from lowbit.util.parallel import default_workers, map_shards
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import recipe_from_dict
from lowbit.quantization.runtime import plain_forward, quantized_execution


def test_shards_cover_every_item_once_in_order():
    for workers in (1, 2, 3, 7):
        parts = map_shards(lambda idx, tick: [i * i for i in idx if tick() is None], 7, workers=workers, progress=False)
        assert [x for p in parts for x in p] == [i * i for i in range(7)]
        assert len(parts) == min(workers, 7)


def test_workers_run_in_other_processes_with_one_thread():
    parts = map_shards(lambda idx, tick: (os.getpid(), torch.get_num_threads()), 4, workers=2, progress=False)
    assert len({pid for pid, _ in parts}) == 2 and os.getpid() not in {pid for pid, _ in parts}
    assert all(threads == 1 for _, threads in parts)


def test_a_worker_exception_is_raised_with_its_type():
    def fail(idx, tick):
        if 3 in idx:
            raise KeyError("window 3 is bad")
        return list(idx)

    with pytest.raises(KeyError, match="window 3 is bad") as info:
        map_shards(fail, 4, workers=2, progress=False)
    assert any("worker 1" in note for note in info.value.__notes__)


def test_a_worker_that_dies_is_reported():
    def die(idx, tick):
        if 0 in idx:
            os._exit(3)
        return 0

    with pytest.raises(RuntimeError, match="exit code 3"):
        map_shards(die, 2, workers=2, progress=False)


def test_default_workers_follow_the_environment(monkeypatch):
    monkeypatch.setenv("LOWBIT_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.setenv("LOWBIT_WORKERS", "zero")
    with pytest.raises(ValueError, match="LOWBIT_WORKERS"):
        default_workers()
    monkeypatch.delenv("LOWBIT_WORKERS")
    assert 1 <= default_workers() <= 8


def test_parallel_evaluation_matches_one_process(tiny_llama, windows):
    import copy

    fwd = plain_forward(tiny_llama)
    ref1 = reference_predictions(fwd, windows, k=32, progress=False, workers=1)
    ref2 = reference_predictions(fwd, windows, k=32, progress=False, workers=2)
    assert torch.equal(ref1.topk_ids, ref2.topk_ids) and torch.equal(ref1.argmax, ref2.argmax)
    assert torch.allclose(ref1.topk_logprobs, ref2.topk_logprobs, atol=1e-5)
    # a quantized model: its hooks (dynamic FP8 activations) and KV quantization run in the workers
    m = copy.deepcopy(tiny_llama)
    recipe = recipe_from_dict({"weights": "fp8-channel", "inputs": "fp8-token", "kv_cache": {"scheme": "fp8-tensor"}})
    state = quantize(m, recipe, stats=collect_stats(m, windows, progress=False, workers=1), progress=False)
    assert state.kv is not None and state.activations
    with quantized_execution(m, state) as qf:
        one = evaluate(qf, windows, ref1, progress=False, workers=1)
        two = evaluate(qf, windows, ref1, progress=False, workers=3)
    assert one.kl_mean > 0
    assert two.ppl == pytest.approx(one.ppl, rel=1e-5)
    assert two.kl_mean == pytest.approx(one.kl_mean, rel=1e-3, abs=1e-7)
    assert two.top1 == pytest.approx(one.top1, abs=1.0 / one.tokens)
    assert two.tokens == one.tokens and two.ppl_ci == pytest.approx(one.ppl_ci, rel=1e-4)


def test_parallel_calibration_merges_maxima(tiny_llama, windows):
    one = collect_stats(tiny_llama, windows, progress=False, workers=1)
    two = collect_stats(tiny_llama, windows, progress=False, workers=2)
    assert one.tokens == two.tokens == windows.numel()
    assert one.input_absmax.keys() == two.input_absmax.keys() and one.k_absmax.keys() == two.k_absmax.keys()
    for a, b in [(one.input_absmax, two.input_absmax), (one.k_absmax, two.k_absmax), (one.v_absmax, two.v_absmax)]:
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-5), k
