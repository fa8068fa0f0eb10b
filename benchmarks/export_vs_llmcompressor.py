"""Tensor names, dtypes and shapes of lowbit's export against llm-compressor's, same scheme.

llm-compressor runs in its own virtual environment (it pins older transformers), never as
a lowbit dependency::

    make peers-venv   # .venv-llmc: torch 2.13.0, then llmcompressor 0.14.0.1
    .venv/bin/python benchmarks/export_vs_llmcompressor.py

Both sides quantize the packaged SmolLM2-135M by round-to-nearest (llm-compressor's
``QuantizationModifier``; lowbit's pipeline) and write bf16 checkpoints; the script prints,
per scheme, every tensor whose name, dtype or shape differs, and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

#: (llm-compressor scheme, lowbit recipe) — W4A16 uses groups of 64 on both sides, since
#: SmolLM2's in_features 576 is not a multiple of 128
PAIRS = (("FP8_DYNAMIC", "fp8-dynamic"), ("W4A16_G64", "w4a16-int4-g64"), ("NVFP4", "nvfp4"),
         ("W4A16", "w4a16-int4-g128"))

LLMC = r'''
import sys, json, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from compressed_tensors.quantization import QuantizationScheme, QuantizationArgs
src, out, scheme = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(src)
if scheme == "W4A16_G64":
    mod = QuantizationModifier(ignore=["lm_head"], config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                     group_size=64))})
else:
    mod = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
ids = torch.randint(3, 49000, (16, 64), generator=torch.Generator().manual_seed(0))
ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 64] * 16})
oneshot(model=model, dataset=ds, recipe=mod, num_calibration_samples=16, max_seq_length=64)
model.save_pretrained(out, save_compressed=True)
tok.save_pretrained(out)
'''


def listing(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def compare(ours: dict, theirs: dict) -> list[str]:
    diffs = [f"only lowbit: {k} {ours[k]}" for k in sorted(set(ours) - set(theirs))]
    diffs += [f"only llm-compressor: {k} {theirs[k]}" for k in sorted(set(theirs) - set(ours))]
    diffs += [f"differs: {k} lowbit {ours[k]} llm-compressor {theirs[k]}"
              for k in sorted(set(ours) & set(theirs)) if ours[k] != theirs[k]]
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default=str(Path(__file__).resolve().parent.parent / ".venv-llmc" / "bin" / "python"))
    ap.add_argument("--model", default=str(Path.home() / ".cache/lowbit/models/smollm2-135m"))
    ap.add_argument("--work", type=Path, default=None, help="keep both checkpoints here")
    ap.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = ap.parse_args()

    from lowbit.workflows import quantize_to_folder

    work = args.work or Path(tempfile.mkdtemp(prefix="llmc-vs-lowbit-"))
    report, failed = {}, False
    for llmc_scheme, recipe in PAIRS:
        theirs_dir, ours_dir = work / f"llmc-{llmc_scheme}", work / f"lowbit-{recipe}"
        run = subprocess.run([args.llmc_python, "-c", LLMC, args.model, str(theirs_dir), llmc_scheme],
                             capture_output=True, text=True)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{llmc_scheme}: llm-compressor failed: {last}")
        try:
            quantize_to_folder(args.model, recipe, ours_dir, force=True, calib_windows=4, evaluate=False,
                               progress=False)
            ours_err = None
        except ValueError as e:
            ours_err = str(e)
            print(f"{recipe}: lowbit refused: {e}")
        if run.returncode != 0 or ours_err:
            report[llmc_scheme] = {"llmc_error": run.returncode != 0 and last, "lowbit_error": ours_err}
            failed |= (run.returncode == 0) != (ours_err is None)  # one side wrote what the other refused
            continue
        ours, theirs = listing(ours_dir), listing(theirs_dir)
        diffs = compare(ours, theirs)
        qc_ours = json.loads((ours_dir / "config.json").read_text())["quantization_config"]
        qc_theirs = json.loads((theirs_dir / "config.json").read_text())["quantization_config"]
        fmt_same = qc_ours["format"] == qc_theirs["format"]
        print(f"{llmc_scheme} vs {recipe}: {len(ours)} / {len(theirs)} tensors, "
              f"{'identical names/dtypes/shapes' if not diffs else f'{len(diffs)} differences'}; "
              f"format {qc_ours['format']} / {qc_theirs['format']}")
        for d in diffs[:20]:
            print("   ", d)
        failed |= bool(diffs) or not fmt_same
        report[llmc_scheme] = {"recipe": recipe, "tensors": [len(ours), len(theirs)], "differences": diffs,
                               "format": [qc_ours["format"], qc_theirs["format"]]}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
