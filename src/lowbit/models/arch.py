"""Facts about model architectures, as data.

Each entry says where the decoder layers live, what the attention and MLP linears are
called, which norm feeds which linears (the balancing groups SmoothQuant and AWQ fold
scales into), whether keys are normalised per head (QK-norm), and whether every sequence
must start with BOS.  Code looks facts up here; it never branches on a class name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

__all__ = ["Arch", "ARCHS", "arch_of", "decoder_layers", "submodule", "linear_names", "Balance", "bos_required", "Experts",
           "expert_groups", "checkpoint_name", "lowbit_name"]


@dataclass(frozen=True)
class Balance:
    """A scale can move from ``prev`` (a norm or linear) into the linears ``next``, which
    all read ``prev``'s output.  Names are relative to a decoder layer."""

    prev: str
    next: tuple[str, ...]


@dataclass(frozen=True)
class Experts:
    """The routed experts of a mixture-of-experts layer (names relative to a decoder layer).

    ``path``: the experts module (transformers 5 holds it fused; lowbit runs it as per-expert
    Linears ``<path>.<e>.<gate|up|down>``, :mod:`lowbit.models.experts`); ``router``: the module
    whose weight scores the experts (kept in high precision); ``shared``: a shared expert's
    module, if any — a dense MLP every token goes through, its gate/up/down Linears named
    like a routed expert's and quantized like a dense MLP's (its gate and up fused
    siblings, its up → down a balancing group); ``shared_gate``: the Linear that scales
    the shared expert's output per token (Qwen2-MoE's ``sigmoid(shared_expert_gate(x))``),
    kept in high precision like the router (``DEFAULT_IGNORE``).  ``checkpoint``: the names the model's
    checkpoints and vLLM's loader use instead, if they differ (Mixtral:
    ``block_sparse_moe.experts.<e>.w1/w3/w2`` and ``block_sparse_moe.gate``).
    """

    path: str
    router: str
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str | None = None
    shared_gate: str | None = None
    #: (experts path, router, (gate, up, down)) as checkpoints name them, when not as lowbit does
    checkpoint: tuple[str, str, tuple[str, str, str]] | None = None


@dataclass(frozen=True)
class Arch:
    layers: str  # attribute path from the CausalLM to the ModuleList of decoder layers
    attn: str  # attention module, relative to a decoder layer
    q: str
    k: str
    v: str
    o: str
    gate: str | None
    up: str
    down: str
    balances: tuple[Balance, ...]
    qk_norm: bool
    needs_bos: bool
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): Gemma uses 1 + weight
    experts: Experts | None = None  # a mixture of experts: gate/up/down are then globs over the experts


def _llama_like(
    qk_norm: bool = False, needs_bos: bool = False, post_norm: str = "post_attention_layernorm", norm_offset: float = 0.0
) -> Arch:
    return Arch(
        layers="model.layers",
        attn="self_attn",
        q="self_attn.q_proj",
        k="self_attn.k_proj",
        v="self_attn.v_proj",
        o="self_attn.o_proj",
        gate="mlp.gate_proj",
        up="mlp.up_proj",
        down="mlp.down_proj",
        balances=(
            Balance("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            Balance("self_attn.v_proj", ("self_attn.o_proj",)),
            Balance(post_norm, ("mlp.gate_proj", "mlp.up_proj")),
            Balance("mlp.up_proj", ("mlp.down_proj",)),
        ),
        qk_norm=qk_norm,
        needs_bos=needs_bos,
        norm_offset=norm_offset,
    )


def _moe(experts: Experts, qk_norm: bool = False) -> Arch:
    """A Llama-like attention with routed experts in place of the MLP; the expert Linears
    that read one input (each expert's gate and up) are listed by :func:`expert_groups`."""
    e = experts
    dense = _llama_like(qk_norm=qk_norm)
    return dataclasses.replace(
        dense,
        gate=f"{e.path}.*.{e.gate}",
        up=f"{e.path}.*.{e.up}",
        down=f"{e.path}.*.{e.down}",
        balances=dense.balances[:2],  # the attention's; the MLP's norm also feeds the router
        experts=experts,
    )


#: keyed by ``config.model_type``
ARCHS: dict[str, Arch] = {
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(qk_norm=True),
    "gemma3_text": _llama_like(qk_norm=True, needs_bos=True, post_norm="pre_feedforward_layernorm", norm_offset=1.0),
    # Qwen3-MoE checkpoints and vLLM name experts as lowbit does
    "qwen3_moe": _moe(Experts(path="mlp.experts", router="mlp.gate"), qk_norm=True),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): a shared expert beside the routed ones, its output gated per token
    "qwen2_moe": _moe(Experts(path="mlp.experts", router="mlp.gate", shared="mlp.shared_expert",
                              shared_gate="mlp.shared_expert_gate")),
    # Mixtral's checkpoints (and vLLM's loader) say block_sparse_moe and w1 (gate), w3 (up), w2 (down)
    "mixtral": _moe(Experts(path="mlp.experts", router="mlp.gate",
                            checkpoint=("block_sparse_moe.experts", "block_sparse_moe.gate", ("w1", "w3", "w2")))),
}


