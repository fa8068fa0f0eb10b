"""The simulator against analytic oracles."""


import numpy as np
import pytest

from lowbit.sim.engine import EngineConfig, simulate
from lowbit.sim.memory import memory_report
from lowbit.sim.perf import StepModel, step_model
from lowbit.sim.plans import parse_plan
from lowbit.sim.shapes import get_model
from lowbit.sim.workload import Lengths, Workload


def constant_step(seconds: float) -> StepModel:
    """Every step takes ``seconds``, whatever it computes."""
    return StepModel(layers=1, linears=(), experts=(), n_experts=0, top_k=0, lm_head=(0.0, 0.0),
                     attn_flop_s=0.0, kv_read_s=0.0, allreduce_s=(0.0, 0.0),
                     step_s=seconds, seq_s=0.0, layer_s=0.0)


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_md1_prefill_only_mean_ttft(rho):
    """Batch-1 prefill-only server, Poisson arrivals: mean TTFT = D + λD²/(2(1 − λD)) (M/D/1)."""
    d = 0.010
    lam = rho / d
    w = Workload(lam, 20_000, Lengths.fixed(512), Lengths.fixed(1), seed=3, normalize=False)
    res = simulate(w.sample(), constant_step(d), kv_tokens=10**6, engine=EngineConfig(8192, 1))
    expected = d + lam * d**2 / (2 * (1 - lam * d))
    assert res.ttft.mean() == pytest.approx(expected, rel=0.05)
    assert np.all(res.ttft >= d - 1e-12)


def test_littles_law(hw):
    """Time-average number of requests in the system = arrival rate × mean E2E."""
    g = hw.gpu("h100")
    m, plan = get_model("qwen2.5-7b"), parse_plan("bf16")
    rate = 8.0
    w = Workload(rate, 3000, Lengths("uniform", low=200, high=1500), Lengths("uniform", low=50, high=400),
                 seed=1, normalize=False)
    res = simulate(w.sample(), step_model(m, plan, g, hw.kernels), 10**6, EngineConfig.vllm_defaults(g))
    # count in system, integrated over time from the arrival / finish events
    times = np.concatenate([res.arrival, res.finish])
    delta = np.concatenate([np.ones(len(res.arrival)), -np.ones(len(res.finish))])
    order = np.argsort(times, kind="stable")
    t, n_in = times[order], np.cumsum(delta[order])
    horizon = res.finish.max()
    area = float(np.sum(n_in[:-1] * np.diff(t)))
    assert area / horizon == pytest.approx(rate * res.e2e.mean(), rel=0.06)
    assert len(res.arrival) / res.arrival.max() == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("plan_name", ["bf16", "fp8", "w4a16", "fp8+kv-fp8"])
def test_single_stream_decode_runs_at_the_roofline_bound(bare_gpu, bare_kernels, plan_name):
    """One request, no overheads: TPOT = bytes read per token ÷ achieved bandwidth (memory.py's bound)."""
    m, plan = get_model("qwen2.5-7b"), parse_plan(plan_name)
    prompt, out = 2000, 201
    w = Workload(1.0, 1, Lengths.fixed(prompt), Lengths.fixed(out), seed=0)
    res = simulate(w.sample(), step_model(m, plan, bare_gpu, bare_kernels), 10**6, EngineConfig())
    mean_ctx = prompt + out / 2  # contexts read by the decode steps: prompt+1 .. prompt+out-1
    bound = memory_report(m, plan, bare_gpu, context=int(mean_ctx)).decode_ms_bound / 1e3
    assert res.tpot[0] == pytest.approx(bound, rel=0.01)


def test_conservation_and_preemption(hw):
    """Every request finishes; tokens computed = prompts + outputs − 1 each, plus what preemption recomputes."""
    g = hw.gpu("h100")
    sm = step_model(get_model("qwen2.5-7b"), parse_plan("bf16"), g, hw.kernels)
    w = Workload(40.0, 400, Lengths("uniform", low=100, high=800), Lengths("uniform", low=1, high=300), seed=7)
    req = w.sample()
    roomy = simulate(req, sm, 10**6, EngineConfig(2048, 256))
    tight = simulate(req, sm, 6000, EngineConfig(2048, 256))  # forces preemption
    for res in (roomy, tight):
        assert np.all(np.isfinite(res.finish)) and np.all(res.first_token <= res.finish)
        assert len(res.itl) == int((req.output - 1).sum())
    asked = int(req.prompt.sum() + (req.output - 1).sum())
    assert roomy.preemptions.sum() == 0 and roomy.step_tokens.sum() == asked
    assert tight.preemptions.sum() > 0 and tight.step_tokens.sum() > asked
    assert tight.e2e.mean() > roomy.e2e.mean()


def test_fast_forward_changes_nothing(hw):
    g = hw.gpu("h100")
    sm = step_model(get_model("llama-3.1-8b"), parse_plan("fp8"), g, hw.kernels)
    req = Workload(6.0, 300, Lengths.fixed(700), Lengths("uniform", low=2, high=500), seed=11).sample()
    a = simulate(req, sm, 20_000, EngineConfig(2048, 64), fast_forward=True)
    b = simulate(req, sm, 20_000, EngineConfig(2048, 64), fast_forward=False)
    np.testing.assert_allclose(a.finish, b.finish, rtol=1e-9)
    np.testing.assert_allclose(a.first_token, b.first_token, rtol=1e-9)
    np.testing.assert_allclose(np.sort(a.itl), np.sort(b.itl), rtol=1e-9, atol=1e-12)
    assert len(a.step_end) == len(b.step_end)


def test_token_budget_chunks_long_prompts(bare_gpu, bare_kernels):
    """A 5000-token prompt with a 2048 budget takes 3 prefill steps: 2048 + 2048 + 904."""
    sm = step_model(get_model("qwen3-0.6b"), parse_plan("bf16"), bare_gpu, bare_kernels)
    req = Workload(1.0, 1, Lengths.fixed(5000), Lengths.fixed(3), seed=0).sample()
    res = simulate(req, sm, 10**6, EngineConfig(2048, 8))
    assert res.step_tokens.tolist() == [2048, 2048, 904, 1, 1]


def test_unfittable_request_is_a_clear_error(hw):
    g = hw.gpu("h100")
    sm = step_model(get_model("qwen3-0.6b"), parse_plan("bf16"), g, hw.kernels)
    req = Workload(1.0, 2, Lengths.fixed(5000), Lengths.fixed(10), seed=0).sample()
    with pytest.raises(ValueError, match="KV blocks"):
        simulate(req, sm, 1000, EngineConfig())
