"""GPTQModel side of ``benchmarks/vs_peers.py`` (issue 18).

Runs in GPTQModel's own virtual environment (``.venv-gptqmodel``, ``make peers-venv``; on a 2-core machine it
needs ``GPTQMODEL_CPU_WORKERS=2``, which ``vs_peers.py`` sets), never in lowbit's.  Quantizes the
model with GPTQModel's GPTQ on the calibration windows it is given — ``default``: GPTQModel's
own defaults for everything but bits / group size / symmetry, which in 7.6.0 means
activation-group-aware ordering (GAR: ``act_group_aware=True``, ``desc_act=False``); ``desc``:
classic activation order (``desc_act=True``, ``act_group_aware=False``); ``plain``: neither —
and saves its checkpoint.

lowbit does not read GPTQ-format checkpoints, so this worker reloads the checkpoint with
GPTQModel's own CPU kernel, asks each quantized module for its dequantized weight
(``dequantize_weight``), checks that every group holds at most ``2**bits`` distinct values, and
writes a dense float32 copy of the model with those weights (``OUT``; dequantized in fp16, the CPU
kernel's widest dtype); the GPTQ checkpoint stays
beside it (``OUT.gptq``).  The time reported is ``quantize`` alone; the peak RSS is the whole
process's (VmHWM) before the reload.

    GPTQMODEL_CPU_WORKERS=2 .venv-gptqmodel/bin/python benchmarks/_gptqmodel_worker.py \\
        w4a16-g64-sym:default MODEL_DIR CALIB.safetensors OUT

Nothing from lowbit is imported here, and nothing here is part of lowbit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peer_common import copy_tokenizer_files, max_group_levels, parse_config, peak_rss_mib  # noqa: E402

SCHEMES = {
    "w4a16-g64-sym": dict(bits=4, group_size=64, sym=True),
    "w4a16-g64-asym": dict(bits=4, group_size=64, sym=False),
    "w4a16-g128-sym": dict(bits=4, group_size=128, sym=True),
    "w4a16-g128-asym": dict(bits=4, group_size=128, sym=False),
    "w2a16-g64-sym": dict(bits=2, group_size=64, sym=True),
}
ORDERINGS = {"default": {}, "desc": dict(act_group_aware=False, desc_act=True),
             "plain": dict(act_group_aware=False, desc_act=False)}


def dense_copy(gptq_dir: Path, model_dir: Path, out: Path, bits: int, group_size: int) -> dict:
    """Dequantize every quantized module with GPTQModel's kernel; write a dense float32 model."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoModelForCausalLM

    # GPTQModel's CPU kernel runs in fp16 or bf16 only; fp16 keeps the checkpoint's fp16 scales exact
    # (each code × scale product rounds at 2^-11 relative, far below the 4-bit error)
    q = GPTQModel.load(str(gptq_dir), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    dense = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = dict(dense.named_modules())
    n, worst = 0, 0
    for name, mod in q.model.named_modules():
        if not hasattr(mod, "dequantize_weight"):
            continue
        w = mod.dequantize_weight().to(torch.float32)  # (in, out)
        lin = targets[name]
        if tuple(w.shape) == tuple(lin.weight.shape[::-1]):
            w = w.t()
        if tuple(w.shape) != tuple(lin.weight.shape):
            raise SystemExit(f"{name}: dequantized shape {tuple(w.shape)} != {tuple(lin.weight.shape)}")
        # a group is the columns sharing a g_idx entry: contiguous runs in GAR / plain order, scattered in
        # activation order (desc_act)
        levels = max_group_levels(w, group_size, getattr(mod, "g_idx", None))
        worst = max(worst, levels)
        if levels > 2 ** bits:
            raise SystemExit(f"{name}: a group has {levels} distinct values, more than {2 ** bits}")
        lin.weight.data.copy_(w)
        n += 1
    if not n:
        raise SystemExit(f"no quantized module with dequantize_weight() in {gptq_dir}")
    dense.save_pretrained(str(out))
    return {"dequantized_modules": n, "max_levels_per_group": worst}


def main() -> None:
    config, model_dir, calib_path, out_dir = sys.argv[1:5]
    kwargs, variant, ordering = parse_config(config, SCHEMES, ORDERINGS, "GPTQModel")
    kwargs.update(ordering)
    out, model_dir, calib_path = (str(Path(x).resolve()) for x in (out_dir, model_dir, calib_path))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.chdir(out.parent)  # GPTQModel writes a logs/ folder into the working directory
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from safetensors.torch import load_file

    ids = load_file(calib_path)["input_ids"]
    data = [{"input_ids": ids[i].tolist(), "attention_mask": [1] * ids.shape[1]} for i in range(ids.shape[0])]
    qcfg = QuantizeConfig(**kwargs)
    kwargs.update(desc_act=qcfg.desc_act, act_group_aware=qcfg.act_group_aware, damp_percent=qcfg.damp_percent)
    model = GPTQModel.load(model_dir, qcfg, device="cpu", dtype=torch.float32)
    t0 = time.perf_counter()
    model.quantize(data, batch_size=1)
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib()
    gptq_dir = out.with_name(out.name + ".gptq")
    model.save(str(gptq_dir))
    check = dense_copy(gptq_dir, Path(model_dir), out, kwargs["bits"], kwargs["group_size"])
    copy_tokenizer_files(Path(model_dir), out)
    print("PEER_RESULT " + json.dumps({"config": config, "variant": variant, "quantize_seconds": seconds,
                                        "peak_mib": peak, "out": str(out), "quantize_config": kwargs,
                                        "note": f"GPTQModel {variant}; dense copy of GPTQModel's dequantized weights",
                                        **check}), flush=True)


if __name__ == "__main__":
    main()
