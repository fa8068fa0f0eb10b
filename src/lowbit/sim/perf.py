"""The time of one engine step: a per-operation roofline with achieved (not peak) rates.

For a step that computes ``M = prefill_tokens + decodes`` tokens::

    t = t_step + t_seq·seqs + L·t_layer                         # engine and launch overhead
      + L · Σ_linear [ max(2·M·n·k / F_lane, bytes_w / BW) + t_kernel ]
      + max(2·S·n_lm·h / F_bf16, bytes_lm / BW)                 # lm_head, S sampled rows, BF16
      + L · [ max(4·H·d·pairs / F_bf16, kv·kv_prefill / BW)     # prefill attention (causal pairs)
            + max(4·H·d·ctx / F_bf16, kv·ctx / BW) ]            # decode attention (Σ context)
      + L · 2 · all_reduce(M·hidden·2 bytes)                    # tensor parallel only

F_lane = peak × efficiency of the plan's math lane (weight-only plans: the BF16 lane at the
weight-only kernel efficiency), BW = peak bandwidth × memory efficiency, kv = KV bytes per
token per layer in the plan's KV dtype.  A MoE reads only the experts its tokens visit:
E·(1 − (1 − k/E)^M) of them.  Every term is per GPU (linears, heads and KV split over ``tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import GPU, Kernels
from .plans import Plan
from .shapes import ModelShape

__all__ = ["StepModel", "step_model"]

#: fixed latency of one all-reduce (assumption: the order of NCCL/custom all-reduce launch latency)
ALLREDUCE_LATENCY_S = 8e-6


@dataclass(frozen=True)
class StepModel:
    """Precomputed coefficients of the step-time formula of one (model, plan, GPU, tp).

    Attributes:
        layers: decoder layers.
        linears: per-layer dense linears as ``(seconds per token, seconds of weight reads, fixed seconds)``.
        experts: MoE expert linears as ``(seconds per token-visit, seconds per expert read, fixed seconds)``.
        n_experts, top_k: experts per layer and per token (0 for dense).
        lm_head: ``(seconds per sampled row, seconds of weight reads)``.
        attn_flop_s: seconds of attention math per (query, key) pair, one layer.
        kv_read_s: seconds to read one token's KV, one layer.
        allreduce_s: ``(fixed, per token)`` seconds of one all-reduce (0 when tp = 1).
        step_s, seq_s, layer_s: overheads per step, per scheduled sequence, per layer.
    """

    layers: int
    linears: tuple[tuple[float, float, float], ...]
    experts: tuple[tuple[float, float, float], ...]
    n_experts: int
    top_k: int
    lm_head: tuple[float, float]
    attn_flop_s: float
    kv_read_s: float
    allreduce_s: tuple[float, float]
    step_s: float
    seq_s: float
    layer_s: float

    def breakdown(self, prefill_tokens: int, decodes: int, decode_ctx: float,
                  prefill_pairs: float = 0.0, prefill_kv: float = 0.0, sampled: int | None = None) -> dict[str, float]:
        """Seconds by component for one step.

        Args:
            prefill_tokens: prompt tokens computed in this step (all chunks).
            decodes: sequences decoding one token.
            decode_ctx: Σ context length (KV tokens read) over the decoding sequences.
            prefill_pairs: Σ over prefill chunks of c·(p + (c+1)/2), (query, key) pairs of causal attention
                for a chunk of c tokens after p computed ones.
            prefill_kv: Σ over prefill chunks of p + c, KV tokens the chunks read.
            sampled: rows of logits (default: decodes + chunks that finish a prompt is not known here,
                so ``decodes`` plus one per prefill chunk is a fine bound; pass it explicitly).
        """
        m = prefill_tokens + decodes
        seqs = decodes + (1 if prefill_tokens else 0)
        rows = decodes if sampled is None else sampled
        L = self.layers
        lin = sum(max(m * a, w) + k for a, w, k in self.linears) if m else 0.0
        if self.n_experts and m:
            visited = self.n_experts * (1.0 - (1.0 - self.top_k / self.n_experts) ** m)
            lin += sum(max(m * self.top_k * a, visited * w) + k for a, w, k in self.experts)
        a_lm, w_lm = self.lm_head
        att_p = max(prefill_pairs * self.attn_flop_s, prefill_kv * self.kv_read_s)
        att_d = max(decode_ctx * self.attn_flop_s, decode_ctx * self.kv_read_s)
        ar = 2 * (self.allreduce_s[0] + m * self.allreduce_s[1]) if self.allreduce_s[0] else 0.0
        return {
            "overhead": self.step_s + self.seq_s * seqs + L * self.layer_s,
            "linears": L * lin,
            "lm_head": max(rows * a_lm, w_lm) if rows else 0.0,
            "attention": L * (att_p + att_d),
            "allreduce": L * ar,
        }

    def step_time(self, prefill_tokens: int, decodes: int, decode_ctx: float,
                  prefill_pairs: float = 0.0, prefill_kv: float = 0.0, sampled: int | None = None) -> float:
        """Seconds of one step (the sum of :meth:`breakdown`); arguments as there."""
        return sum(self.breakdown(prefill_tokens, decodes, decode_ctx, prefill_pairs, prefill_kv, sampled).values())

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds of a decode-only step of ``batch`` sequences of ``context`` tokens each."""
        return self.step_time(0, batch, float(batch * context), sampled=batch)

    def prefill_time(self, tokens: int) -> float:
        """Seconds of one step that prefills a whole prompt of ``tokens`` alone."""
        return self.step_time(tokens, 0, 0.0, tokens * (tokens + 1) / 2, tokens, sampled=1)


