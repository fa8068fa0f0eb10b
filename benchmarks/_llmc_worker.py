"""llm-compressor side of ``benchmarks/vs_llmcompressor.py`` (issue 6).

Runs in llm-compressor's own virtual environment (never lowbit's): loads the model in
float32, quantizes it with one configuration through ``oneshot`` on the calibration
windows it is given, saves a compressed-tensors checkpoint (``save_compressed=True``)
and prints one JSON line: quantize wall seconds (``oneshot`` only), peak RSS of the
whole process (VmHWM) and the output folder.

    .venv-llmc/bin/python benchmarks/_llmc_worker.py CONFIG MODEL_DIR CALIB.safetensors OUT_DIR

Nothing from lowbit is imported here, and nothing here is part of lowbit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_common import copy_tokenizer_files, peak_rss_mib  # noqa: E402


def _cg(weights: dict | None, inputs: dict | None = None) -> dict:
    g = {"targets": ["Linear"], "weights": weights}
    if inputs is not None:
        g["input_activations"] = inputs
    return {"group_0": g}


INT4_G64 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
INT4_G64_ASYM = dict(INT4_G64, symmetric=False)
INT4_G128 = dict(INT4_G64, group_size=128)
INT4_G128_ASYM = dict(INT4_G128, symmetric=False)
KV_FP8 = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)


def recipe_for(config: str):
    """(modifiers, pipeline) for one configuration of the issue-6 table."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ign = ["lm_head"]
    int4 = {"g64": (INT4_G64, INT4_G64_ASYM), "g128": (INT4_G128, INT4_G128_ASYM)}
    for g, (sym, asym) in int4.items():
        if config == f"w4a16-rtn-{g}":
            return QuantizationModifier(config_groups=_cg(sym), ignore=ign), "independent"
        if config == f"w4a16-gptq-{g}":
            return GPTQModifier(config_groups=_cg(sym), ignore=ign), "sequential"
        if config == f"w4a16-awq-{g}-asym":
            from llmcompressor.modifiers.transform.awq import AWQModifier
            from llmcompressor.pipelines.cache import IntermediatesCache

            IntermediatesCache.pin_memory = lambda self, *a, **k: None  # CPU: pin_memory needs an accelerator
            return [AWQModifier(duo_scaling="both"),  # AWQ smooths its mappings only: no ignore list
                    QuantizationModifier(config_groups=_cg(asym), ignore=ign)], "sequential"
    if config == "w8a8-int8":
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ign), "independent"
    if config == "w8a8-int8-sq-gptq":
        return [SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=ign)], "sequential"
    if config == "fp8-dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ign), "independent"
    if config == "nvfp4":
        return QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=ign), "sequential"
    if config == "w4a16-nvfp4":
        return QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=ign), "independent"
    if config == "mxfp4":
        return QuantizationModifier(targets="Linear", scheme="MXFP4", ignore=ign), "independent"
    if config == "w4a16-mxfp4":
        return QuantizationModifier(targets="Linear", scheme="MXFP4A16", ignore=ign), "independent"
    if config == "kv-fp8":
        return QuantizationModifier(kv_cache_scheme=KV_FP8), "sequential"
    raise SystemExit(f"unknown configuration {config!r}")


def main() -> None:
    config, model_dir, calib_path, out_dir = sys.argv[1:5]
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = load_file(calib_path)["input_ids"]
    n, seq = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * n})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    recipe, pipeline = recipe_for(config)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=n, max_seq_length=seq,
            pipeline=pipeline)
    seconds = time.perf_counter() - t0
    out = Path(out_dir)
    model.save_pretrained(out, save_compressed=True)
    copy_tokenizer_files(Path(model_dir), out)
    print("LLMC_RESULT " + json.dumps({"config": config, "quantize_seconds": seconds, "peak_mib": peak_rss_mib(),
                                        "pipeline": pipeline, "out": str(out)}), flush=True)


if __name__ == "__main__":
    main()