def arch_of(model: nn.Module) -> Arch:
    """The :class:`Arch` of a transformers CausalLM, or a clear error."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in ARCHS:
        raise ValueError(
            f"unsupported architecture {mt!r}: lowbit knows {', '.join(sorted(ARCHS))}. "
            "Adding one is a new entry in lowbit/models.py:ARCHS."
        )
    return ARCHS[mt]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    obj = model
    for part in arch_of(model).layers.split("."):
        obj = getattr(obj, part)
    return obj


def expert_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Per expert of every MoE layer, its Linears that read one input and that runtimes fuse
    (gate and up), as full module names — the routed experts in order, then a shared
    expert's; empty for a dense model."""
    arch = arch_of(model)
    e = arch.experts
    if e is None:
        return []
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        experts = submodule(layer, e.path)
        if experts is None:  # a dense layer of a MoE model (Qwen3-MoE's mlp_only_layers)
            continue
        for k in range(len(experts) if isinstance(experts, nn.ModuleList) else 0):
            out.append(tuple(f"{arch.layers}.{i}.{e.path}.{k}.{n}" for n in (e.gate, e.up)))
        if e.shared is not None and submodule(layer, f"{e.shared}.{e.gate}") is not None:
            out.append(tuple(f"{arch.layers}.{i}.{e.shared}.{n}" for n in (e.gate, e.up)))
    return out


def submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module.get_submodule(path)``, or ``None`` where there is no such submodule."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def checkpoint_name(arch: Arch, name: str) -> str:
    """The name the model's checkpoints (and vLLM) use for lowbit's tensor or module ``name``
    (``model.layers.0.mlp.experts.3.gate_proj.weight`` → Mixtral's
    ``model.layers.0.block_sparse_moe.experts.3.w1.weight``); other names unchanged."""
    return _rename(arch, name, to_checkpoint=True)


def lowbit_name(arch: Arch, name: str) -> str:
    """Inverse of :func:`checkpoint_name`."""
    return _rename(arch, name, to_checkpoint=False)


def _rename(arch: Arch, name: str, to_checkpoint: bool) -> str:
    e = arch.experts
    if e is None or e.checkpoint is None:
        return name
    ours = (e.path, e.router, (e.gate, e.up, e.down))
    pairs = list(zip(ours, e.checkpoint)) if to_checkpoint else list(zip(e.checkpoint, ours))
    (src_path, dst_path), (src_router, dst_router), (src_lin, dst_lin) = pairs
    head = arch.layers + "."
    if not name.startswith(head):
        return name
    layer, _, rest = name[len(head):].partition(".")
    if rest == src_router or rest.startswith(src_router + "."):
        return f"{head}{layer}.{dst_router}{rest[len(src_router):]}"
    if rest.startswith(src_path + "."):
        k, _, tail = rest[len(src_path) + 1:].partition(".")
        lin, dot, leaf = tail.partition(".")
        if lin in src_lin:
            lin = dst_lin[src_lin.index(lin)]
        return f"{head}{layer}.{dst_path}.{k}.{lin}{dot}{leaf}"
    return name


def linear_names(model: nn.Module) -> list[str]:
    """Names of every ``nn.Linear`` in ``model``, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# model_type → trained with a BOS at the start of every sequence. Also the supported list.
_BOS_BY_MODEL_TYPE = {
    "llama": False, "mistral": False, "mixtral": False, "qwen2": False, "qwen2_moe": False,
    "qwen3": False, "qwen3_moe": False, "gemma": True, "gemma2": True, "gemma3_text": True,
}


def bos_required(model_type: str, tokenizer) -> bool:
    """From the architecture table, or when the tokenizer itself prepends BOS (Llama 3 does)."""
    if model_type not in _BOS_BY_MODEL_TYPE:
        raise ValueError(f"unsupported architecture {model_type!r}; supported model types: "
                         f"{', '.join(_BOS_BY_MODEL_TYPE)}")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return _BOS_BY_MODEL_TYPE[model_type] or adds_bos
