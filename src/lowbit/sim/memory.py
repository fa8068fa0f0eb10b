"""What fits: weight bytes, KV bytes per token, KV capacity, and the decode-speed bound.

Weight bytes come from :func:`lowbit.numerics.scheme.bits_per_element` at each linear's real
shape (through :meth:`Plan.weight_bits`).  With tensor parallelism ``tp`` the linears and
KV heads are split over ``tp`` GPUs; embeddings are split too (vocab-parallel).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .hardware import GPU
from .plans import Plan
from .shapes import ModelShape

__all__ = ["MemoryReport", "weight_bytes", "kv_bytes_per_token", "memory_report"]

#: GB memory the engine keeps for activations, CUDA graphs and the runtime
#: (AIConfigurator's ``other_mem``: 3.5 GB; research/anchors_sim.md §1.8)
DEFAULT_RESERVED_GB = 3.5


def weight_bytes(model: ModelShape, plan: Plan) -> dict[str, float]:
    """Bytes of the weights by kind (embedding, lm_head, attention, mlp, expert, router)."""
    out = {"embedding": model.vocab * model.hidden * 2.0, "lm_head": 0.0,
           "attention": 0.0, "mlp": 0.0, "expert": 0.0, "router": 0.0}
    if not model.tied_embeddings:
        lin = model.lm_head()
        out["lm_head"] = lin.params * plan.weight_bits(lin) / 8
    for lin in model.layer_linears():
        n = model.experts if lin.kind == "expert" else 1
        out[lin.kind] += model.layers * n * lin.params * plan.weight_bits(lin) / 8
    return out


def kv_bytes_per_token(model: ModelShape, plan: Plan, tp: int = 1) -> float:
    """KV-cache bytes one token takes on one GPU: 2 · layers · kv_heads/tp · head_dim · kv_bytes.

    KV heads are replicated when ``tp`` exceeds their number (vLLM does the same).
    """
    heads_per_gpu = max(model.kv_heads / tp, 1.0)
    return 2 * model.layers * heads_per_gpu * model.head_dim * plan.kv_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Memory and decode-speed bound of one (model, plan, GPU, tp).  Bytes are per GPU unless named total.

    Attributes:
        weights_total: bytes of all weights.
        weights_by_kind: bytes by kind (embedding, lm_head, attention, mlp, expert, router).
        weights_per_gpu: ``weights_total / tp``.
        kv_per_token: KV bytes per token per GPU.
        kv_per_token_total: KV bytes per token, all GPUs.
        kv_capacity_tokens: tokens of KV that fit (``gpu_memory_utilization`` of memory, less
            weights and the reserve); 0 when the weights do not fit.
        context: the conversation length asked about.
        conversation_bytes: KV bytes of one conversation of ``context`` tokens (all GPUs).
        conversations: how many such conversations fit at once.
        decode_bytes_per_token: bytes read per generated token at batch 1 (active weights + KV of context), per GPU.
        decode_ms_bound: that ÷ achieved bandwidth — the single-user speed limit per token.
        decode_ms_peak: that ÷ peak bandwidth.
        fits: the weights fit.
    """

    model: str
    plan: str
    gpu: str
    tp: int
    weights_total: float
    weights_by_kind: dict
    weights_per_gpu: float
    kv_per_token: float
    kv_per_token_total: float
    kv_capacity_tokens: int
    context: int
    conversation_bytes: float
    conversations: int
    decode_bytes_per_token: float
    decode_ms_bound: float
    decode_ms_peak: float
    fits: bool

    def to_dict(self) -> dict:
        return asdict(self)


def active_weight_bytes(model: ModelShape, plan: Plan) -> float:
    """Bytes of weights one decode step at batch 1 reads: all but the embedding; top-k experts only."""
    w = weight_bytes(model, plan)
    active = sum(v for k, v in w.items() if k not in ("embedding", "expert"))
    if model.is_moe:
        active += w["expert"] * model.experts_per_token / model.experts
    if model.tied_embeddings:
        active += w["embedding"]  # the tied matrix is read as lm_head
    return active


def memory_report(
    model: ModelShape,
    plan: Plan,
    gpu: GPU,
    tp: int = 1,
    context: int = 8000,
    gpu_memory_utilization: float = 0.9,
    reserved_gb: float = DEFAULT_RESERVED_GB,
) -> MemoryReport:
    """Sizes, KV capacity, conversations of ``context`` tokens that fit, and the decode bound."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    by_kind = weight_bytes(model, plan)
    total = sum(by_kind.values())
    per_gpu = total / tp
    kv_tok = kv_bytes_per_token(model, plan, tp)
    free = gpu.memory_gib * 2**30 * gpu_memory_utilization - per_gpu - reserved_gb * 1e9
    capacity = max(int(free // kv_tok), 0)
    decode_bytes = active_weight_bytes(model, plan) / tp + kv_tok * context
    return MemoryReport(
        model=model.name, plan=plan.name, gpu=gpu.key, tp=tp,
        weights_total=total, weights_by_kind=by_kind, weights_per_gpu=per_gpu,
        kv_per_token=kv_tok, kv_per_token_total=kv_tok * tp, kv_capacity_tokens=capacity,
        context=context, conversation_bytes=kv_tok * tp * context,
        conversations=capacity // context,
        decode_bytes_per_token=decode_bytes,
        decode_ms_bound=decode_bytes / gpu.achieved_bandwidth * 1e3,
        decode_ms_peak=decode_bytes / (gpu.bandwidth_tbps * 1e12) * 1e3,
        fits=free > 0,
    )


def blocks_for(tokens, block_size: int):
    """KV blocks that hold ``tokens`` (an int or an integer array): ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)
