"""What a format buys a service: low-load latency and max rate under an SLO, per plan.

These are the library functions behind ``lowbit simulate``; they return data (dataclasses
with ``to_dict()``), rendering lives in :mod:`lowbit.report.capacity`.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import numpy as np

from .engine import EngineConfig
from .hardware import load_hardware
from .memory import MemoryReport
from .metrics import SLO
from .plans import parse_plan, resolve_plan
from .scenario import Scenario
from .search import MaxRate, max_rate
from .shapes import get_model
from .workload import Lengths, Workload

__all__ = ["PlanCapacity", "CapacityTable", "Curve", "capacity_table", "latency_curves", "scenario_for"]


@dataclass(frozen=True)
class PlanCapacity:
    """One plan's row: low-load latencies (one request alone), max rate, memory."""

    plan: str
    lane: str
    weight_only: bool
    low_load_ttft: float
    low_load_tpot: float
    max_rate: MaxRate
    memory: MemoryReport

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CapacityTable:
    model: str
    gpu: str
    tp: int
    engine: EngineConfig
    slo: SLO
    form: str
    prompt_mean: float
    output_mean: float
    n_requests: int
    rows: tuple[PlanCapacity, ...]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Curve:
    """Latency percentiles against request rate for one plan (seconds)."""

    plan: str
    rates: tuple[float, ...]
    ttft_p50: tuple[float, ...]
    ttft_p99: tuple[float, ...]
    tpot_p50: tuple[float, ...]
    tpot_p99: tuple[float, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def scenario_for(model: str, gpu: str, plan: str, tp: int = 1, engine: EngineConfig | None = None,
                 hardware: str | None = None) -> Scenario:
    """A :class:`Scenario` from names; ``engine`` defaults to vLLM's defaults for the GPU."""
    hw = load_hardware(hardware)
    g = hw.gpu(gpu)
    eng = engine if engine is not None else EngineConfig.vllm_defaults(g, tp)
    if eng.tp != tp:
        raise ValueError(f"engine tp ({eng.tp}) differs from tp ({tp})")
    return Scenario(get_model(model), resolve_plan(parse_plan(plan), g), g, hw.kernels, eng)


def capacity_table(model: str, gpu: str, plans: list[str], prompt: Lengths, output: Lengths,
                   slo: SLO, n_requests: int = 2000, burstiness: float = 1.0, tp: int = 1,
                   engine: EngineConfig | None = None, seeds: tuple[int, ...] = (0, 1, 2),
                   form: str = "percentile") -> CapacityTable:
    """The notebook's table: per plan, TTFT and TPOT of one request alone and the max rate under ``slo``."""
    if not plans:
        raise ValueError("capacity_table needs at least one plan")
    rows = []
    for name in plans:
        sc = scenario_for(model, gpu, name, tp, engine)
        w = Workload(1.0, n_requests, prompt, output, burstiness=burstiness, seed=seeds[0])
        alone = sc.run(Workload(1.0, 1, Lengths.fixed(int(round(w.mean_prompt))),
                                Lengths.fixed(max(2, int(round(w.mean_output))))))
        rows.append(PlanCapacity(
            plan=name, lane=sc.plan.lane, weight_only=sc.plan.weight_only,
            low_load_ttft=float(alone.ttft[0]), low_load_tpot=float(alone.tpot[0]),
            max_rate=max_rate(sc, w, slo, form=form, seeds=seeds),
            memory=sc.memory(int(round(w.mean_prompt + w.mean_output))),
        ))
    eng = engine if engine is not None else EngineConfig.vllm_defaults(load_hardware().gpu(gpu), tp)
    return CapacityTable(model=model, gpu=gpu, tp=tp, engine=eng, slo=slo, form=form,
                         prompt_mean=prompt.mean, output_mean=output.mean, n_requests=n_requests, rows=tuple(rows))


def latency_curves(table: CapacityTable, prompt: Lengths, output: Lengths, points: int = 8,
                   seed: int = 0) -> list[Curve]:
    """TTFT / TPOT p50 and p99 at ``points`` rates from 10% to 120% of the highest max rate in ``table``."""
    top = max((r.max_rate.high for r in table.rows), default=0.0)
    if top <= 0:
        raise ValueError("no plan meets the SLO at any rate: nothing to plot")
    rates = tuple(float(x) for x in np.linspace(0.1, 1.2, points) * top)
    curves = []
    for row in table.rows:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # already warned when the table was built
            sc = scenario_for(table.model, table.gpu, row.plan, table.tp, table.engine)
        stats = [sc.run(Workload(r, table.n_requests, prompt, output, seed=seed)).summary() for r in rates]
        curves.append(Curve(row.plan, rates, tuple(s.ttft.p50 for s in stats), tuple(s.ttft.p99 for s in stats),
                            tuple(s.tpot.p50 for s in stats), tuple(s.tpot.p99 for s in stats)))
    return curves
