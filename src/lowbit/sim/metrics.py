"""Per-request latencies and their summaries, defined as ``vllm bench serve`` defines them.

TTFT = first token − arrival; TPOT = (E2E − TTFT) / (output − 1), for output > 1;
ITL = each gap between consecutive tokens of a request; E2E = last token − arrival.
Goodput = requests per second that meet every per-request SLO given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["SimResult", "Stats", "Summary", "SLO"]


@dataclass(frozen=True)
class Stats:
    """mean and percentiles of one metric, seconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, x: np.ndarray) -> Stats:
        x = x[np.isfinite(x)]
        if len(x) == 0:
            return cls(float("nan"), float("nan"), float("nan"), float("nan"))
        p50, p90, p99 = np.percentile(x, [50, 90, 99])
        return cls(float(np.mean(x)), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class SLO:
    """Latency targets, seconds; ``None`` = no target.

    The percentile form holds when ``TTFT p{percentile} ≤ ttft`` and ``TPOT p{percentile} ≤ tpot``;
    the goodput form counts requests that meet every target and asks that at least
    ``attainment`` of them do.
    """

    ttft: float | None = 1.0
    tpot: float | None = 0.040
    e2e: float | None = None
    percentile: float = 99.0
    attainment: float = 0.99

    def __post_init__(self) -> None:
        if self.ttft is None and self.tpot is None and self.e2e is None:
            raise ValueError("an SLO needs at least one of ttft, tpot, e2e")
        for name in ("ttft", "tpot", "e2e"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {v}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"SLO percentile must be in (0, 100), got {self.percentile}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Summary:
    """Summary of one simulation run."""

    n_requests: int
    duration: float
    request_throughput: float
    output_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    mean_concurrency: float
    preemptions: int
    steps: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SimResult:
    """Everything one simulation produced; arrays are per request (seconds) unless named per step.

    Attributes:
        arrival, first_token, finish: event times per request.
        prompt, output: token counts per request.
        preemptions: times each request was preempted (recomputed).
        itl: every inter-token gap of every request.
        step_end, step_tokens: end time and tokens computed of each engine step.
        stopped_early: the run was abandoned once its TTFT target was surely missed
            (``simulate(stop_ttft=...)``); times of what did not happen are NaN and both SLO
            checks fail.
    """

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    preemptions: np.ndarray
    itl: np.ndarray
    step_end: np.ndarray
    step_tokens: np.ndarray
    stopped_early: bool = False

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> np.ndarray:
        return self.finish - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """(E2E − TTFT) / (output − 1); NaN for single-token outputs (excluded from stats)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output > 1, (self.finish - self.first_token) / (self.output - 1), np.nan)

    def summary(self) -> Summary:
        duration = float(self.finish.max() - self.arrival.min())
        return Summary(
            n_requests=len(self.arrival),
            duration=duration,
            request_throughput=len(self.arrival) / duration,
            output_throughput=float(self.output.sum()) / duration,
            ttft=Stats.of(self.ttft), tpot=Stats.of(self.tpot), itl=Stats.of(self.itl), e2e=Stats.of(self.e2e),
            mean_concurrency=float(self.e2e.sum()) / duration,
            preemptions=int(self.preemptions.sum()),
            steps=len(self.step_end),
        )

    def good(self, slo: SLO) -> np.ndarray:
        """Per request: meets every target of ``slo``."""
        ok = np.ones(len(self.arrival), dtype=bool)
        if slo.ttft is not None:
            ok &= self.ttft <= slo.ttft
        if slo.tpot is not None:
            ok &= ~(self.tpot > slo.tpot)  # NaN (single-token output) passes
        if slo.e2e is not None:
            ok &= self.e2e <= slo.e2e
        return ok

    def meets_percentile(self, slo: SLO) -> bool:
        """The percentile form: each targeted metric's p{percentile} is within its target."""
        if self.stopped_early:
            return False
        q = slo.percentile
        checks = [(slo.ttft, self.ttft), (slo.tpot, self.tpot), (slo.e2e, self.e2e)]
        for target, x in checks:
            if target is None:
                continue
            x = x[np.isfinite(x)]
            if len(x) and np.percentile(x, q) > target:
                return False
        return True

    def meets_goodput(self, slo: SLO) -> bool:
        """The goodput form: at least ``slo.attainment`` of requests meet every target."""
        if self.stopped_early:
            return False
        return float(self.good(slo).mean()) >= slo.attainment
