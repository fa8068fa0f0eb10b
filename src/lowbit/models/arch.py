"""Facts about model architectures, as data.

Each entry says where the decoder layers live, what the attention and MLP linears are
called, which norm feeds which linears (the balancing groups SmoothQuant and AWQ fold
scales into), whether keys are normalised per head (QK-norm), and whether every sequence
must start with BOS.  Code looks facts up here; it never branches on a class name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Arch", "ARCHS", "arch_of", "decoder_layers", "linear_names", "Balance", "bos_required"]


@dataclass(frozen=True)
class Balance:
    """A scale can move from ``prev`` (a norm or linear) into the linears ``next``, which
    all read ``prev``'s output.  Names are relative to a decoder layer."""

    prev: str
    next: tuple[str, ...]


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


#: keyed by ``config.model_type``
ARCHS: dict[str, Arch] = {
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(qk_norm=True),
    "gemma3_text": _llama_like(qk_norm=True, needs_bos=True, post_norm="pre_feedforward_layernorm", norm_offset=1.0),
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
