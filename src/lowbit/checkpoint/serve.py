"""How to serve an exported folder: the vLLM and SGLang commands, and which GPUs run each
compressed-tensors scheme natively (as data, one row per scheme)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NATIVE_GPUS", "ServePlan", "serve_plan", "serve_commands"]

#: (format, weights quantized with activations?) → where it runs natively, and elsewhere
NATIVE_GPUS: dict[tuple[str, bool], tuple[str, str]] = {
    ("float-quantized", True): (
        "FP8 tensor cores: Ada (L40S, RTX 4090), Hopper (H100, H200), Blackwell (B200), MI300X",
        "Ampere (A100) has no FP8: vLLM runs the weights through FP8 Marlin (weight-only, BF16 math)"),
    ("float-quantized", False): (
        "FP8 Marlin weight-only kernels on Ampere and later",
        "-"),
    ("int-quantized", True): (
        "INT8 tensor cores: Ampere (A100), Ada (L40S, RTX 4090), Hopper (H100, H200), MI300X",
        "Blackwell runs INT8 at reduced rate"),
    ("pack-quantized", False): (
        "Marlin (Ampere and later; Machete on Hopper): 4/8-bit weights, BF16 math",
        "Layers whose in_features is not a multiple of 128 (or out_features of 64) fall back to slower kernels"),
    ("nvfp4-pack-quantized", True): (
        "FP4 tensor cores: Blackwell (B200, GB200, RTX 50xx)",
        "Hopper/Ampere: vLLM runs NVFP4 weights weight-only (FP4 Marlin), activations stay BF16"),
    ("nvfp4-pack-quantized", False): (
        "Blackwell natively; FP4 Marlin (weight-only) on Ampere/Hopper",
        "-"),
    ("mxfp4-pack-quantized", True): (
        "MX tensor cores: Blackwell (B200), MI355X",
        "older GPUs: weight-only emulation or unsupported, depending on the vLLM version"),
    ("mxfp4-pack-quantized", False): (
        "Blackwell natively; MXFP4 Marlin (weight-only) on Ampere/Hopper in recent vLLM",
        "-"),
}


@dataclass(frozen=True)
class ServePlan:
    """Commands to serve a folder and, per config group, where its scheme runs natively."""

    vllm: str
    sglang: str
    kv_fp8: bool
    schemes: tuple[tuple[str, str, str], ...]  # (group description, native on, elsewhere)

    def text(self) -> str:
        lines = ["vLLM:", f"  {self.vllm}", "SGLang:", f"  {self.sglang}", ""]
        for desc, native, other in self.schemes:
            lines.append(f"{desc}: native on {native}")
            if other != "-":
                lines.append(f"  elsewhere: {other}")
        if self.kv_fp8:
            lines.append("KV cache: FP8 E4M3 with the calibrated k_scale/v_scale in the checkpoint "
                         "(without --kv-cache-dtype fp8 the scales are ignored and the cache stays BF16)")
        return "\n".join(lines)


def serve_commands(folder: Path | str, kv_fp8: bool, max_model_len: int = 4096, tp: int = 1) -> tuple[str, str]:
    """The vLLM and SGLang commands that serve ``folder`` (an FP8 KV cache needs its flag)."""
    path = shlex.quote(str(folder))
    par = f" --tensor-parallel-size {tp}" if tp > 1 else ""
    vllm = f"vllm serve {path} --max-model-len {max_model_len}{par}" + (" --kv-cache-dtype fp8" if kv_fp8 else "")
    sglang = f"python -m sglang.launch_server --model-path {path}" + (f" --tp-size {tp}" if tp > 1 else "") + \
        (" --kv-cache-dtype fp8_e4m3" if kv_fp8 else "")
    return vllm, sglang


def serve_plan(folder: Path, max_model_len: int = 4096) -> ServePlan:
    """The serving commands for an exported compressed-tensors folder.

    Raises:
        FileNotFoundError: no ``config.json`` in ``folder``.
        ValueError: the config has no compressed-tensors ``quantization_config``.
    """
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{folder} is not a compressed-tensors checkpoint (quantization_config.quant_method is "
                         f"{qc.get('quant_method')!r}); write one with `lowbit quantize`")
    kv = qc.get("kv_cache_scheme") is not None
    vllm, sglang = serve_commands(folder, kv, max_model_len)
    schemes = []
    for name, g in sorted(qc.get("config_groups", {}).items()):
        fmt, acts = g.get("format") or qc.get("format"), g.get("input_activations") is not None
        w = g["weights"]
        desc = f"{name} ({fmt}, W{w['num_bits']}{'A' + str(g['input_activations']['num_bits']) if acts else 'A16'} " \
               f"{w['type']} {w['strategy']}{'' if w.get('group_size') is None else ' ' + str(w['group_size'])})"
        native, other = NATIVE_GPUS.get((fmt, acts), ("unknown for this scheme", "-"))
        schemes.append((desc, native, other))
    return ServePlan(vllm, sglang, kv, tuple(schemes))
