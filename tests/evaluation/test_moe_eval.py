"""Evaluation on tiny MoE models: compare, sensitivity by expert type, static scales of
expert inputs, and a saved MoE folder loaded as `lowbit compare` / `eval` load one."""

import torch

from lowbit.evaluation.analysis import sensitivity
from lowbit.evaluation.compare import Workbench, compare
from lowbit.models.experts import ExpertLinears
from lowbit.models.loading import ModelInfo, load_model
from lowbit.quantization.recipe import RECIPES


def _bench(model, tmp_path):
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, (3, 16), generator=g)
    calib = torch.randint(0, 256, (4, 16), generator=g)
    info = ModelInfo("tiny-moe", tmp_path / "model", False, "")
    return Workbench(model, None, info, windows, calib, "synthetic", 0, tmp_path / "cache", kl_topk=64, progress=False)


def test_compare_and_sensitivity_on_moe(tiny_moe, tmp_path):
    bench = _bench(tiny_moe, tmp_path)
    res = compare(bench, ["w8a16-int8", "w4a16-int4-tensor", "fp8-tensor", "w4a16-gptq-g64"])
    ref, int8, int4, fp8, gptq = (r.eval for r in res.rows)
    assert ref.kl_mean is None and 0 < int8.kl_mean < int4.kl_mean
    assert fp8.kl_mean > 0 and gptq.kl_mean > 0  # static expert-input scales; GPTQ per expert
    sens = sensitivity(bench, RECIPES["w4a16-int4-tensor"], by_layer=False)
    by_name = {r.target: r.row.eval.kl_mean for r in sens.rows}
    assert set(by_name) >= {"mlp.experts.*.gate_proj", "mlp.experts.*.up_proj", "mlp.experts.*.down_proj"}
    assert all(v > 0 for v in by_name.values())  # each glob quantized something


def test_moe_folder_loads_with_per_expert_linears(tiny_moe_builder, tmp_path, byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    model = tiny_moe_builder("mixtral")
    model.save_pretrained(tmp_path / "m")
    PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(["some text"] * 4), unk_token="<unk>",
                            bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "m")
    loaded, _, info = load_model(str(tmp_path / "m"))  # "unsupported architecture" before issue 21
    assert not info.needs_bos
    assert all(isinstance(layer.mlp.experts, ExpertLinears) for layer in loaded.model.layers)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