def _split(n: int, k: int, mode: str, tp: int) -> tuple[float, float]:
    if mode == "column":
        return n / tp, k
    if mode == "row":
        return n, k / tp
    return n, k


def step_model(model: ModelShape, plan: Plan, gpu: GPU, kernels: Kernels, tp: int = 1) -> StepModel:
    """The :class:`StepModel` of ``model`` quantized by ``plan`` (already resolved for ``gpu``) on ``tp`` GPUs."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not gpu.has_lane(plan.lane):
        raise ValueError(f"{gpu.name} has no {plan.lane} lane; resolve the plan with resolve_plan() first")
    bw = gpu.achieved_bandwidth
    bf16 = gpu.achieved_flops("bf16")
    if plan.weight_only:
        flops = gpu.peak_tflops["bf16"] * 1e12 * kernels.weight_only_efficiency
        fixed = kernels.weight_only_linear_us * 1e-6
    else:
        flops = gpu.achieved_flops(plan.lane)
        fixed = kernels.activation_quant_us * 1e-6 if plan.activations is not None else 0.0
    dense, experts = [], []
    for lin in model.layer_linears():
        n, k = _split(lin.out_features, lin.in_features, lin.tp, tp)
        f = bf16 if lin.kind == "router" else flops
        coef = (2 * n * k / f, n * k * plan.weight_bits(lin) / 8 / bw, 0.0 if lin.kind == "router" else fixed)
        (experts if lin.kind == "expert" else dense).append(coef)
    lm = model.lm_head()
    heads = model.heads / tp
    kv_layer = 2 * max(model.kv_heads / tp, 1.0) * model.head_dim * plan.kv_bytes
    if tp > 1:
        link = gpu.interconnect_gbps * 1e9
        allreduce = (ALLREDUCE_LATENCY_S, 2 * (tp - 1) / tp * model.hidden * 2 / link)
    else:
        allreduce = (0.0, 0.0)
    return StepModel(
        layers=model.layers,
        linears=tuple(dense),
        experts=tuple(experts),
        n_experts=model.experts,
        top_k=model.experts_per_token,
        lm_head=(2 * lm.out_features / tp * lm.in_features / bf16, lm.params * 2 / tp / bw),
        attn_flop_s=4 * heads * model.head_dim / bf16,
        kv_read_s=kv_layer / bw,
        allreduce_s=allreduce,
        step_s=gpu.step_overhead_ms * 1e-3,
        seq_s=gpu.seq_overhead_us * 1e-6,
        layer_s=kernels.layer_overhead_us * 1e-6,
    )
