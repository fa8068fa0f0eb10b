"""Documents → token windows for evaluation and calibration, exactly as PROTOCOL.md says.

- split: documents in canonical order; test = index ``i % 5 == 4``, train = the rest.
- stream: the split's texts joined with ``"\\n\\n"``, tokenized once, no special tokens.
- evaluation: consecutive non-overlapping windows, in order; the last partial one dropped.
- calibration: windows at seeded random start positions in the train stream.

With a BOS token each window is ``[BOS] + (seq_len - 1)`` text tokens, so every window has
exactly ``seq_len`` tokens whichever model reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch

from ..models.assets import Document, cache_dir, load_documents
from ..util.io import CorruptFile, discard_corrupt, load_tensors, save_tensors

__all__ = ["split_documents", "token_stream", "eval_windows", "calibration_windows", "stream_for", "windows_for",
           "tokenizer_fingerprint"]

log = logging.getLogger(__name__)

TEST_EVERY = 5  # document i is a test document when i % TEST_EVERY == TEST_EVERY - 1
JOIN = "\n\n"


def split_documents(docs: list[Document], part: str) -> list[Document]:
    """The ``"test"`` documents (index ``i % 5 == 4``) or the ``"train"`` ones (the rest).

    Raises:
        ValueError: ``part`` is neither.
    """
    if part == "test":
        return [d for i, d in enumerate(docs) if i % TEST_EVERY == TEST_EVERY - 1]
    if part == "train":
        return [d for i, d in enumerate(docs) if i % TEST_EVERY != TEST_EVERY - 1]
    raise ValueError(f"part must be 'train' or 'test', got {part!r}")


def token_stream(tokenizer, docs: list[Document]) -> torch.Tensor:
    """``docs``' texts joined with ``"\\n\\n"`` and tokenized once without special tokens.

    Returns:
        (n_tokens,) int64.
    """
    text = JOIN.join(d.text for d in docs)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                    verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def _with_bos(body: torch.Tensor, bos_token_id: int | None) -> torch.Tensor:
    if bos_token_id is None:
        return body
    bos = torch.full((body.shape[0], 1), bos_token_id, dtype=torch.int64)
    return torch.cat([bos, body], dim=1)


def _text_len(seq_len: int, bos_token_id: int | None) -> int:
    text_len = seq_len - (bos_token_id is not None)
    if text_len < 1:
        raise ValueError(f"seq_len={seq_len} leaves no room for text tokens")
    return text_len


def eval_windows(tokens: torch.Tensor, seq_len: int = 512, n_windows: int | None = None,
                 bos_token_id: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``tokens``, in order, the last partial one dropped.

    With ``bos_token_id`` each window is ``[BOS]`` + ``seq_len - 1`` text tokens. ``n_windows``
    keeps the first ``n_windows``.

    Returns:
        (n, seq_len) int64.

    Raises:
        ValueError: ``n_windows`` exceeds the windows that exist (the message says how many).
    """
    text_len = _text_len(seq_len, bos_token_id)
    available = tokens.numel() // text_len
    n = available if n_windows is None else n_windows
    if n > available:
        raise ValueError(f"asked for {n} windows of {seq_len} tokens but only {available} exist "
                         f"({tokens.numel():,} tokens)")
    body = tokens.reshape(-1)[: n * text_len].to(torch.int64).reshape(n, text_len)  # (n, text_len)
    return _with_bos(body, bos_token_id)


def calibration_windows(tokens: torch.Tensor, n: int = 128, seq_len: int = 512, seed: int = 0,
                        bos_token_id: int | None = None) -> torch.Tensor:
    """``n`` windows at random start positions (they may overlap).

    Starts are ``torch.randint(0, n_tokens - text_len + 1, (n,))`` drawn from
    ``torch.Generator().manual_seed(seed)``, where ``text_len`` is ``seq_len``, less one with a
    BOS (which then opens every window).

    Returns:
        (n, seq_len) int64.

    Raises:
        ValueError: ``tokens`` is shorter than one window.
    """
    text_len = _text_len(seq_len, bos_token_id)
    tokens = tokens.reshape(-1).to(torch.int64)
    if tokens.numel() < text_len:
        raise ValueError(f"{tokens.numel()} tokens cannot fill one window of {text_len}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - text_len + 1, (n,), generator=generator)  # (n,)
    body = tokens[starts[:, None] + torch.arange(text_len)]  # (n, text_len)
    return _with_bos(body, bos_token_id)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash that changes whenever the tokenizer could tokenize differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = backend.to_str()
    else:  # a slow tokenizer: its vocabulary and class stand in for the full definition
        spec = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def stream_for(tokenizer, corpus: str, part: str, *, cache: Path | None = None) -> torch.Tensor:
    """The token stream of a corpus split: load → split → :func:`token_stream`, cached as
    ``<cache>/tokens/<corpus>-<part>-<hash>.safetensors``; the hash covers the tokenizer
    and the split's documents (so a changed cleaning or file is retokenized).

    Returns:
        1-D int64.
    """
    docs = split_documents(load_documents(corpus, cache), part)
    digest = hashlib.sha256(tokenizer_fingerprint(tokenizer).encode())
    for d in docs:
        digest.update(f"{d.id}\0{d.text}\0".encode())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus).strip("_")[-60:]
    path = cache_dir(cache) / "tokens" / f"{slug}-{part}-{digest.hexdigest()[:16]}.safetensors"
    return _cached_stream(path, lambda: token_stream(tokenizer, docs),
                          {"corpus": corpus, "part": part, "documents": str(len(docs))})


def windows_for(tokenizer, corpus: str, part: str, *, seq_len: int = 512,
                n_windows: int | None = None, bos_token_id: int | None = None,
                cache: Path | None = None) -> torch.Tensor:
    """Evaluation windows of a corpus split: :func:`stream_for` → :func:`eval_windows`.

    Returns:
        (n, seq_len) int64.
    """
    tokens = stream_for(tokenizer, corpus, part, cache=cache)
    return eval_windows(tokens, seq_len, n_windows, bos_token_id)


def _cached_stream(path: Path, build, metadata: dict[str, str]) -> torch.Tensor:
    """The stream cached at ``path`` if it is intact (checksum verified), else ``build()``,
    written atomically with its checksum (:func:`lowbit.util.io.save_tensors`)."""
    if path.is_file():
        try:
            tensors, _ = load_tensors(path)
            if set(tensors) != {"tokens"}:
                raise CorruptFile(f"{path}: holds {sorted(tensors)}, not a token stream")
            return tensors["tokens"]
        except CorruptFile as e:
            discard_corrupt(e, path)
    tokens = build()
    save_tensors(path, {"tokens": tokens}, metadata)
    log.info("cached %s tokens in %s", f"{tokens.numel():,}", path)
    return tokens
