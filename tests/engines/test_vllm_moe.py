"""vLLM's CPU build on tiny MoE folders (marker ``vllm``; issue 21): the unquantized Qwen3-MoE
and Mixtral built from a config are scored by vLLM (its fused-MoE CPU path) and by lowbit's
loader on the same windows; the log-probabilities agree.  Which quantized MoE schemes the CPU
build runs: docs/moe.md.

Measured 2026-12-02 (vLLM CPU 0.32.0, AVX2-only): both pass (2 passed in 192 s).  vLLM's CPU
attention refuses head_dim 16 ("Unsupported CPU attention configuration: head_dim=16"), hence
head_dim 64 here."""


import pytest
import torch

from lowbit.engines.verify import EngineRequest, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _tokenizer(byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(["a small corpus of text"] * 4),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _windows(n=2, seq=16):
    return torch.randint(3, 256, (n, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _lowbit_scores(folder, windows):
    """lowbit's log-probabilities of each next token, and its top-1, from the folder."""
    from lowbit.models.loading import load_model

    model, _, _ = load_model(str(folder))
    logp = model(windows).logits.float().log_softmax(-1)[:, :-1]
    target = logp.gather(-1, windows[:, 1:, None])[..., 0]
    return target, logp.argmax(-1)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_vllm_cpu_runs_the_unquantized_tiny_moe_as_lowbit_does(vllm_python, tiny_moe_builder, kind, tmp_path,
                                                               byte_bpe_tokenizer):
    folder = tmp_path / kind
    tiny_moe_builder(kind, head_dim=64).save_pretrained(folder)  # float32: vLLM runs it in float32 (engine_dtype)
    _tokenizer(byte_bpe_tokenizer).save_pretrained(folder)
    windows = _windows()
    req = EngineRequest(str(folder), "float32", 8, windows.shape[1] + 1)
    scores, facts, _ = run_engine(vllm_python, req, windows, tmp_path / "vllm.log", timeout=900)
    target, top1 = _lowbit_scores(folder, windows)
    assert facts["dtype"] == "float32", facts
    diff = (torch.from_numpy(scores.target) - target).abs()
    assert float(diff.max()) < 1e-3, float(diff.max())  # the same function, up to float32 summation order
    assert (torch.from_numpy(scores.topk_ids[..., 0]) == top1).float().mean() > 0.95
