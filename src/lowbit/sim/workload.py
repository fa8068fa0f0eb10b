"""Workloads: arrival times and prompt / output lengths, drawn the way ``vllm bench serve`` draws them.

Inter-arrival times ~ Gamma(shape = burstiness, scale = 1 / (rate · burstiness)); burstiness 1
is Poisson.  Like vLLM, arrivals can be rescaled so the last request lands at N / rate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

__all__ = ["Lengths", "Workload", "Requests", "lengths_from_file"]


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts.

    Attributes:
        kind: ``fixed`` (``value``), ``uniform`` (``low``..``high`` inclusive),
            ``lognormal`` (``value`` = mean, ``sigma`` of the log, clipped to ``low``..``high``)
            or ``values`` (drawn with replacement from ``values``).
    """

    kind: str
    value: int = 0
    low: int = 1
    high: int = 1
    sigma: float = 0.0
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind == "fixed":
            if self.value < 1:
                raise ValueError(f"fixed length must be >= 1, got {self.value}")
        elif self.kind == "uniform":
            if not 1 <= self.low <= self.high:
                raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low}, {self.high}")
        elif self.kind == "lognormal":
            if self.value < 1 or self.sigma <= 0 or not 1 <= self.low <= self.high:
                raise ValueError(f"lognormal lengths need mean >= 1, sigma > 0, 1 <= low <= high; got {self}")
        elif self.kind == "values":
            if not self.values or min(self.values) < 1:
                raise ValueError("values lengths need a non-empty list of lengths >= 1")
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}; use fixed, uniform, lognormal or values")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        return cls("fixed", value=n)

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``256`` (fixed) or ``128:512`` (uniform)."""
        try:
            if ":" in text:
                lo, hi = text.split(":")
                return cls("uniform", low=int(lo), high=int(hi))
            return cls.fixed(int(text))
        except ValueError as e:
            if "invalid literal" in str(e):
                raise ValueError(f"length {text!r}: expected N or LOW:HIGH") from None
            raise

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "values":
            return float(np.mean(self.values))
        return float(self.value)  # lognormal: before clipping

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n)
        if self.kind == "values":
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=n)
        mu = math.log(self.value) - self.sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size=n)), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class Requests:
    """Concrete requests: arrival seconds (sorted), prompt and output token counts."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival)


@dataclass(frozen=True)
class Workload:
    """A request stream.

    Attributes:
        rate: requests per second (``inf``: all arrive at t = 0).
        n_requests: how many requests.
        prompt, output: length distributions (prompt and output may come paired from ``pairs``).
        burstiness: Gamma shape of inter-arrival times (1 = Poisson, < 1 burstier).
        seed: the random seed (arrivals and lengths).
        normalize: rescale arrivals so the last lands at ``n_requests / rate`` (vLLM's default).
        pairs: optional (prompt, output) pairs sampled together (from a file), overriding ``prompt``/``output``.
    """

    rate: float
    n_requests: int
    prompt: Lengths
    output: Lengths
    burstiness: float = 1.0
    seed: int = 0
    normalize: bool = True
    pairs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf allowed), got {self.rate}")
        if self.n_requests < 1:
            raise ValueError(f"n_requests must be >= 1, got {self.n_requests}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")

    def with_rate(self, rate: float) -> Workload:
        return replace(self, rate=rate)

    def with_seed(self, seed: int) -> Workload:
        return replace(self, seed=seed)

    @property
    def mean_prompt(self) -> float:
        return float(np.mean([p for p, _ in self.pairs])) if self.pairs else self.prompt.mean

    @property
    def mean_output(self) -> float:
        return float(np.mean([o for _, o in self.pairs])) if self.pairs else self.output.mean

    def sample(self) -> Requests:
        """Draw the requests (deterministic in ``seed``; lengths independent of ``rate``)."""
        n = self.n_requests
        len_rng = np.random.default_rng([self.seed, 1])
        if self.pairs:
            idx = len_rng.integers(0, len(self.pairs), size=n)
            arr = np.asarray(self.pairs, dtype=np.int64)[idx]
            prompt, output = arr[:, 0].copy(), arr[:, 1].copy()
        else:
            prompt, output = self.prompt.sample(n, len_rng), self.output.sample(n, len_rng)
        if math.isinf(self.rate):
            arrival = np.zeros(n)
        else:
            # unit-rate Gamma gaps scaled by 1/rate: common random numbers across rates
            gaps = np.random.default_rng([self.seed, 0]).gamma(self.burstiness, 1.0 / self.burstiness, size=n)
            arrival = np.cumsum(gaps) / self.rate
            if self.normalize:
                arrival *= (n / self.rate) / arrival[-1]
        return Requests(arrival=arrival, prompt=prompt.astype(np.int64), output=output.astype(np.int64))


def lengths_from_file(path: str | Path) -> tuple[tuple[int, int], ...]:
    """(prompt, output) token pairs from a JSON list of ``{"prompt": P, "output": O}`` or a CSV ``prompt,output``."""
    p = Path(path)
    text = p.read_text()
    pairs: list[tuple[int, int]] = []
    if p.suffix == ".json":
        for i, row in enumerate(json.loads(text)):
            if not isinstance(row, dict) or set(row) != {"prompt", "output"}:
                raise ValueError(f"{p}[{i}]: expected {{'prompt': int, 'output': int}}, got {row!r}")
            pairs.append((int(row["prompt"]), int(row["output"])))
    else:
        for i, line in enumerate(text.splitlines()):
            if not line.strip() or (i == 0 and not line[0].isdigit()):
                continue
            cells = line.split(",")
            if len(cells) != 2:
                raise ValueError(f"{p}:{i + 1}: expected 'prompt,output', got {line!r}")
            pairs.append((int(cells[0]), int(cells[1])))
    if not pairs or min(min(x) for x in pairs) < 1:
        raise ValueError(f"{p}: needs at least one pair, all lengths >= 1")
    return tuple(pairs)
