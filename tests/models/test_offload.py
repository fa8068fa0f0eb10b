"""Lazily loaded models: decoder layers on disk, one in memory at a time, and the same
quantization as the in-memory model."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.models.arch import decoder_layers
from lowbit.models.offload import LayerStore, is_lazy, load_lazy
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.runtime import plain_forward, quantized_execution


@pytest.fixture
def calib():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (8, 24), generator=g)


def _save(model, folder):
    model.save_pretrained(folder)
    return folder


def _shard(folder):
    """Rewrite a single-file checkpoint as one shard per tensor group, with an index."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


@pytest.mark.parametrize("sharded", [False, True])
def test_lazy_model_loads_layers_on_demand(tiny_model, windows, tmp_path, sharded):
    folder = _save(tiny_model, tmp_path / "m")
    if sharded:
        _shard(folder)
    lazy = load_lazy(folder)
    assert is_lazy(lazy)
    assert all(p.is_meta for layer in decoder_layers(lazy) for p in layer.parameters())
    assert not lazy.get_input_embeddings().weight.is_meta
    with LayerStore(lazy, folder, work=tmp_path / "work") as store:
        assert store.loaded == set()
        store.load(1)
        assert store.loaded == {1}
        store.release(1)
        assert (tmp_path / "work" / "layer-00001.safetensors").exists()
        assert all(p.is_meta for p in decoder_layers(lazy)[1].parameters())
        store.materialize()
    assert not is_lazy(lazy)
    _same_params(lazy, tiny_model)
    with torch.no_grad():
        assert torch.equal(plain_forward(lazy)(windows[:2]), plain_forward(tiny_model)(windows[:2]))


@pytest.mark.parametrize("recipe", ["w4a16-gptq-g64", "w8a8-int8-static-sq", "w4a16-awq-g64-asym", "nvfp4-rot-gptq",
                                    "w4a16-int4-g128", "nvfp4"])
def test_lazy_quantization_equals_in_memory(tiny_llama, windows, calib, tmp_path, recipe):
    r = RECIPES[recipe]
    folder = _save(tiny_llama, tmp_path / "m")
    eager = copy.deepcopy(tiny_llama)
    needs_stats = r.needs_calibration and not r.algorithms.layerwise
    stats = None
    if needs_stats:
        from lowbit.quantization.calibrate import collect_stats

        stats = collect_stats(eager, calib, progress=False, workers=1)
    kw = {"calibration": calib} if r.algorithms.layerwise else {}
    want = quantize(eager, r, stats=stats, keep_qtensors=True, progress=False, **kw)
    lazy = load_lazy(folder)
    with LayerStore(lazy, folder) as store:
        got = quantize(lazy, r, stats=stats, keep_qtensors=True, progress=False, store=store, **kw)
        assert store.peak_loaded == 1
        assert store.loaded == set()  # every layer released when done
        if r.algorithms.layerwise:  # the embeddings and lm_head too, after the first layer's inputs
            assert lazy.get_input_embeddings().weight.is_meta
        store.materialize()
    _same_params(lazy, eager)
    if eager.get_output_embeddings().weight is eager.get_input_embeddings().weight:
        assert lazy.get_output_embeddings().weight is lazy.get_input_embeddings().weight
    assert got.weights.keys() == want.weights.keys()
    for n in want.weights:
        assert torch.equal(got.weights[n].codes, want.weights[n].codes), n
    assert got.activations.keys() == want.activations.keys()
    with torch.no_grad(), quantized_execution(lazy, got) as f1, quantized_execution(eager, want) as f2:
        assert torch.equal(f1(windows[:2]), f2(windows[:2]))


def test_lazy_gemma3_with_kv_and_rotated_down_proj(tiny_gemma3, windows, calib, tmp_path):
    r = recipe_from_dict({"weights": "int4-g32", "inputs": "int8-token", "kv_cache": {"scheme": "fp8-tensor"},
                          "algorithms": {"gptq": {}, "rotation": {"residual": False}}})
    folder = _save(tiny_gemma3, tmp_path / "m")
    eager = copy.deepcopy(tiny_gemma3)
    want = quantize(eager, r, calibration=calib, progress=False)
    lazy = load_lazy(folder)
    with LayerStore(lazy, folder) as store:
        got = quantize(lazy, r, calibration=calib, progress=False, store=store)
        store.materialize()
    _same_params(lazy, eager)
    assert got.kv.k_amax.keys() == want.kv.k_amax.keys()
    for layer in want.kv.k_amax:
        assert torch.equal(got.kv.k_amax[layer], want.kv.k_amax[layer])


def test_lazy_model_needs_its_store(tiny_llama, calib, tmp_path):
    lazy = load_lazy(_save(tiny_llama, tmp_path / "m"))
    with pytest.raises(ValueError, match="LayerStore"):
        quantize(lazy, RECIPES["w4a16-gptq-g64"], calibration=calib, progress=False)
    with pytest.raises(ValueError, match="LayerStore"):
        quantize(lazy, RECIPES["w4a16-int4-g128"], progress=False)


def test_missing_tensors_and_closed_store(tiny_llama, tmp_path):
    folder = _save(tiny_llama, tmp_path / "m")
    lazy = load_lazy(folder)
    store = LayerStore(lazy, folder)
    store.load(0)
    store.release(0)
    work = store.work
    store.close()
    assert not work.exists()
    with pytest.raises(RuntimeError, match="removed"):
        store.load(0)

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LayerStore(load_lazy(folder), folder).load(1)
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_lazy(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_lazy(folder)
