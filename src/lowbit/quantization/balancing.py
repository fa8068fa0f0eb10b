"""SmoothQuant and AWQ scales of one decoder layer, before its layer-by-layer pass
(:mod:`lowbit.quantization.layerwise`): the layer runs as it is on its inputs, recording
each balancing group's input statistics, then each group's scale is folded into the layer
(:func:`lowbit.quantization.transforms.balance`, function-preserving).

Mixture-of-experts layers (:func:`lowbit.quantization.transforms.expert_balance_groups`):
the attention's groups as in a dense model, then per expert ``up_proj → down_proj``, from
the inputs of that expert's down_proj, i.e. from the tokens routed to it (all tokens when
``experts_see_all_tokens``).  The norm in front of the experts also feeds the router and
every other expert, so nothing is folded through it: the experts' gate/up get AWQ's
clipping only, from their own routed tokens.  An expert whose down_proj saw fewer than
``expert_min_tokens`` tokens gets no scale (``s = 1``; the layer pass then rounds it,
the same rule as GPTQ's); the count is logged per layer.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import algorithms as A
from .inputstats import InputStats
from .runtime import ActQuant, quantized_activations
from .transforms import balance, balance_groups

__all__ = ["balance_layer", "expert_sample_every", "experts_by_module", "moe_expert_count", "Stop", "stop"]

log = logging.getLogger(__name__)


class Stop(Exception):
    """Raised by a hook to end a forward pass early."""


def stop(module, args):
    raise Stop


def expert_sample_every(model: nn.Module, sample_every: int, n_experts: int, see_all: bool) -> int:
    """AWQ's token-sampling stride for an expert's inputs, so that each expert's sample is
    about as large as a dense Linear's: an expert sees ``top_k / n_experts`` of the tokens
    on average (all of them when every expert sees every token)."""
    if not sample_every or not n_experts or see_all:
        return sample_every
    top_k = getattr(model.config, "num_experts_per_tok", None) or 1
    return max(1, sample_every * top_k // n_experts)


#: AWQ on a dense layer runs the MLP on its sampled tokens only (a switch for the test that
#: this gives the scales running it on every token gives)
SAMPLE_MLP = True


def balance_layer(model, i, arch, layer, inputs, kwargs, modules, plan, leader, online, algo, sample_every,
                  prefix, expert_of=None, expert_every: int = 0) -> None:
    """SmoothQuant or AWQ for decoder layer ``i``: record its inputs' absmax (and AWQ's token
    sample) with the layer as it is, then move each balancing group's scales into the layer
    (function-preserving).  A dense layer stops at down_proj's input (the last Linear);
    a MoE layer runs whole (every expert's down_proj is needed).  For AWQ on a dense layer the
    MLP runs only on the tokens AWQ samples (it is per token, so those tokens' inputs are what
    running it on all of them gives; ``SAMPLE_MLP``).  The statistics are discarded: the
    layer's pass that follows records them again on the balanced layer.

    ``expert_of``: MoE expert Linear → ``(experts module, index)``; ``expert_every``: the
    sampling stride of expert inputs (:func:`expert_sample_every`)."""
    expert_of = expert_of or {}
    groups = balance_groups(model, i, arch)
    # only the inputs some group balances: a MoE layer's expert gate/up inputs (one sample per
    # expert, hidden wide) would otherwise be held for nothing until the layer is done
    istats = {leader[names[0]]: InputStats() for _, _, _, names in groups if names[0] in leader}
    rot_only = {n: ActQuant(None, rotation=online[n]) for n in leader if n in online}

    # AWQ on a dense layer: everything from the MLP's input on is computed per token, and AWQ keeps
    # one token in `sample_every` of it, so the MLP runs on those tokens only (its Linears then keep all)
    mlp = f"{prefix}.{arch.down}".rsplit(".", 1)[0]
    sampled_mlp = (SAMPLE_MLP and arch.experts is None and algo.awq is not None and algo.smoothquant is None
                   and sample_every > 1 and "." in arch.down)

    sampled = {"now": False}  # whether the MLP running now got only the sampled tokens

    def sample_mlp_input(mod, args):
        sampled["now"] = bool(args) and isinstance(args[0], torch.Tensor)
        if sampled["now"]:
            return (args[0].reshape(-1, args[0].shape[-1])[::sample_every],) + tuple(args[1:])
        return None

    def hook_for(n):
        every = expert_every if n in expert_of else sample_every
        in_mlp = sampled_mlp and n.startswith(mlp + ".")

        def hook(mod, args):
            istats[n].add(args[0], absmax=algo.smoothquant is not None,
                          sample_every=(1 if in_mlp and sampled["now"] else every) if algo.awq is not None else 0)
        return hook

    with quantized_activations(model, rot_only):
        handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in istats]
        if sampled_mlp:
            handles.append(layer.get_submodule(mlp[len(prefix) + 1:]).register_forward_pre_hook(sample_mlp_input))
        if arch.experts is None:
            # down_proj is the last Linear to run: once its input is recorded, the rest of the
            # layer's work would be thrown away
            handles.append(modules[f"{prefix}.{arch.down}"].register_forward_pre_hook(stop))
        try:
            for h in inputs:
                try:
                    layer(h, **kwargs)
                except Stop:
                    pass
        finally:
            for hd in handles:
                hd.remove()
    few: dict[str, list[int]] = {}
    for prev, prev_name, nexts, next_names in groups:
        quantized = [n for n in next_names if n in plan and plan[n][0] is not None]
        if not quantized:
            continue
        st = istats[leader[next_names[0]]]
        if next_names[0] in expert_of and st.tokens < algo.expert_min_tokens:
            mname, e = expert_of[next_names[0]]
            few.setdefault(mname, []).append(e)
            continue
        ws = [m.weight.detach().float() for m in nexts]
        if algo.smoothquant is not None:
            if not any(plan.get(n, (None, None))[1] is not None for n in next_names):
                continue  # SmoothQuant helps activation quantization only
            s = A.smoothquant_scales(st.absmax, ws, algo.smoothquant.alpha)
        else:
            s, _ = A.awq_scales(st.x, ws, plan[quantized[0]][0], grid=algo.awq.grid,
                                duo_scaling=algo.awq.duo_scaling)
        off = arch.norm_offset if not isinstance(prev, nn.Linear) else 0.0
        balance(prev, nexts, s, norm_offset=off)
    method = "SmoothQuant" if algo.smoothquant is not None else "AWQ"
    experts = experts_by_module(expert_of) if few else {}
    for mname, rounded in few.items():
        log.warning("%s: %d of %d experts in layer %d saw < %d tokens: no scales (s = 1) for experts %s",
                    method, len(rounded), len(experts[mname]), i, algo.expert_min_tokens, sorted(rounded))


def experts_by_module(expert_of: dict[str, tuple[str, int]]) -> dict[str, set[int]]:
    """MoE experts module → the indices of its experts (empty for a dense model)."""
    per: dict[str, set[int]] = {}
    for m, e in expert_of.values():
        per.setdefault(m, set()).add(e)
    return per


def moe_expert_count(expert_of: dict[str, tuple[str, int]]) -> int:
    """The most experts any one MoE layer has (0 for a dense model)."""
    return max((len(v) for v in experts_by_module(expert_of).values()), default=0)

