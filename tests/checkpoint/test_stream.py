"""Writing a checkpoint layer by layer from a lazily loaded model, the layer passes by replay
(``algorithms.recompute``, as ``--low-memory`` runs them): the same tensors as the in-memory
export in lockstep, in one shard per decoder layer, read back by compressed-tensors."""

import json
from dataclasses import replace

import pytest
import torch

from lowbit.checkpoint.write import checkpoint_tensors, export
from lowbit.models.loading import read_into
from lowbit.checkpoint.stream import LayerwiseExport
from lowbit.quantization.layerwise import quantize_layerwise
from lowbit.models.offload import LayerStore, checkpoint_files, load_lazy, read_tensors
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402


def _wide_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _calib():
    return torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))


def _in_memory(model, recipe):
    if recipe.needs_calibration or recipe.algorithms.layerwise:
        return quantize_layerwise(model, recipe, _calib(), keep_qtensors=True, progress=False)
    return quantize(model, recipe, keep_qtensors=True, progress=False)


def _streamed(folder, recipe, out):
    """As ``lowbit quantize --low-memory`` runs it: lazily loaded, the layer passes by replay."""
    recipe = replace(recipe, algorithms=replace(recipe.algorithms, recompute=True))
    model = load_lazy(folder)
    with LayerStore(model, folder) as store, LayerwiseExport(out, model, recipe, dtype=torch.float32) as ex:
        if recipe.needs_calibration or recipe.algorithms.layerwise:
            state = quantize_layerwise(model, recipe, _calib(), keep_qtensors=True, progress=False, store=store,
                                       on_layer=ex.layer_done)
        else:
            state = quantize(model, recipe, keep_qtensors=True, progress=False, store=store,
                             on_layer=ex.layer_done)
        assert store.peak_loaded == 1
        assert not any(n.startswith("model.layers.") for n in state.weights)  # dropped once written
        res = ex.finish(state, store=store, source=folder)
    return res


@pytest.mark.parametrize("name", ["fp8-dynamic", "w4a16-int4-g128", "nvfp4", "w4a16-gptq-g64", "kv-fp8", "w4a16-gptq-ro-g64",
                                  "w8a8-int8-static-sq"])
def test_streamed_export_equals_in_memory_export(tmp_path, name):
    recipe = RECIPES[name]
    src = _wide_llama()
    src.save_pretrained(tmp_path / "src")
    eager = _wide_llama()
    state = _in_memory(eager, recipe)
    whole = export(eager, state, tmp_path / "whole", dtype=torch.float32)
    res = _streamed(tmp_path / "src", recipe, tmp_path / "streamed")

    files = checkpoint_files(tmp_path / "streamed")
    assert len(set(files.values())) == 4  # one shard per decoder layer and one for the rest
    got = read_tensors(files, list(files))
    want, _ = checkpoint_tensors(eager, state, torch.float32)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    qc = json.loads((tmp_path / "streamed" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((tmp_path / "whole" / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert (res.sizes.quantized_bytes, res.sizes.predicted_bytes) == (whole.sizes.quantized_bytes,
                                                                      whole.sizes.predicted_bytes)

    # compressed-tensors decompresses the shards as it does the single file
    back = dict(read_into(_wide_llama(), tmp_path / "streamed").named_parameters())
    for n, p in read_into(_wide_llama(), tmp_path / "whole").named_parameters():
        assert torch.equal(back[n], p), n


def test_streamed_export_refuses_before_work(tmp_path):
    src = _wide_llama()
    src.save_pretrained(tmp_path / "src")
    (tmp_path / "out").mkdir()
    model = load_lazy(tmp_path / "src")
    with pytest.raises(FileExistsError, match="--force"):
        with LayerwiseExport(tmp_path / "out", model, RECIPES["fp8-dynamic"]):
            pass
    with pytest.raises(Exception, match="rotation"):
        LayerwiseExport(tmp_path / "new", model, RECIPES["nvfp4-rot-gptq"])
    with pytest.raises(RuntimeError, match="finish"):
        with LayerwiseExport(tmp_path / "new", model, RECIPES["fp8-dynamic"]):
            pass
    assert not (tmp_path / "new").exists()
