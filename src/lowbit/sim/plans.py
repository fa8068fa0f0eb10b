"""Quantization plans for capacity planning, as data.

A plan says which lowbit scheme the decoder linears' weights use (sizes come from
:func:`lowbit.numerics.scheme.bits_per_element` at each linear's real shape), which scheme their
inputs use, which math lane the matmuls run on, and the KV-cache element width.
lm_head, embeddings and MoE routers stay BF16 (vLLM cannot load a quantized lm_head).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from ..numerics.scheme import PRESETS, bits_per_element, get_scheme
from .hardware import GPU, LANES
from .shapes import Linear

__all__ = ["Plan", "PLANS", "KV_BYTES", "parse_plan", "resolve_plan"]


@dataclass(frozen=True)
class Plan:
    """How a model is quantized, for sizing and timing.

    Attributes:
        name: ``bf16``, ``fp8``, ``w4a16``, ... with ``+kv-fp8`` when the KV cache is FP8.
        weights: preset name of the decoder-linear weight scheme, or ``None`` for BF16.
        activations: preset name of the (dynamic) input scheme, or ``None`` (weight-only / BF16).
        lane: the math lane of the decoder linears: ``bf16``, ``fp8``, ``int8`` or ``fp4``.
        kv_bytes: bytes per KV-cache element (2 for BF16, 1 for FP8).
    """

    name: str
    weights: str | None
    activations: str | None
    lane: str
    kv_bytes: float = 2.0

    def __post_init__(self) -> None:
        for role in ("weights", "activations"):
            v = getattr(self, role)
            if v is not None and v not in PRESETS:
                raise ValueError(f"plan {self.name!r}: {role} scheme {v!r} is not a preset ({', '.join(PRESETS)})")
        if self.lane not in LANES:
            raise ValueError(f"plan {self.name!r}: lane {self.lane!r} is not one of {LANES}")
        if self.lane != "bf16" and self.activations is None:
            raise ValueError(f"plan {self.name!r}: lane {self.lane!r} needs quantized activations")
        if self.kv_bytes not in (1.0, 2.0):
            raise ValueError(f"plan {self.name!r}: kv_bytes must be 1 or 2, got {self.kv_bytes}")

    @property
    def weight_only(self) -> bool:
        """Quantized weights, BF16 activations: a dequantizing (Marlin-class) kernel on the BF16 lane."""
        return self.weights is not None and self.activations is None

    def weight_bits(self, lin: Linear) -> float:
        """Storage bits per weight element of ``lin``, scales included."""
        if lin.kind in ("lm_head", "router") or self.weights is None:
            return 16.0
        return bits_per_element(get_scheme(self.weights), (lin.out_features, lin.in_features))

    def to_dict(self) -> dict:
        return {"name": self.name, "weights": self.weights, "activations": self.activations,
                "lane": self.lane, "kv_bytes": self.kv_bytes, "weight_only": self.weight_only}


#: the plans lowbit knows, by name (append ``+kv-fp8`` for an FP8 KV cache)
PLANS: dict[str, Plan] = {
    "bf16": Plan("bf16", None, None, "bf16"),
    "fp8": Plan("fp8", "fp8-channel", "fp8-token", "fp8"),
    "fp8-block": Plan("fp8-block", "fp8-block", "fp8-group128", "fp8"),
    "w4a16": Plan("w4a16", "int4-g128", None, "bf16"),
    "w8a8-int8": Plan("w8a8-int8", "int8-channel", "int8-token", "int8"),
    "nvfp4": Plan("nvfp4", "nvfp4", "nvfp4", "fp4"),
    "mxfp4": Plan("mxfp4", "mxfp4", "mxfp4", "fp4"),
}

#: bytes per KV element by suffix
KV_BYTES = {"kv-fp8": 1.0, "kv-bf16": 2.0}


def parse_plan(text: str) -> Plan:
    """``fp8+kv-fp8`` → the ``fp8`` plan with a 1-byte KV cache."""
    base, *suffixes = text.strip().lower().split("+")
    if base not in PLANS:
        raise ValueError(f"unknown quantization plan {base!r}; known: {', '.join(PLANS)} (suffix: +kv-fp8)")
    plan = PLANS[base]
    for s in suffixes:
        if s not in KV_BYTES:
            raise ValueError(f"unknown plan suffix {s!r} in {text!r}; known: {', '.join(KV_BYTES)}")
        plan = replace(plan, name=text.strip().lower(), kv_bytes=KV_BYTES[s])
    return plan


def resolve_plan(plan: Plan, gpu: GPU) -> Plan:
    """The plan as ``gpu`` runs it: a lane the GPU lacks falls back to weight-only on BF16.

    vLLM does this too (FP8 on A100 and NVFP4 on Hopper run as W8A16 / W4A16 Marlin).
    Warns when it happens.
    """
    if gpu.has_lane(plan.lane):
        return plan
    warnings.warn(
        f"{gpu.name} has no {plan.lane} tensor cores: plan {plan.name!r} runs weight-only on the BF16 lane",
        stacklevel=2,
    )
    return replace(plan, activations=None, lane="bf16")
