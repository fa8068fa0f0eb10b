"""Conversations rendered with the model's own chat template, and the assistant mask, on the
real SmolLM2 tokenizer (whose ChatML template marks every turn with <|im_start|>role)."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.data import windows as data
from lowbit.data.chat import chat_stream, render_conversation
from lowbit.models.assets import cache_dir, load_documents

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    folder = cache_dir() / "models" / "smollm2-135m"
    if not (folder / "tokenizer_config.json").exists():
        pytest.skip("the packaged smollm2-135m is not in the cache (lowbit assets fetch smollm2-135m)")
    return AutoTokenizer.from_pretrained(folder)


def test_rendering_equals_apply_chat_template(smol_tokenizer):
    for messages in (CONVERSATION, CONVERSATION[1:3]):  # with and without a system message
        ids, mask = render_conversation(smol_tokenizer, messages)
        assert ids == list(smol_tokenizer.apply_chat_template(messages)["input_ids"])
        assert len(mask) == len(ids)


def test_assistant_mask_is_exactly_the_assistant_tokens(smol_tokenizer):
    tok = smol_tokenizer
    ids, mask = render_conversation(tok, CONVERSATION)
    # the masked tokens, run by run, decode to the assistant messages, in order
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    assert [tok.decode(r) for r in runs] == [CONVERSATION[2]["content"], CONVERSATION[4]["content"]]
    # and what is left out is everything else: the system and user turns and every role marker
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert not any(m for i, m in zip(ids, mask) if i in (start, end))
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in CONVERSATION[:2] + [CONVERSATION[3]]:
        assert m["content"] in unmasked
    assert "Paris" not in unmasked and "Rome" not in unmasked
    # each run starts right after "<|im_start|>assistant\n" and ends right before "<|im_end|>"
    for r in runs:
        first = next(j for j in range(len(ids)) if ids[j:j + len(r)] == r)
        assert tok.decode(ids[:first]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert ids[first + len(r)] == end


def test_a_reply_that_matches_a_role_marker_is_still_located(smol_tokenizer):
    messages = [{"role": "user", "content": "Say the word assistant."}, {"role": "assistant", "content": "assistant"}]
    ids, mask = render_conversation(smol_tokenizer, messages)
    assert smol_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "assistant"
    assert sum(mask) == len(smol_tokenizer("assistant", add_special_tokens=False)["input_ids"])


def test_tokenizer_without_a_chat_template_is_refused(smol_tokenizer):
    import copy

    base = copy.copy(smol_tokenizer)
    base.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_conversation(base, CONVERSATION)


def test_chat_jsonl_corpus_streams_and_masks(tmp_path, smol_tokenizer):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_documents(str(path))
    assert [d.id for d in docs] == [f"{i:08d}" for i in range(10)] and docs[0].messages[1][0] == "assistant"
    test = data.split_documents(docs, "test")  # conversations 4 and 9
    tokens, mask = chat_stream(smol_tokenizer, [(d.id, d.messages) for d in test])
    assert torch.equal(data.stream_for(smol_tokenizer, str(path), "test", cache=tmp_path), tokens)
    win = data.windows_for(smol_tokenizer, str(path), "test", seq_len=16, cache=tmp_path)
    m = data.assistant_mask_for(smol_tokenizer, str(path), seq_len=16, cache=tmp_path)
    assert m.shape == (len(win), 15) and m.dtype == torch.bool
    assert torch.equal(m, mask[: len(win) * 16].reshape(-1, 16)[:, 1:])
    with_bos = data.assistant_mask_for(smol_tokenizer, str(path), seq_len=16, bos_token_id=1, cache=tmp_path)
    assert torch.equal(with_bos, mask[: with_bos.shape[0] * 15].reshape(-1, 15))  # the BOS predicts the first text token
    prose = tmp_path / "prose.txt"
    prose.write_text("Plain text, no conversation in it. " * 20)
    with pytest.raises(ValueError, match="conversations"):
        data.assistant_mask_for(smol_tokenizer, str(prose), seq_len=16, cache=tmp_path)


@pytest.mark.parametrize("line, match", [
    ({"messages": []}, "at least one message"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "message 0 needs a role"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "string content"),
])
def test_bad_conversation_lines_are_refused(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=f"line 2.*{match}|{match}"):
        load_documents(str(path))
