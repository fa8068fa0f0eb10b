"""Predicted against measured: every serving figure of docs/references.md §6 (and research/anchors_sim.md §6.1).

    python benchmarks/sim_validation.py          # the table, with the constants of gpus.yaml
    python benchmarks/sim_validation.py --fit    # refit the fitted constants, then the table

Fitted on (marked "fit"): BF16 single-stream TPOT and BF16 saturated throughput on H100 and A100
(→ step_overhead_ms, seq_overhead_us per GPU), W4A16 single-stream TPOT and saturated throughput
on H100 (→ the weight-only per-linear overhead and large-batch efficiency).  Every other row is held out: its error is a prediction error.

Assumptions (the sources do not state them): the Red Hat vLLM 0.7.2 runs used chunked prefill
with a 2048-token budget and 256 sequences; the AccelMark H100 offline runs are approximated by
100 lognormal ShareGPT requests (prompt mean 220, output mean 200, sigma 1.0) at 64 sequences
with outputs capped at 512.  The A100-40GB knee follows AccelMark's actual configuration (see
the comment above ``knee_rows``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings

import numpy as np

from lowbit.sim import EngineConfig, Lengths, Scenario, Workload, get_model, load_hardware, parse_plan, resolve_plan

HW = load_hardware()
V07 = dict(max_num_batched_tokens=2048, max_num_seqs=256)
SHAREGPT_P = Lengths("lognormal", value=220, sigma=1.0, low=4, high=1024)
SHAREGPT_O = Lengths("lognormal", value=200, sigma=1.0, low=1, high=512)


def scenario(model, plan, gpu, kernels=None, tp=1, **engine):
    g = HW.gpu(gpu) if isinstance(gpu, str) else gpu
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = resolve_plan(parse_plan(plan), g)
    return Scenario(get_model(model), p, g, kernels or HW.kernels, EngineConfig(tp=tp, **{**V07, **engine}))


def single_stream_tpot(sc, prompt=1024, output=1024):
    return float(sc.run(Workload(1.0, 1, Lengths.fixed(prompt), Lengths.fixed(output))).tpot[0])


def saturated_rps(sc, prompt=1024, output=128, n=1000):
    return sc.run(Workload(math.inf, n, Lengths.fixed(prompt), Lengths.fixed(output))).summary().request_throughput


def sharegpt_offline_tps(sc):
    return sc.run(Workload(math.inf, 100, SHAREGPT_P, SHAREGPT_O, seed=0)).summary().output_throughput


# -- fitting --------------------------------------------------------------------------

def _solve(f, target, lo, hi, iters=40):
    """x in [lo, hi] with f(x) = target, f increasing (bisection)."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def fit(verbose=True):
    out = {}
    for gpu, tpot, sat in (("h100", 7.4e-3, 26.7), ("a100", 11.3e-3, 11.4)):
        g = HW.gpu(gpu)
        for _ in range(3):  # alternate: TPOT pins the step overhead, throughput the per-sequence one
            step = _solve(lambda x: single_stream_tpot(scenario("qwen2-7b", "bf16", dataclasses.replace(g, step_overhead_ms=x))),
                          tpot, 0.0, 10.0, 25)
            g = dataclasses.replace(g, step_overhead_ms=step)
            seq = _solve(lambda x: -saturated_rps(scenario("qwen2-7b", "bf16", dataclasses.replace(g, seq_overhead_us=x))),
                         -sat, 0.0, 200.0, 20)
            g = dataclasses.replace(g, seq_overhead_us=seq)
        out[gpu] = (round(g.step_overhead_ms, 2), round(g.seq_overhead_us, 1))
    g = dataclasses.replace(HW.gpu("h100"), step_overhead_ms=out["h100"][0], seq_overhead_us=out["h100"][1])
    k = HW.kernels
    for _ in range(3):  # TPOT pins the per-linear overhead, throughput the large-batch efficiency
        wo = _solve(lambda x: single_stream_tpot(scenario("qwen2-7b", "w4a16", g, dataclasses.replace(k, weight_only_linear_us=x))),
                    5.4e-3, 0.0, 50.0, 25)
        k = dataclasses.replace(k, weight_only_linear_us=wo)
        eff = _solve(lambda x: saturated_rps(scenario("qwen2-7b", "w4a16", g, dataclasses.replace(k, weight_only_efficiency=x))),
                     26.9, 0.05, 1.0, 20)
        k = dataclasses.replace(k, weight_only_efficiency=eff)
    out["weight_only_linear_us"] = round(k.weight_only_linear_us, 1)
    out["weight_only_efficiency"] = round(k.weight_only_efficiency, 3)
    if verbose:
        print("fitted (copy into src/lowbit/data/gpus.yaml):")
        for k, v in out.items():
            print(f"  {k}: {v}")
    return out


# -- the A100-40GB knee (AccelMark suite_C online, vLLM 0.7.3) -------------------------
#
# The run as AccelMark configured it (FreedomIntelligence/AccelMark @5797fc4: suites/suite_C/suite.json,
# runners/nvidia_vllm_47f5d58e/runner.py, loadgen/loadgen.py, datasets/sharegpt_standard_v1, and the result
# results/verified/nvidia_a100_sxm4_40gbx1_suite_C_nvidia_vllm_47f5d58e_57cc3fdf):
# - 300 requests per run, Poisson arrivals (cumulative exponential gaps, not rescaled), 3 runs pooled;
# - the online path builds AsyncEngineArgs without max_num_seqs, so vLLM 0.7.3's default 256 applies
#   (the 512 in the result's extra_config reaches only the offline LLM path); gpu_memory_utilization 0.9;
#   max_model_len 4096;
# - prompts: the dataset's input_tokens (first 300: p50 203, p90 461, max 592; all 500: p50 198.5,
#   p90 456.5, min 64, max 592), fitted by a lognormal on p50/p90 and clipped to [64, 592], plus ~30
#   tokens of the Llama-3.1 chat template the runner applies (estimate);
# - outputs: greedy, natural length, capped at 512 (output_tokens_max); their mean, 355 tokens, is
#   measured in the same result set (offline BF16: 2,382.4 tok/s x 14.9 s / 100 requests; 343-358
#   for the other formats).  Their spread is not published: a lognormal of sigma 1.0 (our earlier
#   ShareGPT assumption, not tuned on the knee) with its mean set so the clipped mean is 355;
#   sigma 0.5 / 0.8 / 1.5 are printed as sensitivities.
# Differences we do not model: vLLM 0.7.3 ran its V0 engine (no chunked prefill at max_model_len 4096,
# prefill-first steps with a 4,096-token budget) while lowbit simulates V1's chunked prefill with a
# 2,048-token budget; the in-process AsyncLLMEngine's tokenization/detokenization time.

ACCEL_PROMPT_SIGMA = math.log(456.5 / 198.5) / 1.2816
ACCEL_PROMPT = Lengths("lognormal", value=round(198.5 * math.exp(ACCEL_PROMPT_SIGMA**2 / 2)) + 30,
                       sigma=ACCEL_PROMPT_SIGMA, low=64 + 30, high=592 + 30)
ACCEL_OUTPUT_MEAN = 355
KNEE = {  # plan: {rate: (TTFT p50 ms, TTFT p99 ms, run seconds (median of 3))}
    "bf16": {5: (60.47, 107.45, 72.0), 10: (78.68, 165.18, 47.1), 25: (103.81, 3624.72, 38.7),
             50: (283.75, 7023.58, 36.5)},
    "w8a8-int8": {25: (68.69, 1008.5, 33.5)},
    "w4a16": {25: (135.29, 2639.04, 38.2)},
}


def accel_output(sigma=1.0, mean=ACCEL_OUTPUT_MEAN, cap=512):
    """Lognormal outputs clipped to [1, cap] whose clipped mean is ``mean`` (solved by bisection on a large sample)."""
    rng_sample = lambda v: Lengths("lognormal", value=v, sigma=sigma, low=1, high=cap).sample(
        100_000, np.random.default_rng(12345)).mean()
    lo, hi = mean, 20 * mean
    for _ in range(30):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if rng_sample(mid) < mean else (lo, mid)
        if hi - lo <= 1:
            break
    return Lengths("lognormal", value=hi, sigma=sigma, low=1, high=cap)


def accel_online(sc, rate, output, seeds=(0, 1, 2)):
    """TTFT p50, p99 (ms) pooled over three 300-request runs, and the median run length (s)."""
    runs = [sc.run(Workload(rate, 300, ACCEL_PROMPT, output, seed=s, normalize=False)) for s in seeds]
    t = np.concatenate([x.ttft for x in runs]) * 1e3
    return float(np.percentile(t, 50)), float(np.percentile(t, 99)), float(np.median([x.finish.max() for x in runs]))


