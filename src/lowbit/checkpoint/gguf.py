"""GGUF out: a quantized model as one ``.gguf`` file that llama.cpp runs.

Tensor names, metadata keys and the tokenizer follow llama.cpp's conventions (its
``convert_hf_to_gguf.py`` and ``gguf`` package constants): ``token_embd``, ``blk.N.attn_q``,
..., ``output_norm``; ``llama.*`` hyperparameters; a GPT-2-style BPE vocabulary under
``tokenizer.ggml.*``.  llama.cpp's Llama graph expects the rows of ``attn_q`` / ``attn_k``
in an interleaved RoPE order, so those rows are permuted (per head, the two rotary halves
interleaved) — rows are whole blocks, so the packed bytes are permuted row for row.

Quantized weights are packed from their :class:`~lowbit.numerics.qtensor.QTensor`
(:mod:`lowbit.numerics.ggml_pack`), so every weight decodes to exactly lowbit's fake-quantized
value; everything else is written as F32.  The file is written to a temporary name and
renamed when complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..numerics.ggml_pack import pack
from ..numerics.qtensor import QTensor
from ..util.io import refuse_existing

__all__ = ["write_gguf", "read_gguf_weights", "tensor_types", "hf_module_names", "gguf_tensor_name", "rope_row_order", "GGUF_ARCHS"]

#: model_type → llama.cpp architecture, for the architectures written so far
GGUF_ARCHS = {"llama": "llama"}

_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of a Hugging Face Llama parameter (``model.layers.3.mlp.up_proj.weight``
    → ``blk.3.ffn_up.weight``)."""
    module, _, leaf = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    parts = module.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _LAYER:
        return f"blk.{int(parts[2])}.{_LAYER['.'.join(parts[3:])]}.{leaf}"
    raise ValueError(f"no GGUF name for parameter {name!r} (a Llama-architecture name was expected)")


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


def _hparams(config) -> dict[str, object]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"GGUF export: RoPE scaling {rope.get('rope_type')!r} is not written yet")
    return {
        "context_length": int(config.max_position_embeddings), "embedding_length": int(config.hidden_size),
        "block_count": int(config.num_hidden_layers), "feed_forward_length": int(config.intermediate_size),
        "head_count": int(config.num_attention_heads), "head_count_kv": int(config.num_key_value_heads),
        "rope_freq_base": float(theta), "rms_eps": float(config.rms_norm_eps), "head_dim": int(head_dim),
        "vocab_size": int(config.vocab_size),
    }


def _write_tokenizer(w, tokenizer_dir: Path, config, add_bos: bool) -> None:
    """A byte-level BPE vocabulary (``tokenizer.json``) as ``tokenizer.ggml.*``."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"GGUF export needs {path} (a fast tokenizer's tokenizer.json)")
    tj = json.loads(path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise NotImplementedError(f"GGUF export: tokenizer model {model.get('type')!r} is not written yet (BPE only)")
    vocab = dict(model["vocab"])
    special = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in special.items():
        vocab.setdefault(t["content"], i)
    n = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [5] * n  # UNUSED for ids no token has
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = 1  # NORMAL
    for i, t in special.items():
        types[i] = 3 if t.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if config.model_type == "llama" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                    ("unk_token_id", w.add_unk_token_id), ("pad_token_id", w.add_pad_token_id)):
        v = getattr(config, key, None)
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    w.add_add_bos_token(add_bos)


def _tensor_bytes(qt: QTensor) -> np.ndarray:
    t = qt.scheme.ggml_type
    v = qt.values().reshape(-1, qt.shape[-1])
    return pack(v, t, qt.scale, qt.zero, qt.super_scale, qt.super_min).numpy()


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
    arch = GGUF_ARCHS.get(config.model_type)
    if arch is None:
        raise NotImplementedError(f"GGUF export of {config.model_type!r} models is not implemented yet "
                                  f"(written: {', '.join(GGUF_ARCHS)})")
    out = Path(out)
    refuse_existing(out, force)
    for mod, qt in qtensors.items():
        if not qt.scheme.ggml:
            raise ValueError(f"{mod}: scheme {qt.scheme} is not a GGUF type (use a gguf-* scheme)")
    hp = _hparams(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(name)
        for key, adder in _HPARAM_KEYS.items():  # llama.{context_length, ...}
            getattr(w, adder)(hp[key])
        for adder in ("add_rope_dimension_count", "add_key_length", "add_value_length"):
            getattr(w, adder)(hp["head_dim"])
        _write_tokenizer(w, tokenizer_dir, config, add_bos)
        for pname, p in model.state_dict().items():
            module = pname.rpartition(".")[0]
            if tied and module == "lm_head":
                continue
            heads = {"self_attn.q_proj": hp["head_count"], "self_attn.k_proj": hp["head_count_kv"]}
            h = next((n for k, n in heads.items() if module.endswith(k) and pname.endswith(".weight")), None)
            order = rope_row_order(p.shape[0], h) if h else None
            qt = qtensors.get(module) if pname.endswith(".weight") else None
            if qt is not None:
                data = _tensor_bytes(qt)
                data = data[order.numpy()] if order is not None else data
                w.add_tensor(gguf_tensor_name(pname), np.ascontiguousarray(data),
                             raw_dtype=gguf.GGMLQuantizationType(qt.scheme.ggml_type.type_id))
            else:
                t = p.detach().to(torch.float32)
                t = t[order] if order is not None else t
                w.add_tensor(gguf_tensor_name(pname), np.ascontiguousarray(t.numpy()))
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
    names = {f"blk.{i}.{g}": f"model.layers.{i}.{hf}" for i in range(config.num_hidden_layers) for hf, g in _LAYER.items()}
    names.update({g: hf for hf, g in _TOP.items()})
    return names


def tensor_types(path: Path, config) -> dict[str, str]:
    """Hugging Face module name → ggml type name (``q4_k``, ``f32``, ...) of each weight in a GGUF file."""
    import gguf

    names = hf_module_names(config)
    return {names[t.name.rpartition(".")[0]]: t.tensor_type.name.lower()
            for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith(".weight")}


def read_gguf_weights(path: Path, config) -> dict[str, torch.Tensor]:
    """The parameters of a GGUF file lowbit wrote, under their Hugging Face names, dequantized
    by the ``gguf`` package (fp32) and with ``attn_q`` / ``attn_k`` rows back in Hugging Face
    order.  The inverse of :func:`write_gguf`, for checking a file against the model."""
    import gguf

    hp = _hparams(config)
    names = hf_module_names(config)
    heads = {"attn_q": hp["head_count"], "attn_k": hp["head_count_kv"]}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        module, _, leaf = t.name.rpartition(".")
        if module not in names:
            raise ValueError(f"{path}: unexpected tensor {t.name}")
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists ne0 (the row length) first
        w = torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        h = heads.get(module.rpartition(".")[2])
        if h and leaf == "weight":
            w = w[torch.argsort(rope_row_order(shape[0], h))]
        out[f"{names[module]}.{leaf}"] = w
    return out
