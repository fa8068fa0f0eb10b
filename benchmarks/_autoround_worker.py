"""AutoRound side of ``benchmarks/vs_peers.py`` (issue 18).

Runs in a virtual environment that has auto-round (llm-compressor's venv has auto-round 0.15.1:
``.venv-llmc``, ``make peers-venv``), never in lowbit's.  Loads the model in float32, quantizes it with one
configuration and one of AutoRound's recipes (``light``, ``default``, ``best``: the iteration
counts and learning rates of AutoRound's own ``auto-round-light`` / ``auto-round`` /
``auto-round-best`` commands) on the calibration windows it is given, saves a
compressed-tensors checkpoint (AutoRound's ``llm_compressor`` export) and prints one JSON
line: quantize wall seconds (``quantize_and_save``), peak RSS of the whole process (VmHWM)
and the output folder.

AutoRound 0.15.1's compressed-tensors packer fails, after the first layer's tuning, in two cases:
a group that does not divide a Linear's input width (SmolLM2's 576 columns at g128; AutoRound tunes
with a padded last group, ``reshape_pad_tensor_by_group_size``, the ragged group lowbit and
compressed-tensors define too) and asymmetric schemes (its zero points are not int8 when packed).
There the worker saves AutoRound's ``fake`` export (the dense quantized-dequantized weights) and
checks that no group of any quantized Linear holds more than ``2**bits`` distinct values.

For MXFP4 and NVFP4 the weights are tuned with 16-bit activations (W4A16), but AutoRound's
compressed-tensors export writes the W4A4 preset's config whatever the activations were
(``export_to_fp.py`` builds it from the weight format alone), so the checkpoint declares 4-bit input
activations; lowbit's evaluator judges its stored weights only, which is the W4A16 model that was tuned.
``w4a4-nvfp4`` is the W4A4 preset as AutoRound defines it; ``vs_peers.py`` evaluates that checkpoint
with NVFP4 input quantization and its stored ``input_global_scale``.

    .venv-llmc/bin/python benchmarks/_autoround_worker.py w4a16-g64-sym:light MODEL_DIR CALIB.safetensors OUT

The protocol fixes the calibration set (128 windows × 512 tokens), so ``best`` runs AutoRound's
1000 iterations on those 128 windows, not on the 512 samples of 2048 tokens its command takes.

Nothing from lowbit is imported here, and nothing here is part of lowbit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_common import copy_tokenizer_files, max_group_levels, parse_config, peak_rss_mib  # noqa: E402

#: AutoRound's command-line recipes (auto_round/cli/main.py RECIPES), without their
#: sequence length and sample count, which the protocol sets
RECIPES = {"light": {"iters": 50, "lr": 5e-3}, "default": {"iters": 200, "lr": None},
           "best": {"iters": 1000, "lr": None}}

#: configuration → AutoRound scheme arguments
SCHEMES = {
    "w4a16-g64-sym": dict(scheme="W4A16", bits=4, group_size=64, sym=True),
    "w4a16-g64-asym": dict(scheme="W4A16", bits=4, group_size=64, sym=False),
    "w4a16-g128-sym": dict(scheme="W4A16", bits=4, group_size=128, sym=True),
    "w4a16-g128-asym": dict(scheme="W4A16", bits=4, group_size=128, sym=False),
    "w2a16-g64-sym": dict(scheme="W2A16G64", bits=2, group_size=64, sym=True),
    # AutoRound's MXFP4 / NVFP4 presets quantize activations too, and an ``act_bits=16`` beside them is
    # reset to 4 (their ``act_data_type`` wins); weights only here, so the activation type is unset too
    "w4a16-mxfp4": dict(scheme="MXFP4", act_bits=16, act_data_type="float"),
    "w4a16-nvfp4": dict(scheme="NVFP4", act_bits=16, act_data_type="float"),
    # the NVFP4 preset as it is: activations quantized while tuning (dynamic FP8 block scales, a static
    # global scale from the calibration's absmax, stored as input_global_scale)
    "w4a4-nvfp4": dict(scheme="NVFP4"),
}


def main() -> None:
    config, model_dir, calib_path, out_dir = sys.argv[1:5]
    iters_override = int(sys.argv[5]) if len(sys.argv) > 5 else None  # smoke tests only
    scheme, recipe, hyper = parse_config(config, SCHEMES, RECIPES, "AutoRound")
    import torch
    from auto_round import AutoRound
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_file(calib_path)["input_ids"]
    n, seq = ids.shape
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    iters = iters_override if iters_override is not None else hyper["iters"]
    kwargs = dict(scheme, iters=iters, nsamples=n, seqlen=seq, batch_size=min(8, n), seed=42,
                  dataset=[ids[i:i + 1] for i in range(n)], device_map="cpu")
    if hyper["lr"] is not None:
        kwargs["lr"] = hyper["lr"]
    out = Path(out_dir)
    group = scheme.get("group_size")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    ragged = bool(group) and any(m.in_features % group for m in linears.values())
    asym = scheme.get("sym") is False
    fmt = "fake" if ragged or asym else "llm_compressor"
    t0 = time.perf_counter()
    ar = AutoRound(model, tokenizer=tok, **kwargs)
    ar.quantize_and_save(str(out), format=fmt)
    seconds = time.perf_counter() - t0
    if not (out / "config.json").exists():  # AutoRound writes into OUT/<model>-w<bits>g<group>/
        inner = [d for d in out.iterdir() if (d / "config.json").exists()]
        if len(inner) != 1:
            raise SystemExit(f"no single checkpoint folder under {out}: {[d.name for d in out.iterdir()]}")
        for f in inner[0].iterdir():
            f.replace(out / f.name)
        inner[0].rmdir()
    copy_tokenizer_files(Path(model_dir), out)
    extra = {}
    if fmt == "fake":  # what was saved, every quantized Linear's weight, must lie on the grid
        saved = {}
        for f in out.glob("*.safetensors"):
            saved.update(load_file(str(f)))
        missing = [n for n in linears if f"{n}.weight" not in saved]
        if missing:
            raise SystemExit(f"AutoRound's fake export lacks {len(missing)} quantized weights, e.g. {missing[0]}")
        levels = max(max_group_levels(saved[f"{n}.weight"], group) for n in linears)
        if levels > 2 ** scheme["bits"]:
            raise SystemExit(f"AutoRound's fake export: a group holds {levels} distinct values, more than "
                             f"{2 ** scheme['bits']}: the weights are not on the grid")
        extra = {"max_levels_per_group": levels,
                 "note": "AutoRound's fake export (" + ("asymmetric zero points" if asym else
                                                       f"group {group} does not divide every input width") + ")"}
    print("PEER_RESULT " + json.dumps({"config": config, "recipe": recipe, "iters": iters, "quantize_seconds": seconds,
                                        "peak_mib": peak_rss_mib(), "out": str(out),
                                        "autoround_kwargs": {k: v for k, v in kwargs.items() if k != "dataset"},
                                        "format": fmt, **extra}),
          flush=True)


if __name__ == "__main__":
    main()
