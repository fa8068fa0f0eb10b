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
from .chat import chat_stream
from ..util.io import CorruptFile, discard_corrupt, load_tensors, save_tensors

__all__ = ["split_documents", "token_stream", "eval_windows", "calibration_windows", "stream_for", "windows_for",
           "tokenizer_fingerprint", "calibration_for", "corpus_parts", "assistant_mask_for"]

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


def _streams(tokenizer, corpus: str, part: str, cache: Path | None) -> dict[str, torch.Tensor]:
    """``{"tokens"}`` of a corpus split — and ``"mask"``, the assistant tokens, for a corpus of
    conversations (rendered with the tokenizer's chat template, :mod:`lowbit.data.chat`) —
    cached as ``<cache>/tokens/<corpus>-<part>-<hash>.safetensors``; the hash covers the
    tokenizer (and its chat template) and the split's documents."""
    docs = split_documents(load_documents(corpus, cache), part)
    chat = bool(docs and docs[0].messages)
    if any(bool(d.messages) != chat for d in docs):
        raise ValueError(f"{corpus}: mixes conversations and plain documents")
    digest = hashlib.sha256(tokenizer_fingerprint(tokenizer).encode())
    if chat:
        digest.update(f"chat\0{getattr(tokenizer, 'chat_template', None)}\0".encode())
    for d in docs:
        digest.update(f"{d.id}\0{d.text}\0".encode())
        if chat:
            digest.update(json.dumps(d.messages).encode())
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus).strip("_")[-60:]
    path = cache_dir(cache) / "tokens" / f"{slug}-{part}-{digest.hexdigest()[:16]}.safetensors"

    def build() -> dict[str, torch.Tensor]:
        if not chat:
            return {"tokens": token_stream(tokenizer, docs)}
        tokens, mask = chat_stream(tokenizer, [(d.id, d.messages) for d in docs])
        return {"tokens": tokens, "mask": mask}

    return _cached_stream(path, build, {"corpus": corpus, "part": part, "documents": str(len(docs))},
                          {"tokens", "mask"} if chat else {"tokens"})


def stream_for(tokenizer, corpus: str, part: str, *, cache: Path | None = None) -> torch.Tensor:
    """The token stream of a corpus split: load → split → :func:`token_stream` (conversations:
    :func:`lowbit.data.chat.chat_stream`), cached (see :func:`_streams`), so a changed cleaning
    or file is retokenized.

    Returns:
        1-D int64.
    """
    return _streams(tokenizer, corpus, part, cache)["tokens"]


def assistant_mask_for(tokenizer, corpus: str, *, seq_len: int = 512, n_windows: int | None = None,
                       bos_token_id: int | None = None, cache: Path | None = None) -> torch.Tensor:
    """Which predicted positions of :func:`windows_for`'s test windows predict an assistant
    token: ``mask[w, t]`` is true when window ``w``'s token ``t + 1`` belongs to an assistant
    message (a window's BOS never does).

    Returns:
        (n, seq_len - 1) bool.

    Raises:
        ValueError: ``corpus`` is not a file of conversations.
    """
    streams = _streams(tokenizer, corpus, "test", cache)
    if "mask" not in streams:
        raise ValueError(f"--loss-on assistant needs a corpus of conversations ({{\"messages\": [...]}} per line "
                         f"of a .jsonl); {corpus!r} is plain text")
    marks = eval_windows(streams["mask"].to(torch.int64), seq_len, n_windows, None if bos_token_id is None else 0)
    return marks[:, 1:].bool()


def windows_for(tokenizer, corpus: str, part: str, *, seq_len: int = 512,
                n_windows: int | None = None, bos_token_id: int | None = None,
                cache: Path | None = None) -> torch.Tensor:
    """Evaluation windows of a corpus split: :func:`stream_for` → :func:`eval_windows`.

    Returns:
        (n, seq_len) int64.
    """
    tokens = stream_for(tokenizer, corpus, part, cache=cache)
    return eval_windows(tokens, seq_len, n_windows, bos_token_id)


def corpus_parts(spec: str) -> list[str]:
    """The corpora of a calibration mixture ``a+b+c`` (a spec naming an existing path is one corpus).

    Raises:
        ValueError: an empty part (``wiki+``).
    """
    if "+" not in spec or Path(spec).expanduser().exists():
        return [spec]
    parts = spec.split("+")
    if any(not p.strip() for p in parts):
        raise ValueError(f"calibration corpus {spec!r}: an empty part in a '+' mixture")
    return [p.strip() for p in parts]


def calibration_for(tokenizer, corpus: str, n: int, seq_len: int = 512, seed: int = 0,
                    bos_token_id: int | None = None, *, cache: Path | None = None) -> torch.Tensor:
    """``n`` calibration windows from the train split of ``corpus``: :func:`calibration_windows`
    over its :func:`stream_for` stream.

    A mixture ``a+b+c`` takes equal parts from each corpus's train split, in that order: the
    first ``n % k`` parts one window more (each part drawn with the same ``seed``). A single
    corpus gives exactly the windows it always gave.

    Returns:
        (n, seq_len) int64.
    """
    parts = corpus_parts(corpus)
    counts = [n // len(parts) + (i < n % len(parts)) for i in range(len(parts))]
    return torch.cat([calibration_windows(stream_for(tokenizer, p, "train", cache=cache), c, seq_len, seed,
                                          bos_token_id) for p, c in zip(parts, counts)])


def _cached_stream(path: Path, build, metadata: dict[str, str], names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` cached at ``path`` if it is intact (checksum verified), else
    ``build()``, written atomically with its checksum (:func:`lowbit.util.io.save_tensors`)."""
    if path.is_file():
        try:
            tensors, _ = load_tensors(path)
            if set(tensors) != names:
                raise CorruptFile(f"{path}: holds {sorted(tensors)}, not a token stream ({sorted(names)})")
            return tensors
        except CorruptFile as e:
            discard_corrupt(e, path)
    tensors = build()
    save_tensors(path, tensors, metadata)
    log.info("cached %s tokens in %s", f"{tensors['tokens'].numel():,}", path)
    return tensors
