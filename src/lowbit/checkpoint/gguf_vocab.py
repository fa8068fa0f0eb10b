"""The tokenizer of a GGUF file (``tokenizer.ggml.*``), from a fast tokenizer's ``tokenizer.json``.

Two kinds, as llama.cpp reads them:

- byte-level BPE (SmolLM2, Qwen): ``tokenizer.ggml.model = gpt2``, the token strings, their
  types and the merges; the pre-tokenizer is named per architecture (``smollm``, ``qwen2``).
- SentencePiece-style BPE with byte fallback (Gemma-3, whose folder has a ``tokenizer.json`` and
  no ``tokenizer.model``): ``tokenizer.ggml.model = llama``, llama.cpp's SentencePiece tokenizer,
  which merges, among adjacent pieces whose concatenation is a token, the one of highest score.
  A SentencePiece BPE vocabulary's merges are listed in that priority, so each token that a
  merge produces gets the score ``−rank`` of its first merge (0 for the others: characters,
  bytes and specials, which no merge produces). Byte tokens (``<0x0A>``) are BYTE, ``unk`` is
  UNKNOWN, special added tokens CONTROL, other added tokens USER_DEFINED (with ``▁`` written as a
  space, as llama.cpp expects them pre-normalized). No space prefix is added.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["write_tokenizer", "tokenizer_kind"]

# gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_kind(tj: dict) -> str:
    """``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece-style BPE with byte fallback)."""
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise NotImplementedError(f"GGUF export: tokenizer model {model.get('type')!r} is not written yet (BPE only)")
    dec = json.dumps(tj.get("decoder") or {})
    return "llama" if model.get("byte_fallback") and "ByteFallback" in dec else "gpt2"


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]


def write_tokenizer(w, tokenizer_dir: Path, config, *, add_bos: bool, pre: str) -> str:
    """Write the vocabulary of ``tokenizer_dir/tokenizer.json`` into the GGUFWriter ``w``;
    returns the kind written (:func:`tokenizer_kind`)."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"GGUF export needs {path} (a fast tokenizer's tokenizer.json)")
    tj = json.loads(path.read_text())
    kind = tokenizer_kind(tj)
    model = tj["model"]
    vocab = dict(model["vocab"])
    special = {t["id"]: t for t in tj.get("added_tokens", [])}
    for i, t in special.items():
        vocab.setdefault(t["content"], i)
    n = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n  # for ids no token has
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = BYTE if kind == "llama" and _BYTE.fullmatch(tok) else NORMAL
    for i, t in special.items():
        if t.get("special"):
            types[i] = CONTROL
        else:
            types[i] = USER_DEFINED
            if kind == "llama":
                tokens[i] = t["content"].replace("\u2581", " ")
    pairs = _merge_pairs(model)
    w.add_tokenizer_model(kind)
    if kind == "gpt2":
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([" ".join(p) for p in pairs])
    else:
        unk = model.get("unk_token")
        if unk in vocab:
            types[vocab[unk]] = UNKNOWN
        scores = [0.0] * n
        seen: set[str] = set()
        for rank, (a, b) in enumerate(pairs):
            piece = a + b
            if piece not in seen and piece in vocab:
                seen.add(piece)
                scores[vocab[piece]] = -float(rank)
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(False)
    for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                    ("unk_token_id", w.add_unk_token_id), ("pad_token_id", w.add_pad_token_id)):
        v = getattr(config, key, None)
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    w.add_add_bos_token(add_bos)
    return kind
