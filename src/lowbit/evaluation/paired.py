"""Paired comparison of two models' per-example outcomes on the same benchmark questions.

Accuracy alone hides answers that change: a format can keep its accuracy while flipping many
individual answers (Dutta et al. 2024, "Accuracy is not all you need"). For outcome vectors
``r`` (reference) and ``q`` (quantized), 1 = correct:

- flips: ``b = #{r=1, q=0}`` (right→wrong) and ``c = #{r=0, q=1}`` (wrong→right), and
  ``(b + c) / n`` the fraction of answers that changed correctness;
- McNemar's exact test of ``H0: P(r→w) = P(w→r)``: under H0, ``b ~ Binomial(b + c, 1/2)``, and the
  two-sided p-value is ``min(1, 2 · Σ_{i ≤ min(b,c)} C(b+c, i) / 2^(b+c))`` (1 when ``b + c = 0``);
- Δ = acc(q) − acc(r) with a paired bootstrap 95% interval (the same resampled questions for
  both models), and each accuracy's own bootstrap interval;
- the mean KL(P_r ‖ P_q) of the choice distributions ``P = softmax(log-likelihoods over choices)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Flips", "PairedAccuracy", "flips", "mcnemar_exact", "paired_accuracy", "accuracy_ci", "choice_kl"]


@dataclass(frozen=True)
class Flips:
    right_to_wrong: int
    wrong_to_right: int
    n: int

    @property
    def fraction(self) -> float:
        return (self.right_to_wrong + self.wrong_to_right) / self.n if self.n else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "fraction": self.fraction}


@dataclass(frozen=True)
class PairedAccuracy:
    """One metric of one task, a model against the reference, over ``n`` questions."""

    metric: str
    n: int
    reference: float
    reference_ci: tuple[float, float]
    accuracy: float
    accuracy_ci: tuple[float, float]
    delta: float
    delta_ci: tuple[float, float]
    flips: Flips
    mcnemar_p: float
    choice_kl: float | None  # mean KL of the choice distribution; None with one choice

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flips"] = self.flips.to_dict()
        return d


def flips(reference: np.ndarray, other: np.ndarray) -> Flips:
    """Counts of right→wrong and wrong→right between two boolean outcome vectors."""
    r, q = _bools(reference, other)
    return Flips(int((r & ~q).sum()), int((~r & q).sum()), len(r))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    # Σ_{i≤k} C(n, i) / 2^n in log space: exact enough for any n a benchmark has
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2) for i in range(k + 1)]
    m = max(logs)
    tail = math.exp(m) * sum(math.exp(v - m) for v in logs)
    return min(1.0, 2 * tail)


def _bools(reference, other) -> tuple[np.ndarray, np.ndarray]:
    r, q = np.asarray(reference, dtype=bool), np.asarray(other, dtype=bool)
    if r.shape != q.shape or r.ndim != 1:
        raise ValueError(f"outcome vectors must be 1-D and of one length, got {r.shape} and {q.shape}")
    return r, q


def _ci(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return float(lo), float(hi)


def accuracy_ci(correct, *, bootstrap: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of a boolean vector."""
    c = np.asarray(correct, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(c), size=(bootstrap, len(c)))
    return _ci(c[idx].mean(1))


def choice_kl(reference_ll: list[tuple[float, ...]], other_ll: list[tuple[float, ...]]) -> float | None:
    """Mean over questions of KL(softmax(ref) ‖ softmax(other)) over each question's choices."""
    kls = []
    for a, b in zip(reference_ll, other_ll):
        if len(a) < 2:
            return None
        la, lb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        la, lb = la - np.logaddexp.reduce(la), lb - np.logaddexp.reduce(lb)
        kls.append(float(np.sum(np.exp(la) * (la - lb))))
    return float(np.mean(kls)) if kls else None


def paired_accuracy(metric: str, reference, other, *, reference_ll=None, other_ll=None,
                    bootstrap: int = 1000, seed: int = 0) -> PairedAccuracy:
    """The paired comparison of two outcome vectors over the same questions (see the module)."""
    r, q = _bools(reference, other)
    n = len(r)
    if n == 0:
        raise ValueError("no questions to compare")
    idx = np.random.default_rng(seed).integers(0, n, size=(bootstrap, n))
    rf, qf = r.astype(float), q.astype(float)
    f = flips(r, q)
    kl = choice_kl(reference_ll, other_ll) if reference_ll is not None and other_ll is not None else None
    return PairedAccuracy(
        metric=metric, n=n, reference=float(rf.mean()), reference_ci=_ci(rf[idx].mean(1)),
        accuracy=float(qf.mean()), accuracy_ci=_ci(qf[idx].mean(1)), delta=float(qf.mean() - rf.mean()),
        delta_ci=_ci(qf[idx].mean(1) - rf[idx].mean(1)), flips=f,
        mcnemar_p=mcnemar_exact(f.right_to_wrong, f.wrong_to_right), choice_kl=kl,
    )
