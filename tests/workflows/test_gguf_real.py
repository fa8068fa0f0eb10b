"""Slow tier: SmolLM2 to GGUF, read back by transformers' own GGUF loader (which dequantizes with
the ``gguf`` package), gives exactly the weights lowbit quantized."""

import pytest
import torch

from lowbit.checkpoint.gguf import read_gguf_weights, tensor_types
from lowbit.models.loading import load_model
from lowbit.workflows.gguf import quantize_to_gguf

pytestmark = pytest.mark.slow


def test_smollm2_q4_k_m_reads_back_through_transformers(tmp_path):
    res = quantize_to_gguf("smollm2-135m", "gguf-q4_k_m", tmp_path / "m.gguf", evaluate=False, progress=False)
    model, _, _ = load_model(str(res.path), cache=tmp_path / "cache")
    ours = read_gguf_weights(res.path, model.config)
    sd = model.state_dict()
    for name, t in ours.items():
        assert torch.equal(sd[name].float(), t), name
    types = tensor_types(res.path, model.config)
    assert types["model.layers.0.mlp.down_proj"] == "q6_k"          # 1536 columns: a real k-quant
    assert types["model.layers.0.self_attn.q_proj"] == "q5_0"       # 576 columns: llama-quantize's fallback
    assert types["model.embed_tokens"] == "q8_0"
