"""Tiny models built from a config (random weights, seeded): fast stand-ins with the real
architectures' code paths."""

import pytest
import torch


from tinymodels import tiny_llama as _tiny_llama  # noqa: E402


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


def _byte_bpe_tokenizer(texts: list[str], add_bos: bool = False):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``, vocabulary 300 with ``<unk> <s> </s>``)
    trained on ``texts``; with ``add_bos`` its post-processor prepends ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="session")
def byte_bpe_tokenizer():
    """The builder ``byte_bpe_tokenizer(texts, add_bos=False)`` of a small trained tokenizer."""
    return _byte_bpe_tokenizer


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """``(model folder, corpus folder)`` on disk for CLI runs in a subprocess
    (:mod:`tinyfolder`)."""
    from tinyfolder import _TEXT, write_corpus, write_model

    root = tmp_path_factory.mktemp("tiny")
    corpus = write_corpus(root / "corpus")
    tok = _byte_bpe_tokenizer([_TEXT] * 4)
    return write_model(root / "model", tok), corpus


def _tiny_moe(kind: str = "qwen3_moe", experts: int = 8, layers: int = 2, head_dim: int = 16):
    """A tiny Qwen3-MoE, Mixtral or Qwen2-MoE (a shared expert and its gate beside the routed
    ones) in transformers' fused-experts layout, seeded, with a router scaled up so that
    routing is real (not near-uniform).  ``head_dim``: vLLM's CPU attention takes 32, 64, 80, ... (not 16)."""
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=128,
                  num_experts_per_tok=2)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=64, num_experts=experts, **common))
    elif kind == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                                   num_experts=experts, **common))
    else:
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(num_local_experts=experts, **common))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    return model.eval()


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def tiny_moe(request):
    return _tiny_moe(request.param)


@pytest.fixture
def tiny_moe_builder():
    """``builder(kind="qwen3_moe", experts=8, layers=2)``: a tiny MoE model (see :func:`_tiny_moe`)."""
    return _tiny_moe
