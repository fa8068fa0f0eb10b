"""Conversations → tokens with the model's own chat template, and which tokens the assistant wrote.

A conversation is rendered exactly as ``tokenizer.apply_chat_template(messages, tokenize=False)``
renders it (no generation prompt) and tokenized without adding special tokens — the ids
``apply_chat_template(messages)`` itself returns. The assistant mask marks the tokens whose
characters overlap the *content* of an assistant message: role markers, end-of-turn markers and
whatever else the template writes around a message are not the assistant's.

Where each message's text lies in the rendering is found by rendering the conversation's
prefixes: turn ``i`` is the text ``render(messages[:i + 1])`` adds to ``render(messages[:i])``,
and its content is searched for inside that turn only (so a short reply can never match a
role marker or an earlier message).
"""

from __future__ import annotations

import torch

__all__ = ["render_conversation", "chat_stream", "ROLES"]

ROLES = ("system", "user", "assistant")


def _render(tokenizer, messages: list[dict]) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def _assistant_spans(tokenizer, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant contents in ``text`` (the full rendering)."""
    spans, before = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i])
        upto = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(upto)):
            raise ValueError(f"{where}: the chat template does not render this conversation's prefixes as "
                             "prefixes of the whole; the assistant turns cannot be located")
        content = m["content"]
        at = upto.find(content, len(before)) if content else -1
        if at < 0 and content.strip():
            content = content.strip()  # templates that trim message text
            at = upto.find(content, len(before))
        if at < 0:
            if not content.strip():
                continue  # an empty reply has no tokens
            raise ValueError(f"{where}: message {i} (assistant) does not appear verbatim in the chat template's "
                             "rendering; the template changes message text")
        spans.append((at, at + len(content)))
    return spans


def render_conversation(tokenizer, messages: list[dict], where: str = "conversation") -> tuple[list[int], list[bool]]:
    """Token ids of one conversation rendered with ``tokenizer``'s chat template, and per token
    whether it belongs to an assistant message's content.

    Raises:
        ValueError: the tokenizer has no chat template (a base model), or the template hides where
            the assistant's text is (see the module docstring); ``where`` names the conversation.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat template (a base model?); chat-formatted "
                         "corpora need one")
    text = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text, where)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [any(s < end and e > start for start, end in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def chat_stream(tokenizer, conversations: list[tuple[str, tuple[tuple[str, str], ...]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations ``(id, ((role, content), ...))`` rendered one after another.

    Returns:
        tokens (n_tokens,) int64 and the assistant mask (n_tokens,) bool.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for cid, turns in conversations:
        i, m = render_conversation(tokenizer, [{"role": r, "content": c} for r, c in turns], f"conversation {cid}")
        ids += i
        mask += m
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)
