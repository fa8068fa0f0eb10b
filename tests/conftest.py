"""Tiny models built from a config (random weights, seeded): fast stand-ins with the real
architectures' code paths."""

import pytest
import torch


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
    )
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture
def tiny_llama():
    return _tiny_llama()


@pytest.fixture
def tiny_gemma3():
    return _tiny_gemma3()


@pytest.fixture(params=["llama", "gemma3"])
def tiny_model(request):
    return _tiny_llama() if request.param == "llama" else _tiny_gemma3()


@pytest.fixture
def windows():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (6, 24), generator=g)
