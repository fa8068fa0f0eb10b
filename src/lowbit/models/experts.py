"""Mixture-of-experts layers as per-expert ``nn.Linear`` modules.

transformers 5 holds each MoE layer's routed experts as one module with two 3-D
parameters, ``gate_up_proj`` ``(E, 2·I, H)`` (gate rows first, then up) and ``down_proj``
``(E, H, I)``; older checkpoints (and vLLM's loaders) name each expert's Linears
``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``.  :func:`unfuse_experts` replaces a
fused module by :class:`ExpertLinears`, which holds the same numbers as per-expert Linears
with those names (``model.layers.3.mlp.experts.5.down_proj``) and computes the same
function, so that everything that works on Linears — recipes' globs, plain rounding, the
layer-by-layer pass's per-Linear statistics (each expert sees exactly the tokens routed to
it), input quantization, export by name — works on experts unchanged.

Every expert's Linears are called on every forward, with zero rows when no token is routed
to the expert: hooks then see every expert in the same order for every batch (the
layer-by-layer pass runs calibration chunks in lockstep) and count an expert's tokens as
what it really received.  ``see_all_tokens`` (a calibration-only switch, see
:func:`all_tokens_to_every_expert`) runs every expert on every token and keeps only the
routed rows, so that statistics cover all experts whatever the router picks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["ExpertLinears", "unfuse_experts", "expert_modules", "all_tokens_to_every_expert", "is_moe", "expert_units"]


class _Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, act_fn, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertLinears(nn.ModuleList):
    """The routed experts of one MoE layer as per-expert Linears, called like transformers'
    fused experts module: ``forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``.

    ``see_all_tokens``: every expert runs on every token (statistics of all experts); the
    output still adds each token's routed experts only, so the layer's function is unchanged.
    """

    def __init__(self, experts: list[_Expert]) -> None:
        super().__init__(experts)
        self.see_all_tokens = False

    @classmethod
    def from_fused(cls, fused: nn.Module) -> "ExpertLinears":
        """The experts of transformers' fused module ``fused`` (its numbers copied)."""
        gate_up, down = fused.gate_up_proj.detach(), fused.down_proj.detach()  # (E, 2I, H), (E, H, I)
        n, two_i, hidden = gate_up.shape
        inter = two_i // 2
        out = []
        for e in range(n):
            ex = _Expert(hidden, inter, fused.act_fn, gate_up.dtype, gate_up.device)
            with torch.no_grad():
                ex.gate_proj.weight.copy_(gate_up[e, :inter])
                ex.up_proj.weight.copy_(gate_up[e, inter:])
                ex.down_proj.weight.copy_(down[e])
            ex.requires_grad_(fused.gate_up_proj.requires_grad)
            out.append(ex)
        mod = cls(out)
        mod.train(fused.training)
        return mod

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)                                    # (T, H)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)                          # routed (token, k-slot) pairs
            if self.see_all_tokens:
                y = expert(hidden_states)[token]
            else:
                y = expert(hidden_states[token])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has routed experts (fused or per-expert)."""
    return any(_is_fused(m) or isinstance(m, ExpertLinears) for m in model.modules())


def _is_fused(m: nn.Module) -> bool:
    gu, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(d, nn.Parameter) and gu.dim() == 3 and d.dim() == 3


@torch.no_grad()
def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` by its :class:`ExpertLinears`, in place;
    returns how many were replaced (0 when there are none, or they are already per expert).

    The model computes the same function afterwards (the same numbers, the same matmuls per
    expert); its state dict then names each expert's weights
    ``…experts.<e>.{gate,up,down}_proj.weight``.
    """
    fused = [(n, m) for n, m in model.named_modules() if _is_fused(m)]
    for name, m in fused:
        if getattr(m, "has_bias", False) or not getattr(m, "has_gate", True) or getattr(m, "is_transposed", False):
            raise ValueError(f"{name}: fused experts with biases, without a gate or transposed are not supported")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, ExpertLinears.from_fused(m))
    return len(fused)


def expert_modules(model: nn.Module) -> dict[str, ExpertLinears]:
    """Every :class:`ExpertLinears` of ``model`` by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertLinears)}


def expert_units(model: nn.Module) -> list[str]:
    """Every routed expert of ``model`` by the module name it has once unfused
    (``model.layers.3.mlp.experts.5``), whether the experts are fused now or not; in layer
    order, then expert order.  Empty for a dense model."""
    out = []
    for n, m in model.named_modules():
        count = len(m) if isinstance(m, ExpertLinears) else m.gate_up_proj.shape[0] if _is_fused(m) else 0
        out += [f"{n}.{e}" for e in range(count)]
    return out


@contextmanager
def all_tokens_to_every_expert(model: nn.Module) -> Iterator[None]:
    """While the block runs, every expert of ``model`` computes on every token (for
    calibration statistics); the outputs are unchanged.  Restored on exit, also on error."""
    mods = list(expert_modules(model).values())
    before = [m.see_all_tokens for m in mods]
    try:
        for m in mods:
            m.see_all_tokens = True
        yield
    finally:
        for m, b in zip(mods, before):
            m.see_all_tokens = b
