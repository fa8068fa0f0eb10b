"""GPUs as data: peaks per math lane, memory, bandwidth and achieved efficiencies.

The table lives in ``lowbit/sim/gpus.yaml``; every number there names its source.  This
module only reads and validates it: unknown keys are errors that name the key path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from ..util.validate import check_keys

__all__ = ["LANES", "GPU", "Kernels", "HardwareTable", "load_hardware", "get_gpu"]

#: the tensor-core math lanes a matmul can run on
LANES = ("bf16", "fp8", "int8", "fp4")

_GPU_KEYS = {
    "name", "peak_tflops", "memory_gib", "bandwidth_tbps", "interconnect_gbps", "native",
    "step_overhead_ms", "seq_overhead_us", "vllm_large_defaults", "source",
}


@dataclass(frozen=True)
class GPU:
    """One GPU.

    Attributes:
        key: the table key (``h100``).
        name: the marketing name.
        peak_tflops: dense peak per lane, TFLOPS (TOPS for int8); lanes absent are not native.
        memory_gib: device memory, GiB (2**30 bytes).
        bandwidth_tbps: peak memory bandwidth, TB/s.
        interconnect_gbps: GPU-to-GPU bandwidth per direction, GB/s (all-reduce).
        step_overhead_ms: fixed cost of one engine step (scheduling, launches) on this GPU's host.
        seq_overhead_us: cost per sequence in a step (input preparation, sampling).
        vllm_large_defaults: vLLM gives this GPU the large batch defaults (8192 tokens, 1024 seqs).
        compute_efficiency: achieved fraction of each lane's peak in compute-bound GEMMs.
        memory_efficiency: achieved fraction of peak bandwidth.
        source: where the numbers come from.
    """

    key: str
    name: str
    peak_tflops: dict[str, float]
    memory_gib: float
    bandwidth_tbps: float
    interconnect_gbps: float
    native: tuple[str, ...]
    step_overhead_ms: float
    seq_overhead_us: float
    vllm_large_defaults: bool
    compute_efficiency: dict[str, float] = field(default_factory=dict)
    memory_efficiency: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        where = f"gpus.{self.key}"
        if "bf16" not in self.peak_tflops:
            raise ValueError(f"{where}.peak_tflops: a bf16 peak is required")
        for lane, v in self.peak_tflops.items():
            if lane not in LANES:
                raise ValueError(f"{where}.peak_tflops: unknown lane {lane!r}; lanes are {LANES}")
            _positive(f"{where}.peak_tflops.{lane}", v)
        for name in ("memory_gib", "bandwidth_tbps", "interconnect_gbps"):
            _positive(f"{where}.{name}", getattr(self, name))
        for name in ("step_overhead_ms", "seq_overhead_us"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{where}.{name}: must be a finite number >= 0, got {getattr(self, name)!r}")
        for lane in self.peak_tflops:
            eff = self.compute_efficiency.get(lane)
            if eff is None or not 0 < eff <= 1:
                raise ValueError(f"{where}: compute efficiency for lane {lane!r} must be in (0, 1], got {eff!r}")
        if not 0 < self.memory_efficiency <= 1:
            raise ValueError(f"{where}: memory efficiency must be in (0, 1], got {self.memory_efficiency!r}")

    def has_lane(self, lane: str) -> bool:
        return lane in self.peak_tflops

    def achieved_flops(self, lane: str) -> float:
        """Achieved FLOP/s of ``lane`` (peak × efficiency)."""
        return self.peak_tflops[lane] * 1e12 * self.compute_efficiency[lane]

    @property
    def achieved_bandwidth(self) -> float:
        """Achieved bytes/s (peak × efficiency)."""
        return self.bandwidth_tbps * 1e12 * self.memory_efficiency

    def to_dict(self) -> dict:
        return {
            "key": self.key, "name": self.name, "peak_tflops": dict(self.peak_tflops),
            "memory_gib": self.memory_gib, "bandwidth_tbps": self.bandwidth_tbps,
            "interconnect_gbps": self.interconnect_gbps, "native": list(self.native),
            "step_overhead_ms": self.step_overhead_ms, "seq_overhead_us": self.seq_overhead_us,
            "compute_efficiency": dict(self.compute_efficiency),
            "memory_efficiency": self.memory_efficiency, "source": self.source,
        }


@dataclass(frozen=True)
class Kernels:
    """Kernel-level costs shared by all GPUs (see the ``kernels`` section of gpus.yaml).

    Attributes:
        weight_only_efficiency: compute efficiency of weight-only (W4A16/W8A16) GEMMs on the BF16 lane.
        weight_only_linear_us: extra time per weight-only linear launch (dequantize, Marlin floor).
        activation_quant_us: one dynamic activation-quantization kernel, per distinct linear input.
        layer_overhead_us: small kernels per layer (norms, rope, residuals).
    """

    weight_only_efficiency: float
    weight_only_linear_us: float
    activation_quant_us: float
    layer_overhead_us: float

    def __post_init__(self) -> None:
        if not 0 < self.weight_only_efficiency <= 1:
            raise ValueError(f"kernels.weight_only.compute_efficiency must be in (0, 1], got {self.weight_only_efficiency}")
        for name in ("weight_only_linear_us", "activation_quant_us", "layer_overhead_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"kernels: {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class HardwareTable:
    gpus: dict[str, GPU]
    kernels: Kernels

    def gpu(self, key: str) -> GPU:
        try:
            return self.gpus[key.lower()]
        except KeyError:
            raise ValueError(f"unknown GPU {key!r}; known: {', '.join(self.gpus)}") from None


def _positive(where: str, v) -> None:
    if not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
        raise ValueError(f"{where}: must be a positive number, got {v!r}")


def parse_hardware(doc: dict) -> HardwareTable:
    """A :class:`HardwareTable` from the parsed YAML document (strict keys)."""
    check_keys(doc, {"efficiency", "kernels", "gpus"}, "gpus.yaml")
    eff = doc["efficiency"]
    check_keys(eff, {"compute", "memory", "source"}, "efficiency")
    k = doc["kernels"]
    check_keys(k, {"weight_only", "activation_quant_us", "activation_quant_source",
                "layer_overhead_us", "layer_overhead_source"}, "kernels")
    check_keys(k["weight_only"], {"compute_efficiency", "linear_overhead_us", "source"}, "kernels.weight_only")
    kernels = Kernels(
        weight_only_efficiency=float(k["weight_only"]["compute_efficiency"]),
        weight_only_linear_us=float(k["weight_only"]["linear_overhead_us"]),
        activation_quant_us=float(k["activation_quant_us"]),
        layer_overhead_us=float(k["layer_overhead_us"]),
    )
    gpus = {}
    for key, g in doc["gpus"].items():
        check_keys(g, _GPU_KEYS, f"gpus.{key}")
        missing = _GPU_KEYS - {"source"} - set(g)
        if missing:
            raise ValueError(f"gpus.{key}: missing key(s) {sorted(missing)}")
        gpus[key] = GPU(
            key=key, name=g["name"], peak_tflops={k2: float(v) for k2, v in g["peak_tflops"].items()},
            memory_gib=float(g["memory_gib"]), bandwidth_tbps=float(g["bandwidth_tbps"]),
            interconnect_gbps=float(g["interconnect_gbps"]), native=tuple(g["native"]),
            step_overhead_ms=float(g["step_overhead_ms"]), seq_overhead_us=float(g["seq_overhead_us"]),
            vllm_large_defaults=bool(g["vllm_large_defaults"]),
            compute_efficiency={lane: float(eff["compute"][lane]) for lane in g["peak_tflops"] if lane in eff["compute"]},
            memory_efficiency=float(eff["memory"]), source=str(g.get("source", "")),
        )
    return HardwareTable(gpus=gpus, kernels=kernels)


@lru_cache(maxsize=4)
def _load(path: str | None) -> HardwareTable:
    if path is None:
        text = resources.files("lowbit.sim").joinpath("gpus.yaml").read_text()
    else:
        text = Path(path).read_text()
    return parse_hardware(yaml.safe_load(text))


def load_hardware(path: str | Path | None = None) -> HardwareTable:
    """The packaged GPU table, or the one at ``path``."""
    return _load(None if path is None else str(path))


def get_gpu(key: str) -> GPU:
    """A GPU of the packaged table by key (``h100``, ``a100``, ...)."""
    return load_hardware().gpu(key)
