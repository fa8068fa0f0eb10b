"""GGUF out: the file the writer produces reads back (gguf's reader and dequantizers) to exactly
the weights lowbit quantized, with llama.cpp's names, row order and metadata."""

import json

import numpy as np
import pytest
import torch

from lowbit.checkpoint.gguf import gguf_tensor_name, read_gguf_weights, rope_row_order, write_gguf
from lowbit.quantization.recipe import recipe_from_dict
from lowbit.workflows.gguf import EMBEDDING, gguf_recipe, load_checked, quantize_for_gguf

gguf = pytest.importorskip("gguf")


_IQ4_NL = recipe_from_dict({"name": "iq4_nl", "weights": "gguf-iq4_nl",
                            "rules": [{"targets": ["model.embed_tokens"], "weights": "gguf-q6_k"}]}, "test")


def _k_llama():
    """A 1-layer Llama whose rows hold whole 256-element super-blocks (k-quants without fallback)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tok_dir(tmp_path):
    """A byte-level BPE tokenizer.json of 256 tokens (3 of them special) and two merges."""
    vocab = {f"t{i}": i for i in range(256)}
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in range(3)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab, "merges": [["t3", "t4"], "t5 t6"]}, "added_tokens": added}))
    return tmp_path


def test_names_and_rope_order():
    assert gguf_tensor_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.norm.weight") == "output_norm.weight"
    with pytest.raises(ValueError, match="no GGUF name"):
        gguf_tensor_name("model.layers.0.mlp.experts.0.up_proj.weight")
    # one head of 8 rows: the two rotary halves (0-3, 4-7) interleaved
    assert rope_row_order(8, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("recipe", ["gguf-q4_0", "gguf-q4_k_m", "gguf-q8_0", "gguf-q3_k_m", "gguf-iq4_nl"])
def test_written_file_decodes_to_lowbits_weights(recipe, tok_dir, tmp_path):
    model = _k_llama()
    qts, _ = quantize_for_gguf(model, _IQ4_NL if recipe == "gguf-iq4_nl" else recipe)
    out = write_gguf(model, qts, tmp_path / "m.gguf", tokenizer_dir=tok_dir, name="tiny", add_bos=False)
    got = read_gguf_weights(out, model.config)
    sd = model.state_dict()
    assert set(got) == set(sd) - {"lm_head.weight"}          # tied: no output tensor
    for name, t in got.items():
        assert torch.equal(t, sd[name]), name
    load_checked(model, out)
    r = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    if recipe == "gguf-q4_k_m":
        assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_v.weight"] == "Q6_K"
        assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["token_embd.weight"] == "Q6_K"
    if recipe == "gguf-q3_k_m":     # one layer: V and down in the Q5_K layers, O Q4_K, the rest Q3_K
        assert types["blk.0.attn_q.weight"] == "Q3_K" and types["blk.0.ffn_up.weight"] == "Q3_K"
        assert types["blk.0.attn_v.weight"] == "Q5_K" and types["blk.0.ffn_down.weight"] == "Q5_K"
        assert types["blk.0.attn_output.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
    if recipe == "gguf-iq4_nl":
        assert types["blk.0.attn_q.weight"] == "IQ4_NL" and types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    f = {k: v for k, v in r.fields.items()}
    assert bytes(f["general.architecture"].parts[-1]).decode() == "llama"
    assert int(f["llama.attention.head_count_kv"].parts[-1][0]) == 2
    assert int(f["tokenizer.ggml.bos_token_id"].parts[-1][0]) == 1
    assert len(f["tokenizer.ggml.tokens"].data) == 256


def test_q3_k_m_rules_by_layer():
    """gguf-q3_k_m on a 3-layer model: V Q5_K in layers 0-1 and Q4_K in 2, down Q5_K in layer 0 only,
    O Q4_K, gate / up / Q / K Q3_K (llama-quantize's Q3_K_M for 16 <= n_layer < 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         tie_word_embeddings=True))
    r, emb = gguf_recipe("gguf-q3_k_m", model)
    types = {n: s.ggml for n, (s, _) in r.resolve([n for n, _ in model.named_modules()]).items() if s is not None}
    assert emb.ggml == "q6_k"
    for i, (v, down) in enumerate((("q5_k", "q5_k"), ("q5_k", "q4_k"), ("q4_k", "q4_k"))):
        p = f"model.layers.{i}."
        assert (types[p + "self_attn.v_proj"], types[p + "mlp.down_proj"]) == (v, down), i
        assert types[p + "self_attn.o_proj"] == "q4_k"
        assert {types[p + m] for m in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj")} == {"q3_k"}


def test_rows_without_whole_super_blocks_fall_back(tiny_llama):
    """hidden 64: q4_k cannot hold the rows; they become q5_0, as llama-quantize writes them."""
    r, emb = gguf_recipe("gguf-q4_k", tiny_llama)
    assert emb.ggml == "q8_0"                                   # q6_k's fallback
    resolved = r.resolve(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"])
    assert resolved["model.layers.0.self_attn.q_proj"][0].ggml == "q5_0"
    assert resolved["model.layers.0.mlp.down_proj"][0].ggml == "q5_0"   # 128 columns: not a whole 256 either
    r, emb = gguf_recipe("gguf-q3_k_m", tiny_llama)                     # q3_k → q4_0, q5_k → q5_1, q4_k → q5_0
    resolved = r.resolve(["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                          "model.layers.1.self_attn.v_proj", "model.layers.0.self_attn.o_proj"])
    assert [resolved[n][0].ggml for n in resolved] == ["q4_0", "q5_1", "q5_1", "q5_0"] and emb.ggml == "q8_0"


def test_refusals(tok_dir, tmp_path, tiny_llama):
    model = _k_llama()
    qts, _ = quantize_for_gguf(model, "gguf-q4_0")
    out = write_gguf(model, qts, tmp_path / "m.gguf", tokenizer_dir=tok_dir, name="tiny", add_bos=False)
    with pytest.raises(FileExistsError):
        write_gguf(model, qts, out, tokenizer_dir=tok_dir, name="tiny", add_bos=False)
    with pytest.raises(ValueError, match="not a GGUF type"):
        gguf_recipe("w4a16-int4-g128", tiny_llama)
    with pytest.raises(ValueError, match="quantizes inputs"):
        gguf_recipe("fp8-dynamic", tiny_llama)
    from transformers import MistralConfig, MistralForCausalLM
    g = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(NotImplementedError, match="mistral"):
        write_gguf(g, {}, tmp_path / "g.gguf", tokenizer_dir=tok_dir, name="g", add_bos=True)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_gptq_on_the_k_quant_grid_lowers_the_layer_error(tok_dir, tmp_path):
    """GPTQ in the layer-by-layer pass on Q4_K: the file still decodes exactly, and the
    weights differ from round-to-nearest's (the error feedback moved codes)."""
    windows = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    rtn, gptq = _k_llama(), _k_llama()
    quantize_for_gguf(rtn, "gguf-q4_k")
    qts, _ = quantize_for_gguf(gptq, "gguf-q4_k-gptq", windows)
    assert qts["model.layers.0.mlp.up_proj"].super_scale is not None
    out = write_gguf(gptq, qts, tmp_path / "g.gguf", tokenizer_dir=tok_dir, name="tiny", add_bos=False)
    load_checked(gptq, out)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(rtn.state_dict()[name], gptq.state_dict()[name])
    assert torch.equal(rtn.state_dict()["model.embed_tokens.weight"], gptq.state_dict()["model.embed_tokens.weight"])
    assert EMBEDDING in qts and np.isfinite(gptq.state_dict()[name].numpy()).all()


def _tiny(kind: str):
    """1-layer Qwen2 (q/k/v biases), Qwen3 (QK-norms) or Gemma-3 (four norms, QK-norms, sliding
    layers) with 256-column rows, random norm weights (so Gemma's 1 + w is visible)."""
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    if kind == "qwen2":
        m = T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=1, **common))
    elif kind == "qwen3":
        m = T.Qwen3ForCausalLM(T.Qwen3Config(num_hidden_layers=1, **common))
    else:
        m = T.Gemma3ForCausalLM(T.Gemma3TextConfig(num_hidden_layers=2, sliding_window=16, query_pre_attn_scalar=64,
                                                   layer_types=["sliding_attention", "full_attention"], **common))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.normal_(0, 0.5)
    return m.eval()


@pytest.fixture
def spm_dir(tmp_path):
    """A SentencePiece-style BPE tokenizer.json (byte fallback, ▁ for spaces), as Gemma-3 ships."""
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "<0x0A>": 4, "▁": 5, "a": 6, "b": 7, "ab": 8, "▁ab": 9}
    vocab.update({f"x{i}": i for i in range(10, 256)})
    added = [{"id": i, "content": t, "special": True} for t, i in list(vocab.items())[:4]]
    added.append({"id": 255, "content": "<start▁turn>", "special": False})
    d = tmp_path / "spm"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"], ["▁", "ab"]], "byte_fallback": True,
                   "unk_token": "<unk>"}, "added_tokens": added,
         "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]}}))
    return d


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3"])
def test_qwen_and_gemma3_files_read_back_exactly(kind, tok_dir, spm_dir, tmp_path):
    """Every tensor, quantized or not, reads back to exactly lowbit's weight; llama.cpp's names;
    Qwen's and Gemma's q/k rows unpermuted (NEOX RoPE); Gemma's norms stored as 1 + w."""
    model = _tiny(kind)
    qts, _ = quantize_for_gguf(model, "gguf-q4_k_m")
    out = write_gguf(model, qts, tmp_path / "m.gguf", tokenizer_dir=spm_dir if kind == "gemma3" else tok_dir,
                     name="tiny", add_bos=kind == "gemma3")
    load_checked(model, out)
    sd = model.state_dict()
    raw = read_gguf_weights(out, model.config, stored=True)
    back = read_gguf_weights(out, model.config)
    assert set(raw) == set(sd) - {"lm_head.weight"}
    r = gguf.GGUFReader(str(out))
    f = r.fields
    tensors = {t.name: t for t in r.tensors}
    arch = bytes(f["general.architecture"].parts[-1]).decode()
    assert arch == {"qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}[kind]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(back[q], sd[q])                         # rows in Hugging Face order, no permutation
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    norms = [n for n in sd if "norm" in n]
    for n in norms:
        stored = sd[n] + 1 if kind == "gemma3" else sd[n]
        assert torch.equal(raw[n], stored), n
        assert torch.allclose(back[n], sd[n], atol=1e-6), n
    names = set(tensors)
    if kind == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names
        assert torch.equal(raw["model.layers.0.self_attn.q_proj.bias"], sd["model.layers.0.self_attn.q_proj.bias"])
        assert bytes(f["tokenizer.ggml.pre"].parts[-1]).decode() == "qwen2"
    if kind in ("qwen3", "gemma3"):
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names
    if kind == "gemma3":
        assert {"blk.0.post_attention_norm.weight", "blk.0.ffn_norm.weight", "blk.0.post_ffw_norm.weight"} <= names
        swa = f["gemma3.attention.sliding_window_pattern"]
        assert [bool(swa.parts[i][0]) for i in swa.data] == [True, False]      # layer 0 sliding, layer 1 full
        assert int(f["gemma3.attention.sliding_window"].parts[-1][0]) == 16
        assert float(f["gemma3.rope.freq_base_swa"].parts[-1][0]) == 10000.0
        assert bytes(f["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
        toks = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
        types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
        scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
        assert toks[255] == "<start turn>" and types[255] == 4      # USER_DEFINED, ▁ pre-normalized
        assert types[1] == 3 and types[3] == 2 and types[4] == 6    # CONTROL, UNKNOWN, BYTE
        assert scores[8] == 0.0 and scores[9] == -1.0 and scores[6] == 0.0   # merge ranks, first merge highest
        assert bool(f["tokenizer.ggml.add_bos_token"].parts[-1][0])


def test_gemma3_refusals(spm_dir, tmp_path):
    model = _tiny("gemma3")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match="softcapping"):
        write_gguf(model, {}, tmp_path / "g.gguf", tokenizer_dir=spm_dir, name="g", add_bos=True)
    model.config.final_logit_softcapping = None
    model.config.query_pre_attn_scalar = 32
    with pytest.raises(NotImplementedError, match="query_pre_attn_scalar"):
        write_gguf(model, {}, tmp_path / "g.gguf", tokenizer_dir=spm_dir, name="g", add_bos=True)
    assert not (tmp_path / "g.gguf").exists()
