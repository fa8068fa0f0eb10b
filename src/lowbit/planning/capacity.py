"""What each candidate buys a service: memory, single-user latency, max rate under the SLO,
and the latency curves — from the simulator, cached per configuration.

A result is keyed by everything that decides it (lowbit version, model shape, the plan as the
GPU runs it — its schemes, lane and KV width, not its name —, the GPU's row, kernel costs, engine settings, the load and, for curves, the
rates), and stored as JSON under ``<cache>/sim/``; planning again for the same configuration
reads it back instead of simulating.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .._version import __version__, source_digest
from ..sim.capacity import Curve
from ..sim.engine import EngineConfig
from ..sim.hardware import GPU, Kernels
from ..sim.memory import MemoryReport
from ..sim.metrics import SLO
from ..sim.plans import Plan, resolve_plan
from ..sim.scenario import Scenario
from ..sim.search import MaxRate, max_rate
from ..sim.shapes import ModelShape
from ..sim.workload import Lengths, Workload
from ..util.io import atomic_write_text

__all__ = ["Load", "Capacity", "capacity_for", "curve_for", "resolved"]


@dataclass(frozen=True)
class Load:
    """The traffic a plan is made for and its latency targets.

    Attributes:
        prompt, output: token-length distributions.
        slo: TTFT / TPOT targets (seconds) and the percentile or goodput form's parameters.
        n_requests: requests per simulation.
        burstiness: Gamma shape of inter-arrivals (1 = Poisson).
        seeds: one max-rate search per seed; the answer is their median [min–max].
        form: ``percentile`` or ``goodput``.
        pairs: (prompt, output) pairs drawn together (from a lengths file), overriding ``prompt``/``output``.
    """

    prompt: Lengths
    output: Lengths
    slo: SLO
    n_requests: int = 2000
    burstiness: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2)
    form: str = "percentile"
    pairs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.form not in ("percentile", "goodput"):
            raise ValueError(f"SLO form must be 'percentile' or 'goodput', got {self.form!r}")
        if not self.seeds:
            raise ValueError("a load needs at least one seed")

    def workload(self, rate: float = 1.0, seed: int | None = None) -> Workload:
        return Workload(rate, self.n_requests, self.prompt, self.output, burstiness=self.burstiness,
                        seed=self.seeds[0] if seed is None else seed, pairs=self.pairs)

    @property
    def context(self) -> int:
        """Mean conversation length (prompt + output), the context memory is reported for."""
        w = self.workload()
        return int(round(w.mean_prompt + w.mean_output))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Capacity:
    """One candidate's serving figures on one GPU (``None`` where it does not fit).

    Attributes:
        candidate: the candidate's name.
        plan: the plan as the GPU runs it (``lane`` already fallen back where the GPU lacks it).
        fell_back: the GPU lacks the recipe's lane, so it runs weight-only on BF16.
        memory: weights, KV per token, KV capacity and the decode bound, per GPU.
        low_load_ttft, low_load_tpot: one request alone, seconds.
        max_rate: highest request rate meeting the SLO, over the load's seeds.
        binding: which target fails first just above the max rate: ``ttft`` (prefill and
            queueing), ``tpot`` (decode), or ``bound`` (the closed-form throughput bound was
            reached with both targets met).
        excess: p-th percentile ÷ target of TTFT and TPOT at that rate.
        seconds: simulation time (0 when read from the cache); cached: read from the cache.
    """

    candidate: str
    plan: Plan
    fell_back: bool
    memory: MemoryReport
    low_load_ttft: float | None
    low_load_tpot: float | None
    max_rate: MaxRate | None
    binding: str | None
    excess: tuple[float, float] | None
    seconds: float = 0.0
    cached: bool = False

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def rate(self) -> float:
        """The median max rate, 0 when it does not fit or meets the SLO at no rate."""
        return self.max_rate.median if self.max_rate is not None else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        return d


def _key(*parts) -> str:
    text = json.dumps([__version__, source_digest(__name__), *parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _tuples(cls, d: dict):
    """``cls(**d)`` with lists turned back into tuples (JSON has no tuples)."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _from_dict(d: dict) -> Capacity:
    d = {k: v for k, v in d.items() if k in {f.name for f in fields(Capacity)}}
    d["plan"] = Plan(**{k: v for k, v in d["plan"].items() if k != "weight_only"})
    d["memory"] = MemoryReport(**d["memory"])
    d["max_rate"] = None if d["max_rate"] is None else _tuples(MaxRate, d["max_rate"])
    d["excess"] = None if d["excess"] is None else tuple(d["excess"])
    return Capacity(**d)


