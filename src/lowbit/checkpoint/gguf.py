"""GGUF out: a quantized model as one ``.gguf`` file that llama.cpp runs.

Tensor names, metadata keys and the tokenizer follow llama.cpp's conventions (its
``convert_hf_to_gguf.py`` and ``gguf`` package constants): ``token_embd``, ``blk.N.attn_q``,
..., ``output_norm``; ``<arch>.*`` hyperparameters; the vocabulary under ``tokenizer.ggml.*``
(:mod:`lowbit.checkpoint.gguf_vocab`).  Per architecture (:data:`GGUF_ARCHS`):

- ``llama`` (SmolLM2): llama.cpp's Llama graph expects the rows of ``attn_q`` / ``attn_k`` in
  an interleaved RoPE order, so those rows are permuted (per head, the two rotary halves
  interleaved) — rows are whole blocks, so the packed bytes are permuted row for row.
- ``qwen2`` / ``qwen3``: rotary halves as in Hugging Face (llama.cpp's NEOX RoPE), no permutation;
  Qwen2's q/k/v biases as ``attn_q.bias`` ...; Qwen3's QK-norms as ``attn_q_norm`` / ``attn_k_norm``.
- ``gemma3`` (``gemma3_text``): four norms per layer (``attn_norm``, ``post_attention_norm``,
  ``ffn_norm`` — Hugging Face's ``pre_feedforward_layernorm`` —, ``post_ffw_norm``) and QK-norms.
  Gemma's RMSNorm multiplies by ``1 + w`` where llama.cpp multiplies by the stored weight, so every
  norm weight is stored as ``1 + w`` (fp32, exactly what transformers computes); sliding-window
  layers, their window and RoPE base (``rope.freq_base_swa``) are written per layer.

Quantized weights are packed from their :class:`~lowbit.numerics.qtensor.QTensor`
(:mod:`lowbit.numerics.ggml_pack`), so every weight decodes to exactly lowbit's fake-quantized
value; everything else is written as F32.  The file is written to a temporary name and
renamed when complete.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..numerics.ggml_pack import pack
from ..numerics.qtensor import QTensor
from ..util.io import refuse_existing
from .gguf_vocab import write_tokenizer

__all__ = ["write_gguf", "read_gguf_weights", "tensor_types", "hf_module_names", "gguf_tensor_name", "rope_row_order",
           "GGUF_ARCHS", "GGUFArch", "to_stored", "from_stored"]

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_COMMON = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_QK_NORM = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


@dataclass(frozen=True)
class GGUFArch:
    """How one Hugging Face ``model_type`` is written for llama.cpp."""

    name: str                                   # llama.cpp's architecture (general.architecture)
    layer: dict[str, str]                       # Hugging Face module under model.layers.N → GGUF name
    rope_interleave: bool = False               # permute attn_q / attn_k rows (llama.cpp's Llama RoPE)
    norm_offset: float = 0.0                    # stored norm weight = w + offset (Gemma: 1 + w)
    pre: str = "default"                        # byte-level BPE pre-tokenizer name


_LLAMA_FFN_NORM = {"post_attention_layernorm": "ffn_norm"}
#: model_type → how it is written
GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", {**_COMMON, **_LLAMA_FFN_NORM}, rope_interleave=True, pre="smollm"),
    "qwen2": GGUFArch("qwen2", {**_COMMON, **_LLAMA_FFN_NORM}, pre="qwen2"),
    "qwen3": GGUFArch("qwen3", {**_COMMON, **_LLAMA_FFN_NORM, **_QK_NORM}, pre="qwen2"),
    "gemma3_text": GGUFArch("gemma3", {**_COMMON, **_QK_NORM, "post_attention_layernorm": "post_attention_norm",
                                        "pre_feedforward_layernorm": "ffn_norm",
                                        "post_feedforward_layernorm": "post_ffw_norm"}, norm_offset=1.0),
}


def _arch(model_type: str) -> GGUFArch:
    a = GGUF_ARCHS.get(model_type)
    if a is None:
        raise NotImplementedError(f"GGUF export of {model_type!r} models is not implemented yet "
                                  f"(written: {', '.join(GGUF_ARCHS)})")
    return a


def gguf_tensor_name(name: str, model_type: str = "llama") -> str:
    """llama.cpp's name of a Hugging Face parameter (``model.layers.3.mlp.up_proj.weight``
    → ``blk.3.ffn_up.weight``)."""
    layer = _arch(model_type).layer
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    parts = module.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in layer:
        return f"blk.{int(parts[2])}.{layer['.'.join(parts[3:])]}.{leaf}"
    raise ValueError(f"no GGUF name for parameter {name!r} (a {model_type} parameter name was expected)")


def _is_norm(gguf_name: str) -> bool:
    return gguf_name.endswith("norm.weight")


def to_stored(gguf_name: str, t: torch.Tensor, model_type: str) -> torch.Tensor:
    """The fp32 values the file holds for the Hugging Face tensor ``t`` (Gemma's norms: ``1 + w``)."""
    off = _arch(model_type).norm_offset
    t = t.detach().to(torch.float32)
    return t + off if off and _is_norm(gguf_name) else t


def from_stored(gguf_name: str, t: torch.Tensor, model_type: str) -> torch.Tensor:
    """The inverse of :func:`to_stored` (Gemma's norms: ``s − 1``, which transformers turns back
    into ``1 + (s − 1)``: ``s`` itself whenever ``s ≥ 0.5``, else within one ulp)."""
    off = _arch(model_type).norm_offset
    return t - off if off and _is_norm(gguf_name) else t


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row order llama.cpp's Llama graph wants for ``q_proj`` / ``k_proj``: within each head,
    the first and second rotary halves interleaved (row ``i`` of the result is original row
    ``order[i]``)."""
    if rows % (2 * heads):
        raise ValueError(f"cannot interleave {rows} rows over {heads} heads")
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)


#: _hparams key → the GGUFWriter method writing it under ``<arch>.``
_HPARAM_KEYS = {"vocab_size": "add_vocab_size", "context_length": "add_context_length",
                "embedding_length": "add_embedding_length", "block_count": "add_block_count",
                "feed_forward_length": "add_feed_forward_length", "head_count": "add_head_count",
                "head_count_kv": "add_head_count_kv", "rope_freq_base": "add_rope_freq_base",
                "rms_eps": "add_layer_norm_rms_eps"}


def _rope(config) -> tuple[dict, dict | None]:
    """The RoPE parameters of the full-attention layers and (Gemma-3) of the sliding ones."""
    rope = getattr(config, "rope_parameters", None) or {}
    full, swa = rope.get("full_attention", rope), rope.get("sliding_attention")
    for r in (full, swa or {}):
        if r.get("rope_type", "default") != "default":
            raise NotImplementedError(f"GGUF export: RoPE scaling {r.get('rope_type')!r} is not written yet")
    return full, swa


def _hparams(config) -> dict[str, object]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full, _ = _rope(config)
    return {
        "context_length": int(config.max_position_embeddings), "embedding_length": int(config.hidden_size),
        "block_count": int(config.num_hidden_layers), "feed_forward_length": int(config.intermediate_size),
        "head_count": int(config.num_attention_heads), "head_count_kv": int(config.num_key_value_heads),
        "rope_freq_base": float(full.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        "rms_eps": float(config.rms_norm_eps), "head_dim": int(head_dim), "vocab_size": int(config.vocab_size),
    }


def _gemma3_hparams(w, config, hp) -> None:
    """What llama.cpp's Gemma-3 graph reads beyond the common keys; refuses what it would run differently."""
    if getattr(config, "query_pre_attn_scalar", hp["head_dim"]) != hp["head_dim"]:
        raise NotImplementedError("GGUF export: Gemma-3 with query_pre_attn_scalar != head_dim (llama.cpp scales "
                                  "queries by 1/sqrt(head_dim) except for its 27B type)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key, None):
            raise NotImplementedError(f"GGUF export: Gemma-3 with {key} is not written yet")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("GGUF export: bidirectional Gemma-3 (an embedding model) is not written")
    _, swa = _rope(config)
    types = list(getattr(config, "layer_types", None) or [])
    if types and "sliding_attention" in types:
        w.add_sliding_window(int(config.sliding_window))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        if swa is not None:
            w.add_rope_freq_base_swa(float(swa["rope_theta"]))


def _tensor_bytes(qt: QTensor) -> np.ndarray:
    t = qt.scheme.ggml_type
    v = qt.values().reshape(-1, qt.shape[-1])
    return pack(v, t, qt.scale, qt.zero, qt.super_scale, qt.super_min).numpy()


def _rope_heads(arch: GGUFArch, module: str, hp) -> int | None:
    """Heads over which the rows of ``module`` are interleaved (llama's q/k), else ``None``."""
    if not arch.rope_interleave:
        return None
    heads = {"attn_q": hp["head_count"], "attn_k": hp["head_count_kv"]}
    return heads.get(module.rpartition(".")[2])


def write_gguf(model: nn.Module, qtensors: dict[str, QTensor], out: Path, *, tokenizer_dir: Path, name: str,
               add_bos: bool, force: bool = False) -> Path:
    """Write ``model`` as the GGUF file ``out``.

    ``qtensors``: module name → QTensor of a GGUF scheme (``scheme.ggml``) for each quantized
    weight (``model.embed_tokens`` included when it is quantized); every other parameter is
    written as F32.  A tied ``lm_head`` is not written (llama.cpp then uses ``token_embd``).
    ``add_bos``: whether llama.cpp prepends BOS (lowbit's evaluation protocol for the model).

    Raises:
        NotImplementedError: an architecture, tokenizer or RoPE variant not written yet.
        ValueError: a quantized weight of a non-GGUF scheme.
    """
    import gguf

    config = model.config
    mt = config.model_type
    arch = _arch(mt)
    out = Path(out)
    refuse_existing(out, force)
    for mod, qt in qtensors.items():
        if not qt.scheme.ggml:
            raise ValueError(f"{mod}: scheme {qt.scheme} is not a GGUF type (use a gguf-* scheme)")
        if arch.norm_offset and _is_norm(gguf_tensor_name(f"{mod}.weight", mt)):
            raise ValueError(f"{mod}: a quantized norm cannot hold Gemma's 1 + w")
    hp = _hparams(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch.name)
        w.add_name(name)
        for key, adder in _HPARAM_KEYS.items():  # <arch>.{context_length, ...}
            getattr(w, adder)(hp[key])
        for adder in ("add_rope_dimension_count", "add_key_length", "add_value_length"):
            getattr(w, adder)(hp["head_dim"])
        if arch.name == "gemma3":
            _gemma3_hparams(w, config, hp)
        write_tokenizer(w, tokenizer_dir, config, add_bos=add_bos, pre=arch.pre)
        for pname, p in model.state_dict().items():
            module = pname.rpartition(".")[0]
            if tied and module == "lm_head":
                continue
            gname = gguf_tensor_name(pname, mt)
            h = _rope_heads(arch, gname.rpartition(".")[0], hp)
            order = rope_row_order(p.shape[0], h) if h else None  # weight rows and bias entries alike
            qt = qtensors.get(module) if pname.endswith(".weight") else None
            if qt is not None:
                data = _tensor_bytes(qt)
                data = data[order.numpy()] if order is not None else data
                w.add_tensor(gname, np.ascontiguousarray(data),
                             raw_dtype=gguf.GGMLQuantizationType(qt.scheme.ggml_type.type_id))
            else:
                t = to_stored(gname, p, mt)
                t = t[order] if order is not None else t
                w.add_tensor(gname, np.ascontiguousarray(t.numpy()))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def hf_module_names(config) -> dict[str, str]:
    """GGUF module name → Hugging Face module name (``blk.3.ffn_up`` → ``model.layers.3.mlp.up_proj``)."""
    layer = _arch(config.model_type).layer
    names = {f"blk.{i}.{g}": f"model.layers.{i}.{hf}" for i in range(config.num_hidden_layers) for hf, g in layer.items()}
    names.update({g: hf for hf, g in _TOP.items()})
    return names


def tensor_types(path: Path, config) -> dict[str, str]:
    """Hugging Face module name → ggml type name (``q4_k``, ``f32``, ...) of each weight in a GGUF file."""
    import gguf

    names = hf_module_names(config)
    return {names[t.name.rpartition(".")[0]]: t.tensor_type.name.lower()
            for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith(".weight")}


def read_gguf_weights(path: Path, config, *, stored: bool = False) -> dict[str, torch.Tensor]:
    """The parameters of a GGUF file lowbit wrote, under their Hugging Face names, dequantized
    by the ``gguf`` package (fp32) and with llama's ``attn_q`` / ``attn_k`` rows back in Hugging
    Face order.  The inverse of :func:`write_gguf`, for checking a file against the model.
    With ``stored`` the values are those the file holds (Gemma's norms ``1 + w``,
    :func:`to_stored`), else Hugging Face's (:func:`from_stored`)."""
    import gguf

    mt = config.model_type
    arch = _arch(mt)
    hp = _hparams(config)
    names = hf_module_names(config)
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        module, _, leaf = t.name.rpartition(".")
        if module not in names:
            raise ValueError(f"{path}: unexpected tensor {t.name}")
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists ne0 (the row length) first
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        h = _rope_heads(arch, module, hp)
        if h:
            w = w[torch.argsort(rope_row_order(shape[0], h))]
        out[f"{names[module]}.{leaf}"] = w if stored else from_stored(t.name, w, mt)
    return out
