"""Capacity planning: memory and speed bounds, and a vLLM V1 serving simulator.

Model shapes from config.json or a built-in table, GPUs as data (``gpus.yaml``), plans whose
weight bytes come from :func:`lowbit.numerics.bits_per_element`.  May import ``util`` and
``numerics`` only: it knows no model weights.

    from . import capacity_table, memory_report, ...
"""

from .engine import EngineConfig, simulate
from .hardware import GPU, get_gpu, load_hardware
from .memory import MemoryReport, memory_report
from .metrics import SLO, SimResult, Summary
from .perf import StepModel, step_model
from .plans import PLANS, Plan, parse_plan, resolve_plan
from .scenario import Scenario
from .shapes import MODELS, ModelShape, get_model, shape_from_config
from .workload import Lengths, Workload

__all__ = [
    "EngineConfig", "simulate", "GPU", "get_gpu", "load_hardware", "MemoryReport", "memory_report",
    "SLO", "SimResult", "Summary", "StepModel", "step_model", "PLANS", "Plan", "parse_plan", "resolve_plan",
    "Scenario", "MODELS", "ModelShape", "get_model", "shape_from_config", "Lengths", "Workload",
]
