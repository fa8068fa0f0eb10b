"""The comparison arithmetic on known log-probability arrays (no engine needed)."""

import math

import numpy as np
import pytest
import torch

from lowbit.engines.scoring import EngineScores, PairAccumulator, coarse_kl, logprobs_at


def _engine_from(logits: torch.Tensor, targets: torch.Tensor, k: int) -> EngineScores:
    lp = torch.log_softmax(logits.double(), -1)
    top = torch.topk(lp, k, dim=-1)
    return EngineScores(lp.gather(-1, targets[:, None])[:, 0].numpy()[None].astype(np.float32),
                        top.indices.numpy()[None].astype(np.int32), top.values.numpy()[None].astype(np.float32))


def test_coarse_kl_of_identical_distributions_is_zero_and_full_k_is_exact():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(5, 10, generator=g, dtype=torch.float64), -1).numpy()
    assert np.allclose(coarse_kl(lp, lp), 0, atol=1e-12)
    lq = torch.log_softmax(torch.randn(5, 10, generator=g, dtype=torch.float64), -1).numpy()
    exact = (np.exp(lp) * (lp - lq)).sum(-1)
    assert np.allclose(coarse_kl(lp, lq), exact, rtol=1e-9)


def test_coarse_kl_with_rest_bucket_by_hand():
    # P = (0.5, 0.3 | rest 0.2), Q = (0.4, 0.4 | rest 0.2) on two known tokens
    p, q = np.log([[0.5, 0.3]]), np.log([[0.4, 0.4]])
    want = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert coarse_kl(p, q)[0] == pytest.approx(want, rel=1e-12)
    # a lower bound of the full KL: splitting the rest differently only adds
    full_p, full_q = np.log([[0.5, 0.3, 0.15, 0.05]]), np.log([[0.4, 0.4, 0.05, 0.15]])
    assert coarse_kl(full_p, full_q)[0] > coarse_kl(p, q)[0]


def test_pair_ppl_kl_top1_against_known_arrays():
    g = torch.Generator().manual_seed(1)
    V, n = 40, 7
    lowbit = torch.randn(n, V, generator=g)
    targets = torch.randint(0, V, (n,), generator=g)
    engine = lowbit + 0.05 * torch.randn(n, V, generator=g)
    scores = _engine_from(engine, targets, k=V)  # full vocabulary: KL exact
    acc = PairAccumulator()
    acc.add(lowbit, targets, scores, 0, reference_logits=engine)
    pair = acc.result()
    lp_l, lp_e = torch.log_softmax(lowbit.double(), -1), torch.log_softmax(engine.double(), -1)
    assert pair.tokens == n
    assert pair.lowbit_ppl == pytest.approx(math.exp(-lp_l.gather(-1, targets[:, None]).mean().item()), rel=1e-9)
    assert pair.engine_ppl == pytest.approx(math.exp(-lp_e.gather(-1, targets[:, None]).mean().item()), rel=1e-6)
    kl = (lp_l.exp() * (lp_l - lp_e)).sum(-1).mean().item()
    assert pair.kl == pytest.approx(kl, rel=1e-4)
    kl_ref = (lp_e.exp() * (lp_e - lp_l)).sum(-1).mean().item()
    assert pair.kl_reference == pytest.approx(kl_ref, rel=1e-4)
    agree = (lowbit.argmax(-1) == engine.argmax(-1)).double().mean().item()
    assert pair.top1 == pytest.approx(agree)
    assert pair.delta_ppl == pytest.approx(pair.engine_ppl - pair.lowbit_ppl)


def test_pair_top1_counts_disagreement_and_topk_kl_is_a_lower_bound():
    V = 30
    lowbit = torch.zeros(2, V)
    lowbit[0, 3] = lowbit[1, 4] = 5.0
    engine = torch.zeros(2, V)
    engine[0, 3] = engine[1, 7] = 5.0
    targets = torch.tensor([3, 7])
    full, top = PairAccumulator(), PairAccumulator()
    full.add(lowbit, targets, _engine_from(engine, targets, V), 0)
    top.add(lowbit, targets, _engine_from(engine, targets, 5), 0)
    assert full.result().top1 == 0.5 and top.result().top1 == 0.5
    assert 0 < top.result().kl <= full.result().kl + 1e-12


def test_logprobs_at_and_engine_shape_check():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert logprobs_at(logits, np.array([[1, 0]])) == pytest.approx(np.log([[0.75, 0.25]]))
    s = EngineScores(np.zeros((1, 3), np.float32), np.zeros((1, 3, 2), np.int32), np.zeros((1, 3, 2), np.float32))
    s.check(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        s.check(torch.zeros(2, 4, dtype=torch.long))


def test_engine_root_cause_line_from_a_vllm_log():
    from lowbit.engines.verify import _engine_error

    log = """(Worker pid=1) INFO 12-01 18:41:30 [cpu_model_runner.py:68] Starting to load model /x...
(Worker pid=1) ERROR 12-01 18:41:36 [multiproc_executor.py:1063]   File "cpu_attn.py", line 541, in _get_attn_isa
(Worker pid=1) ERROR 12-01 18:41:36 [multiproc_executor.py:1063]     raise NotImplementedError(
(Worker pid=1) ERROR 12-01 18:41:36 [multiproc_executor.py:1063] NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.
(EngineCore pid=2) ERROR 12-01 18:41:36 [core.py:1510] RuntimeError: Worker failed with error 'FP8 KV cache on CPU requires x86 with AVX-512 or AMX.', please check the stack trace above for the root cause
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""
    assert _engine_error(log) == "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    assert _engine_error("vllm.exceptions.VLLMValidationError: The decoder prompt (length 512) is too long\n") == \
        "VLLMValidationError: The decoder prompt (length 512) is too long"
    assert _engine_error("") == "no output"
    dead = ("(Worker pid=1) ERROR [x.py:1] AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'\n"
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above)\n")
    assert _engine_error(dead) == "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"


def test_cpu_caveat_for_int8_without_vnni():
    from lowbit.engines.support import FolderSchemes, GroupScheme, cpu_caveats

    s = FolderSchemes("/x/int8", (GroupScheme("group_0", "W8A8 INT8 dynamic", "int-quantized", {}, {}),), None, "bfloat16")
    assert len(cpu_caveats(s, "AVX2")) == 1 and "VNNI" in cpu_caveats(s, "AVX2")[0]
    assert cpu_caveats(s, "AVX512") == [] and cpu_caveats(s, "AVX2", amx=True) == []


def test_isa_dependent_refusals():
    from lowbit.engines.support import EngineUnsupported, FolderSchemes, GroupScheme, check_supported

    int4 = FolderSchemes("/x/w4", (GroupScheme("group_0", "W4A16 INT4", "pack-quantized", {}, None),), None, "bfloat16")
    kv = FolderSchemes("/x/kv", (), {"num_bits": 8}, "bfloat16")
    for s, word in ((int4, "cpu_gemm_wna16"), (kv, "AVX-512")):
        with pytest.raises(EngineUnsupported, match=word):
            check_supported(s, "cpu", "AVX2")
        check_supported(s, "cpu", "AVX512")
        check_supported(s, "cpu", "AVX2", amx=True)