def _unnamed(plan: Plan) -> dict:
    """A plan's identity for the cache: its schemes, lane and KV width — two recipes that
    differ only in calibration (RTN or GPTQ INT4) serve alike and share one simulation."""
    return {k: v for k, v in plan.to_dict().items() if k != "name"}


def resolved(plan: Plan, gpu: GPU) -> tuple[Plan, bool]:
    """``plan`` as ``gpu`` runs it, and whether its lane fell back (no warning: the caller reports it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_plan(plan, gpu), not gpu.has_lane(plan.lane)


def _scenario(shape: ModelShape, plan: Plan, gpu: GPU, kernels: Kernels, engine: EngineConfig) -> tuple[Scenario, bool]:
    p, fell = resolved(plan, gpu)
    return Scenario(shape, p, gpu, kernels, engine), fell


def _binding(sc: Scenario, load: Load, rate: float, bound: float) -> tuple[str, tuple[float, float]]:
    """Which target the seed-0 run just above ``rate`` misses most (see :attr:`Capacity.binding`)."""
    slo, q = load.slo, load.slo.percentile
    probe = rate * 1.05 if rate > 0 else bound / 64
    res = sc.run(load.workload(probe))
    ex = []
    for target, x in ((slo.ttft, res.ttft), (slo.tpot, res.tpot)):
        x = x[np.isfinite(x)]
        ex.append(float(np.percentile(x, q) / target) if target is not None and len(x) else 0.0)
    if probe > bound and max(ex) <= 1.0:
        return "bound", (ex[0], ex[1])
    return ("ttft" if ex[0] >= ex[1] else "tpot"), (ex[0], ex[1])


def capacity_for(name: str, plan: Plan, shape: ModelShape, gpu: GPU, kernels: Kernels, engine: EngineConfig,
                 load: Load, cache: Path | None = None) -> Capacity:
    """Memory, low-load latency, max rate and the binding target of ``plan`` for ``shape`` on ``gpu``.

    Read from ``cache/sim`` when this exact configuration was simulated before; a plan whose
    weights do not fit gets its memory report and ``None`` elsewhere.
    """
    sc, fell = _scenario(shape, plan, gpu, kernels, engine)
    key = _key("capacity", shape.to_dict(), _unnamed(sc.plan), gpu.to_dict(), asdict(kernels), engine.to_dict(),
               load.to_dict())
    path = None if cache is None else Path(cache) / "sim" / f"capacity-{key}.json"
    if path is not None and path.exists():
        got = _from_dict(json.loads(path.read_text()))
        return replace(got, candidate=name, plan=sc.plan, memory=replace(got.memory, plan=sc.plan.name), seconds=0.0,
                       cached=True)
    t0 = time.perf_counter()
    mem = sc.memory(load.context)
    ttft = tpot = rate = binding = excess = None
    if mem.fits:
        w = load.workload()
        alone = sc.run(Workload(1.0, 1, Lengths.fixed(int(round(w.mean_prompt))),
                                Lengths.fixed(max(2, int(round(w.mean_output))))))
        ttft, tpot = float(alone.ttft[0]), float(alone.tpot[0])
        rate = max_rate(sc, w, load.slo, form=load.form, seeds=load.seeds)
        binding, excess = _binding(sc, load, rate.median, rate.bound)
    out = Capacity(name, sc.plan, fell, mem, ttft, tpot, rate, binding, excess, time.perf_counter() - t0)
    if path is not None:
        atomic_write_text(path, json.dumps(out.to_dict(), default=float) + "\n")
    return out


def curve_for(name: str, plan: Plan, shape: ModelShape, gpu: GPU, kernels: Kernels, engine: EngineConfig,
              load: Load, rates: tuple[float, ...], cache: Path | None = None) -> Curve:
    """TTFT / TPOT p50 and p99 of ``plan`` at each of ``rates`` (seed = the load's first), cached like
    :func:`capacity_for`."""
    sc, _ = _scenario(shape, plan, gpu, kernels, engine)
    key = _key("curve", shape.to_dict(), _unnamed(sc.plan), gpu.to_dict(), asdict(kernels), engine.to_dict(),
               load.to_dict(), list(rates))
    path = None if cache is None else Path(cache) / "sim" / f"curve-{key}.json"
    if path is not None and path.exists():
        return replace(_tuples(Curve, json.loads(path.read_text())), plan=name)
    stats = [sc.run(load.workload(r)).summary() for r in rates]
    curve = Curve(name, tuple(rates), tuple(s.ttft.p50 for s in stats), tuple(s.ttft.p99 for s in stats),
                  tuple(s.tpot.p50 for s in stats), tuple(s.tpot.p99 for s in stats))
    if path is not None:
        atomic_write_text(path, json.dumps(curve.to_dict(), default=float) + "\n")
    return curve
