"""Tiny models built from a config (random weights, seeded), shared by the test packages."""

import torch


def tiny_llama(vocab_size: int = 256, max_positions: int = 128):
    """A 2-layer Llama, hidden 64, GQA 4/2 heads, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def wide_llama():
    """Shapes every scheme accepts: in_features multiples of 128, q/k out multiples of 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def token_windows(n=3, seq=16, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))
