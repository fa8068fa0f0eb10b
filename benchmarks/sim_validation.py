"""Predicted against measured: every serving figure of REFERENCE §6 (and research/anchors_sim.md §6.1).

    python benchmarks/sim_validation.py          # the table, with the constants of gpus.yaml
    python benchmarks/sim_validation.py --fit    # refit the fitted constants, then the table

Fitted on (marked "fit"): BF16 single-stream TPOT and BF16 saturated throughput on H100 and A100
(→ step_overhead_ms, seq_overhead_us per GPU), W4A16 single-stream TPOT and saturated throughput
on H100 (→ the weight-only per-linear overhead and large-batch efficiency).  Every other row is held out: its error is a prediction error.

Assumptions (the sources do not state them): the vLLM 0.7 runs used chunked prefill with a
2048-token budget and 256 sequences; ShareGPT lengths are approximated by lognormals
(prompt mean 220, output mean 200; sigma 1.0), the AccelMark offline runs by 100 such
requests at concurrency 64 with outputs capped at 512.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings

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
    r.append(("Llama-3.1-8B h100 w4a16/bf16 offline tok/s", llama["w4a16"] / llama["bf16"], 0.62, "held out"))
    big = {p: saturated_rps(scenario("llama-3.1-70b", p, "h100", tp=4), n=600) for p in ("bf16", "fp8")}
    r.append(("Llama-70B 4xH100 (TP4) fp8/bf16 max QPS 1024/128", big["fp8"] / big["bf16"], 1.68, "held out"))
    knee = scenario("llama-3.1-8b", "bf16", "a100-40gb")
    for rate, p50, p99 in ((10, 79, 165), (25, 104, 3625)):
        s = knee.run(Workload(rate, 300, SHAREGPT_P, SHAREGPT_O, seed=0)).summary()
        r.append((f"Llama-3.1-8B A100-40GB {rate} req/s TTFT p50 (ms)", s.ttft.p50 * 1e3, p50, "held out"))
        r.append((f"Llama-3.1-8B A100-40GB {rate} req/s TTFT p99 (ms)", s.ttft.p99 * 1e3, p99, "held out"))
    # sensitivity, not a prediction: the real run's KV capacity is unknown (its max_model_len and
    # activation profile are not published); with ~30k tokens of KV, preemption produces the knee
    tight = dataclasses.replace(knee, kv_tokens=30_000)
    for rate, p50, p99 in ((10, 79, 165), (25, 104, 3625)):
        s = tight.run(Workload(rate, 300, SHAREGPT_P, SHAREGPT_O, seed=0)).summary()
        r.append((f"  same, KV capped at 30k tokens: {rate} req/s TTFT p50", s.ttft.p50 * 1e3, p50, "sensitivity"))
        r.append((f"  same, KV capped at 30k tokens: {rate} req/s TTFT p99", s.ttft.p99 * 1e3, p99, "sensitivity"))
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
