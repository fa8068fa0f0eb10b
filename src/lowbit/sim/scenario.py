"""A scenario: one model, plan, GPU and engine, ready to simulate workloads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .engine import EngineConfig, StopRule, simulate
from .hardware import GPU, Kernels
from .memory import MemoryReport, memory_report
from .metrics import SimResult
from .perf import StepModel, step_model
from .plans import Plan
from .shapes import ModelShape
from .workload import Workload

__all__ = ["Scenario"]


@dataclass(frozen=True)
class Scenario:
    """Everything but the workload.  ``plan`` must already be resolved for ``gpu`` (see
    :func:`lowbit.sim.plans.resolve_plan`).

    Attributes:
        model, plan, gpu, kernels, engine: as named.
        kv_tokens: KV capacity override in tokens (``None``: from the memory model).
    """

    model: ModelShape
    plan: Plan
    gpu: GPU
    kernels: Kernels
    engine: EngineConfig
    kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.gpu.has_lane(self.plan.lane):
            raise ValueError(f"plan {self.plan.name!r} needs the {self.plan.lane} lane, which {self.gpu.name} lacks; "
                             "resolve it with resolve_plan()")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")

    @cached_property
    def step(self) -> StepModel:
        return step_model(self.model, self.plan, self.gpu, self.kernels, self.engine.tp)

    def memory(self, context: int = 8000) -> MemoryReport:
        return memory_report(self.model, self.plan, self.gpu, self.engine.tp, context,
                             self.engine.gpu_memory_utilization, self.engine.reserved_gb)

    @cached_property
    def capacity_tokens(self) -> int:
        if self.kv_tokens is not None:
            return self.kv_tokens
        mem = self.memory(1)
        if not mem.fits:
            raise ValueError(
                f"{self.model.name} in {self.plan.name} needs {mem.weights_per_gpu / 1e9:.1f} GB per GPU: it does not "
                f"fit {self.gpu.name} at tp={self.engine.tp} (utilization {self.engine.gpu_memory_utilization})"
            )
        return mem.kv_capacity_tokens

    def run(self, workload: Workload, stop: StopRule | None = None) -> SimResult:
        """Simulate ``workload`` (its requests drawn from its seed); ``stop`` as in :func:`simulate`."""
        return simulate(workload.sample(), self.step, self.capacity_tokens, self.engine, stop=stop)
