"""A tiny model folder (config, safetensors, tokenizer) and a tiny corpus on disk, for tests
that run the CLI (in-process or in forked children): a few seconds per run."""

from __future__ import annotations

from pathlib import Path

_TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "
         "Numbers like 12, 345 and 6789 appear beside words, commas, and full stops. ")


def write_corpus(folder: Path, docs: int = 10) -> Path:
    """A folder of ``docs`` .txt files (document i of them goes to the test split when i % 5 == 4)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}. " + _TEXT * (8 + i % 3), encoding="utf-8")
    return folder


def write_model(folder: Path, tokenizer) -> Path:
    """A 2-layer Llama (hidden 64, vocabulary of ``tokenizer``) saved with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder
