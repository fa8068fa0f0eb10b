"""Model shapes as data: the linears of a decoder, their real (out, in) shapes, KV geometry.

A :class:`ModelShape` comes from an HF ``config.json`` (a file, a folder or a dict) or from
the built-in table :data:`MODELS` of well-known models.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Linear", "ModelShape", "MODELS", "get_model", "shape_from_config"]


@dataclass(frozen=True)
class Linear:
    """One linear of a decoder layer (or the lm_head).

    Attributes:
        name: ``qkv``, ``o``, ``gate_up``, ``down``, ``router``, ``expert_gate_up``, ...
        out_features, in_features: the real weight shape (out, in).
        kind: ``attention``, ``mlp``, ``expert``, ``router`` or ``lm_head``.
        tp: how tensor parallelism splits it: ``column`` (out), ``row`` (in) or ``none``.
    """

    name: str
    out_features: int
    in_features: int
    kind: str
    tp: str

    @property
    def params(self) -> int:
        return self.out_features * self.in_features


@dataclass(frozen=True)
class ModelShape:
    """The facts about a decoder model that decide its memory and speed.

    Attributes:
        name: a label.
        layers, hidden, heads, kv_heads, head_dim, intermediate, vocab: as in HF configs.
        tied_embeddings: the lm_head shares the embedding matrix (stored once).
        experts: routed experts per layer (0 for a dense model).
        experts_per_token: experts each token visits.
        expert_intermediate: intermediate size of one expert.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.experts:
            if not 0 < self.experts_per_token <= self.experts or self.expert_intermediate <= 0:
                raise ValueError(
                    f"model {self.name!r}: a MoE needs 0 < experts_per_token <= experts and expert_intermediate > 0, "
                    f"got {self.experts_per_token}, {self.experts}, {self.expert_intermediate}"
                )
        elif self.intermediate <= 0:
            raise ValueError(f"model {self.name!r}: intermediate must be positive for a dense model")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def layer_linears(self) -> tuple[Linear, ...]:
        """The linears of one decoder layer, fused the way vLLM runs them (qkv, gate_up)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = (
            Linear("qkv", q + 2 * kv, self.hidden, "attention", "column"),
            Linear("o", self.hidden, q, "attention", "row"),
        )
        if not self.is_moe:
            return attn + (
                Linear("gate_up", 2 * self.intermediate, self.hidden, "mlp", "column"),
                Linear("down", self.hidden, self.intermediate, "mlp", "row"),
            )
        return attn + (
            Linear("router", self.experts, self.hidden, "router", "none"),
            Linear("expert_gate_up", 2 * self.expert_intermediate, self.hidden, "expert", "column"),
            Linear("expert_down", self.hidden, self.expert_intermediate, "expert", "row"),
        )

    def lm_head(self) -> Linear:
        return Linear("lm_head", self.vocab, self.hidden, "lm_head", "column")

    def params_by_kind(self) -> dict[str, int]:
        """Parameter counts by kind: embedding, lm_head (0 when tied), attention, mlp, experts, router."""
        out = {"embedding": self.vocab * self.hidden, "lm_head": 0 if self.tied_embeddings else self.vocab * self.hidden,
               "attention": 0, "mlp": 0, "expert": 0, "router": 0}
        for lin in self.layer_linears():
            n = lin.params * (self.experts if lin.kind == "expert" else 1)
            out[lin.kind] += n * self.layers
        return out

    @property
    def params(self) -> int:
        return sum(self.params_by_kind().values())

    def kv_elements_per_token(self) -> int:
        """K and V elements one token adds to the cache, all layers: 2 · layers · kv_heads · head_dim."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"params_by_kind": self.params_by_kind()}


#: well-known models (figures from each model's HF config.json)
MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False),
    "qwen2-7b": ModelShape("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, False),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, False),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True),
    "gemma-3-270m": ModelShape("gemma-3-270m", 18, 640, 4, 1, 256, 2048, 262144, True),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, False,
                                experts=128, experts_per_token=8, expert_intermediate=768),
}


def get_model(name: str) -> ModelShape:
    """A built-in model by name, or a shape read from a config.json path / folder."""
    key = name.lower()
    if key in MODELS:
        return MODELS[key]
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return shape_from_config(json.loads(p.read_text()), name=p.parent.name or str(p))
    raise ValueError(f"unknown model {name!r}: not a built-in ({', '.join(MODELS)}) nor a config.json path")


def _req(cfg: dict, key: str, name: str):
    if key not in cfg:
        raise ValueError(f"{name}: config.json has no {key!r}")
    return cfg[key]


#: transformers' default ``tie_word_embeddings`` per ``model_type`` (the keyword default of each
#: config class's ``__init__``); a model type not listed gets ``PretrainedConfig``'s default, True.
TIE_DEFAULTS = {
    "llama": False, "mistral": False, "mixtral": False, "qwen2": False, "qwen2_moe": False,
    "qwen3": False, "qwen3_moe": False, "phi3": False, "deepseek_v3": False,
    "gemma": True, "gemma2": True, "gemma3": True, "gemma3_text": True, "gpt2": True,
}


def _tied(cfg: dict, outer: dict, name: str) -> bool:
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    if "tie_word_embeddings" in outer:
        return bool(outer["tie_word_embeddings"])
    model_type = cfg.get("model_type") or outer.get("model_type")
    if model_type in TIE_DEFAULTS:
        return TIE_DEFAULTS[model_type]
    warnings.warn(
        f"{name}: config.json has no tie_word_embeddings and model_type {model_type!r} has no known default; "
        "assuming True (transformers' PretrainedConfig default) -- the lm_head is then not counted separately",
        stacklevel=3,
    )
    return True


def shape_from_config(cfg: dict, name: str = "config") -> ModelShape:
    """A :class:`ModelShape` from an HF ``config.json`` mapping (multimodal: its ``text_config``).

    A missing ``tie_word_embeddings`` takes transformers' default for the ``model_type``
    (:data:`TIE_DEFAULTS`), or ``PretrainedConfig``'s True with a warning for an unknown type.
    """
    outer = cfg
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    hidden = int(_req(cfg, "hidden_size", name))
    heads = int(_req(cfg, "num_attention_heads", name))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    return ModelShape(
        name=name,
        layers=int(_req(cfg, "num_hidden_layers", name)),
        hidden=hidden,
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate=int(cfg.get("intermediate_size") or 0),
        vocab=int(_req(cfg, "vocab_size", name)),
        tied_embeddings=_tied(cfg, outer, name),
        experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        # Mixtral's experts are intermediate_size wide (its configs have no moe_intermediate_size)
        expert_intermediate=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0,
    )
