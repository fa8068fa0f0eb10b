"""Comparing two models' predictions when one side is known only by top-k log-probabilities.

An engine returns, per predicted position, the log-probability of the true token and of its
``k`` most likely tokens ``S``.  lowbit's side is a full distribution.  KL is formed on the
coarsening to ``S`` plus one bucket for the rest of the vocabulary:

    KL_S(P ‖ Q) = Σ_{t∈S} p_t (log p_t − log q_t) + p_rest (log p_rest − log q_rest)

— a lower bound of the full KL (coarsening never increases it), exact as ``k`` → vocabulary,
and zero when the two distributions agree.  Every KL that is compared with another (lowbit
against the engine, the reference against lowbit) uses the same ``S`` at each position, so
their ratio is not biased by the estimator.  A rest mass below 1e-5 on the ``P`` side is
rounding noise of fp32 log-probabilities and is dropped, as in :mod:`lowbit.evaluation.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

__all__ = ["EngineScores", "Pair", "PairAccumulator", "coarse_kl", "logprobs_at", "ppl"]

_REST_FLOOR = 1e-5
_TINY = 1e-300


@dataclass(frozen=True)
class EngineScores:
    """An engine's prompt log-probabilities over ``n`` windows of ``seq`` tokens:
    ``target`` ``(n, seq−1)``, ``topk_ids`` / ``topk_logprobs`` ``(n, seq−1, k)`` by rank."""

    target: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[-1])

    def check(self, windows: torch.Tensor) -> None:
        n, seq = windows.shape
        if self.target.shape != (n, seq - 1) or self.topk_ids.shape[:2] != (n, seq - 1):
            raise ValueError(f"engine scores cover {self.target.shape} positions, the windows {(n, seq - 1)}")
        if not np.isfinite(self.target).all():
            raise ValueError("the engine returned non-finite log-probabilities for true tokens")


def ppl(nll_sum: float, tokens: int) -> float:
    return math.exp(nll_sum / tokens)


def logprobs_at(logits: torch.Tensor, ids: np.ndarray | torch.Tensor) -> np.ndarray:
    """``log_softmax(logits)`` at ``ids`` ``(positions, k)``, in float64."""
    logits = logits.double()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    idx = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=logits.device)
    return (logits.gather(-1, idx) - lse).cpu().numpy()


def coarse_kl(lp_p: np.ndarray, lp_q: np.ndarray) -> np.ndarray:
    """Per position: KL(P ‖ Q) coarsened to the ``k`` tokens given plus the rest.

    ``lp_p``, ``lp_q``: ``(positions, k)`` log-probabilities of the same tokens under P and Q.
    """
    lp_p, lp_q = np.asarray(lp_p, np.float64), np.asarray(lp_q, np.float64)
    p, q = np.exp(lp_p), np.exp(lp_q)
    with np.errstate(invalid="ignore"):
        kl = np.where(p > 0, p * (lp_p - lp_q), 0.0).sum(-1)
    p_rest = 1.0 - p.sum(-1)
    q_rest = np.maximum(1.0 - q.sum(-1), _TINY)
    real = p_rest > _REST_FLOOR
    pr = np.maximum(p_rest, _TINY)
    rest = np.where(real, pr * (np.log(pr) - np.log(q_rest)), 0.0)
    return np.maximum(kl + rest, 0.0)


@dataclass(frozen=True)
class Pair:
    """lowbit's prediction against the engine on the same positions.

    ``kl`` is KL_S(lowbit ‖ engine); ``kl_reference`` is KL_S(reference ‖ lowbit) on the same
    sets ``S`` (the engine's top-k), the quantization error the comparison is measured against;
    ``top1`` is the share of positions where lowbit's argmax is the engine's rank-1 token."""

    tokens: int
    engine_ppl: float
    lowbit_ppl: float
    kl: float
    top1: float
    kl_reference: float | None = None
    kl_p99: float | None = None

    @property
    def delta_ppl(self) -> float:
        return self.engine_ppl - self.lowbit_ppl

    def to_dict(self) -> dict:
        return {**asdict(self), "delta_ppl": self.delta_ppl}


class PairAccumulator:
    """Sums over windows, then :meth:`result`."""

    def __init__(self) -> None:
        self.nll_engine = self.nll_lowbit = self.kl = self.kl_ref = self.agree = 0.0
        self.tokens = 0
        self.has_ref = False
        self._kls: list[np.ndarray] = []

    def add(self, lowbit_logits: torch.Tensor, targets: torch.Tensor, engine: EngineScores, w: int,
            reference_logits: torch.Tensor | None = None) -> None:
        """One window: ``lowbit_logits`` ``(seq−1, V)``, ``targets`` ``(seq−1,)`` the true next
        tokens, ``engine`` row ``w``; ``reference_logits`` for KL_S(reference ‖ lowbit)."""
        ids = engine.topk_ids[w]
        lp_low = logprobs_at(lowbit_logits, ids)
        lp_eng = engine.topk_logprobs[w].astype(np.float64)
        kl = coarse_kl(lp_low, lp_eng)
        self._kls.append(kl)
        self.kl += float(kl.sum())
        low_nll = -logprobs_at(lowbit_logits, targets.reshape(-1, 1).numpy())[:, 0]
        self.nll_lowbit += float(low_nll.sum())
        self.nll_engine += float(-engine.target[w].astype(np.float64).sum())
        self.agree += float((lowbit_logits.argmax(-1).numpy() == ids[:, 0]).sum())
        self.tokens += int(targets.numel())
        if reference_logits is not None:
            self.has_ref = True
            self.kl_ref += float(coarse_kl(logprobs_at(reference_logits, ids), lp_low).sum())

    def result(self) -> Pair:
        if not self.tokens:
            raise ValueError("no positions scored")
        n = self.tokens
        kls = np.concatenate(self._kls)
        return Pair(n, ppl(self.nll_engine, n), ppl(self.nll_lowbit, n), self.kl / n, self.agree / n,
                    self.kl_ref / n if self.has_ref else None, float(np.quantile(kls, 0.99)))