def knee_rows():
    r = []
    out = accel_output(1.0)
    for plan, pts in KNEE.items():
        sc = scenario("llama-3.1-8b", plan, "a100-40gb", max_num_seqs=256)
        for rate, (p50, p99, dur) in pts.items():
            s50, s99, sdur = accel_online(sc, rate, out)
            r.append((f"Llama-3.1-8B A100-40GB {plan} {rate} req/s TTFT p50 (ms)", s50, p50, "held out"))
            r.append((f"Llama-3.1-8B A100-40GB {plan} {rate} req/s TTFT p99 (ms)", s99, p99, "held out"))
            if plan == "bf16":
                r.append((f"Llama-3.1-8B A100-40GB {plan} {rate} req/s run length (s)", sdur, dur, "held out"))
    bf = scenario("llama-3.1-8b", "bf16", "a100-40gb", max_num_seqs=256)
    meas = KNEE["bf16"][25][1] / KNEE["bf16"][10][1]
    pred = accel_online(bf, 25, out)[1] / accel_online(bf, 10, out)[1]
    r.append(("  knee: BF16 TTFT p99 growth 10 -> 25 req/s (x)", pred, meas, "held out"))
    # sensitivities, not predictions
    for sigma in (0.5, 0.8, 1.5):
        o = accel_output(sigma)
        r.append((f"  same, output sigma {sigma}: 25 req/s TTFT p99 (ms)", accel_online(bf, 25, o)[1],
                  KNEE["bf16"][25][1], "sensitivity"))
    seq512 = scenario("llama-3.1-8b", "bf16", "a100-40gb", max_num_seqs=512)
    r.append(("  same, max_num_seqs 512: 25 req/s TTFT p99 (ms)", accel_online(seq512, 25, out)[1],
              KNEE["bf16"][25][1], "sensitivity"))
    old = Lengths("lognormal", value=200, sigma=1.0, low=1, high=512)
    r.append(("  same, outputs mean 200 (old guess): 25 req/s TTFT p99 (ms)", accel_online(bf, 25, old)[1],
              KNEE["bf16"][25][1], "sensitivity"))
    return r


# -- the table ------------------------------------------------------------------------

def rows():
    """(figure, predicted, measured, kind, 'fit'|'held out') for every anchor."""
    r = []
    q = "qwen2-7b"
    for gpu, plan, meas, role in (("h100", "bf16", 7.4, "fit"), ("h100", "fp8", 5.4, "held out"),
                                  ("h100", "w4a16", 5.4, "fit"), ("a100", "bf16", 11.3, "fit"),
                                  ("a100", "w8a8-int8", 8.5, "held out"), ("a100", "w4a16", 6.1, "held out")):
        r.append((f"Qwen2-7B {gpu} {plan} single-stream TPOT (ms)", single_stream_tpot(scenario(q, plan, gpu)) * 1e3, meas, role))
    sat = {}
    for gpu, plans in (("h100", {"bf16": 26.7, "fp8": 31.1, "w4a16": 26.9}),
                       ("a100", {"bf16": 11.4, "w8a8-int8": 15.7, "w4a16": 10.0})):
        for plan, meas in plans.items():
            sat[gpu, plan] = saturated_rps(scenario(q, plan, gpu))
            r.append((f"Qwen2-7B {gpu} {plan} saturated 1024/128 (req/s)", sat[gpu, plan], meas,
                      "fit" if plan == "bf16" or (gpu, plan) == ("h100", "w4a16") else "held out"))
    for gpu, plan, meas in (("h100", "fp8", 31.1 / 26.7), ("h100", "w4a16", 26.9 / 26.7),
                            ("a100", "w8a8-int8", 15.7 / 11.4), ("a100", "w4a16", 10.0 / 11.4)):
        r.append((f"Qwen2-7B {gpu} {plan}/bf16 saturated ratio", sat[gpu, plan] / sat[gpu, "bf16"], meas,
                  "fit" if (gpu, plan) == ("h100", "w4a16") else "held out"))
    llama = {p: sharegpt_offline_tps(scenario("llama-3.1-8b", p, "h100", max_num_seqs=64)) for p in ("bf16", "fp8", "w4a16")}
    r.append(("Llama-3.1-8B h100 fp8/bf16 offline tok/s", llama["fp8"] / llama["bf16"], 1.25, "held out"))
    # AccelMark loads W4A16 with quantization="gptq": vLLM then keeps the legacy GPTQ kernel instead of
    # converting to gptq_marlin ("...you specified quantization=gptq explicitly, so forcing gptq"), a kernel
    # lowbit does not model; the row stays to show the gap, not as a Marlin figure.
    r.append(("Llama-3.1-8B h100 w4a16/bf16 offline tok/s [legacy GPTQ kernel]", llama["w4a16"] / llama["bf16"], 0.62,
              "held out"))
    big = {p: saturated_rps(scenario("llama-3.1-70b", p, "h100", tp=4), n=600) for p in ("bf16", "fp8")}
    r.append(("Llama-70B 4xH100 (TP4) fp8/bf16 max QPS 1024/128", big["fp8"] / big["bf16"], 1.68, "held out"))
    r.extend(knee_rows())
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the fitted constants first (slow)")
    args = ap.parse_args(argv)
    if args.fit:
        fit()
    print(f"{'figure':58s} {'predicted':>10s} {'measured':>10s} {'error':>8s}  role")
    errs = []
    for name, pred, meas, role in rows():
        err = pred / meas - 1
        if role == "held out":
            errs.append(abs(err))
        print(f"{name:58s} {pred:10.3f} {meas:10.3f} {err:+8.1%}  {role}")
    print(f"held-out figures: {len(errs)}, median |error| {sorted(errs)[len(errs) // 2]:.1%}, max {max(errs):.1%}")


if __name__ == "__main__":
    main()
