"""Perplexity, KL divergence and top-1 agreement against a reference, with confidence
intervals.

Evaluation streams window by window and never holds all logits.  The reference model's
predictions are computed once per (model, windows) as a :class:`Reference` — for each
predicted position its argmax, its NLL of the true token, and the log-probabilities of
its ``k`` most likely tokens — and reused for every configuration.

KL(P_ref ‖ P_quant) is computed over the reference's top-``k`` tokens plus one bucket
for the rest of the vocabulary:  Σ_top p·(log p − log q) + p_rest·(log p_rest − log q_rest).
That is the KL divergence of the two distributions coarsened to k + 1 outcomes, a lower
bound of the full KL that is exact when ``k`` is the vocabulary size, and equal to zero
when the two models agree.  A rest mass below 1e-5 is treated as zero: it is then the
rounding noise of the stored fp32 log-probabilities.

Confidence intervals are 95% percentile intervals of a bootstrap over windows (tokens
within a window are correlated, windows much less so); Δ% is bootstrapped paired, with
the same resampled windows for the model and the reference.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from ..util.io import CorruptFile, load_tensors, save_tensors
from ..util.parallel import map_shards
from ..quantization.runtime import Forward

__all__ = ["Reference", "Eval", "reference_predictions", "evaluate", "summarize_reference", "window_metrics",
           "paired_difference"]

DEFAULT_TOPK = 1024
_REST_FLOOR = 1e-5


@dataclass
class Reference:
    """The reference model's predictions on ``(n, seq)`` windows (``seq − 1`` predicted
    positions each)."""

    argmax: torch.Tensor  # (n, seq-1) int64
    nll: torch.Tensor  # (n, seq-1) float32, NLL of the true next token
    topk_ids: torch.Tensor  # (n, seq-1, k) int32, most likely first
    topk_logprobs: torch.Tensor  # (n, seq-1, k) float32

    @property
    def k(self) -> int:
        return self.topk_ids.shape[-1]

    def save(self, path: Path) -> None:
        """Atomically, with a checksum (:func:`lowbit.util.io.save_tensors`)."""
        save_tensors(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> "Reference":
        """Raises :class:`lowbit.util.io.CorruptFile` for a truncated or corrupted file."""
        tensors, _ = load_tensors(path)
        if set(tensors) != {f.name for f in fields(cls)}:
            raise CorruptFile(f"{path}: tensors {sorted(tensors)} are not a reference's")
        return cls(**tensors)


@dataclass(frozen=True)
class Eval:
    """One configuration's evaluation.  ``*_ci`` are 95% bootstrap intervals; KL and
    top-1 fields are ``None`` without a reference."""

    name: str
    ppl: float
    ppl_ci: tuple[float, float]
    windows: int
    tokens: int
    seconds: float
    delta_pct: float | None = None
    delta_ci: tuple[float, float] | None = None
    kl_mean: float | None = None
    kl_ci: tuple[float, float] | None = None
    kl_p99: float | None = None
    top1: float | None = None
    top1_ci: tuple[float, float] | None = None
    kl_topk: int | None = None
    #: per window: NLL sum, counted tokens and (with a reference) KL sum — what a paired comparison of
    #: two configurations on the same windows resamples (:func:`paired_difference`)
    window_nll: tuple[float, ...] | None = field(default=None, repr=False)
    window_tokens: tuple[float, ...] | None = field(default=None, repr=False)
    window_kl: tuple[float, ...] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def _window_logits(forward: Forward, windows: torch.Tensor, idx, batch: int, tick):
    """For each window ``i`` of ``idx`` (contiguous): ``(i, logits, lse)`` with its logits
    ``(seq-1, V)`` in fp32 (position t predicts token t+1) and their log-normalizer
    ``(seq-1, 1)``, ``batch`` windows per forward (the last batch may be shorter).
    Log-probabilities are ``logits − lse``; only the few that are needed are formed (a full
    ``log_softmax`` would write another V-wide copy).  The logits stay on the model's device."""
    idx = list(idx)
    for s in range(0, len(idx), batch):
        chunk = idx[s : s + batch]
        logits = forward(windows[chunk[0] : chunk[-1] + 1])[:, :-1].float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        for j, i in enumerate(chunk):
            yield i, logits[j], lse[j]
            tick()


def _sharing(workers: int | None, batch: int | None) -> tuple[int | None, int]:
    """``(workers, windows per forward)``: ``batch=None`` is one window per forward in
    forked workers (the CPU path); a batch runs here, ``batch`` windows per forward."""
    if batch is None:
        return workers, 1
    if int(batch) < 1:
        raise ValueError(f"batch must be >= 1 windows, got {batch}")
    return 1, int(batch)


@torch.inference_mode()
def reference_predictions(
    forward: Forward, windows: torch.Tensor, k: int = DEFAULT_TOPK, *, progress: bool = True,
    workers: int | None = None, batch: int | None = None,
) -> Reference:
    """Run the reference over ``windows`` and keep what evaluation needs (``workers``: see
    :func:`lowbit.util.parallel.map_shards`; ``batch``: windows per forward, in this
    process, as in :func:`evaluate`).  The reference is kept on the CPU."""
    workers, per = _sharing(workers, batch)

    def shard(idx, tick):
        argmax, nll, ids_, lps = [], [], [], []
        for i, logits, lse in _window_logits(forward, windows, idx, per, tick):
            top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
            target = windows[i, 1:, None].to(logits.device)
            argmax.append(logits.argmax(-1).cpu())
            nll.append((lse - logits.gather(-1, target)).squeeze(-1).cpu())
            ids_.append(top.indices.to(torch.int32).cpu())
            lps.append((top.values - lse).cpu())
        return argmax, nll, ids_, lps

    parts = map_shards(shard, len(windows), workers=workers, description="reference", progress=progress)
    return Reference(*(torch.stack([t for p in parts for t in p[j]]) for j in range(4)))


def window_metrics(logits: torch.Tensor, targets: torch.Tensor, ref: Reference | None, w: int,
                   lse: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token NLL, and against reference window ``w``: KL and top-1 agreement.

    ``logits``: (positions, V) of the evaluated model (log-probabilities work too);
    ``lse``: their ``logsumexp`` over V, ``(positions, 1)``, computed if not given.
    """
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    dev = logits.device
    out = {"nll": (lse - logits.gather(-1, targets[:, None].to(dev))).squeeze(-1)}
    if ref is not None:
        rid = ref.topk_ids[w].long().to(dev)
        lp_ref = ref.topk_logprobs[w].to(dev).double()
        lq = (logits.gather(-1, rid) - lse).double()
        p = lp_ref.exp()
        kl = (p * (lp_ref - lq)).sum(-1)
        # the rest of the vocabulary as one outcome; below _REST_FLOOR its mass is fp32
        # rounding noise of the stored log-probabilities (e.g. when k is the vocabulary)
        p_rest = 1 - p.sum(-1)
        q_rest = (1 - lq.exp().sum(-1)).clamp(min=1e-300)
        real = p_rest > _REST_FLOOR
        rest = torch.where(real, p_rest.clamp(min=1e-300) * (p_rest.clamp(min=1e-300).log() - q_rest.log()), 0.0)
        out["kl"] = (kl + rest).clamp(min=0).float()
        out["agree"] = (logits.argmax(-1) == ref.argmax[w].to(dev)).float()
    return out


def _ci(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return float(lo), float(hi)


@torch.inference_mode()
def evaluate(
    forward: Forward,
    windows: torch.Tensor,
    reference: Reference | None = None,
    *,
    name: str = "",
    bootstrap: int = 1000,
    seed: int = 0,
    progress: bool = True,
    workers: int | None = None,
    mask: torch.Tensor | None = None,
    batch: int | None = None,
) -> Eval:
    """Evaluate ``forward`` on ``windows`` ``(n, seq)``, against ``reference`` if given.

    Args:
        forward: ``forward(ids (1, seq)) -> logits (1, seq, V)``.
        windows: token windows; each predicts its last ``seq − 1`` tokens.
        reference: the reference model's predictions on the same windows.
        name: label for the result.
        bootstrap: number of bootstrap resamples over windows.
        seed: seed of the bootstrap.
        progress: show a progress bar.
        workers: processes that share the windows (default
            :func:`lowbit.util.parallel.default_workers`; 1 runs here).
        mask: ``(n, seq − 1)`` bool, the predicted positions that count (e.g. the assistant's
            tokens, :func:`lowbit.data.windows.assistant_mask_for`); perplexity, KL, top-1 and
            their intervals are then over those positions only. ``None``: all of them.
        batch: windows per forward, all in this process (``workers`` is then unused) —
            the GPU path; ``None``: one window per forward, in ``workers`` processes.
            Results equal the one-window path up to float rounding.
    """
    n = len(windows)
    if reference is not None and reference.nll.shape[0] != n:
        raise ValueError(f"reference covers {reference.nll.shape[0]} windows, evaluation has {n}")
    _check_mask(mask, (n, windows.shape[1] - 1))
    t0 = time.perf_counter()
    workers, per = _sharing(workers, batch)

    def shard(idx, tick):
        rows = []  # per window: NLL sum, tokens, KL sum, agreements, per-token KL
        for i, logits, lse in _window_logits(forward, windows, idx, per, tick):
            m = window_metrics(logits, windows[i, 1:], reference, i, lse)
            if mask is not None:
                m = {k: v[mask[i].to(v.device)] for k, v in m.items()}
            kl = m.get("kl")
            rows.append((float(m["nll"].double().sum()), m["nll"].numel(),
                         float(kl.double().sum()) if kl is not None else 0.0,
                         float(m["agree"].sum()) if kl is not None else 0.0, kl.cpu() if kl is not None else None))
        return rows

    rows = [r for part in map_shards(shard, n, workers=workers, description=f"evaluating {name}".strip(),
                                     progress=progress) for r in part]
    nll_w, count, kl_w, agree_w = (np.array([r[j] for r in rows], dtype=np.float64) for j in range(4))
    kl_all = [r[4] for r in rows if r[4] is not None]
    seconds = time.perf_counter() - t0
    kl = torch.cat(kl_all) if kl_all else None
    return _summarize(name, nll_w, count, seconds, bootstrap, seed, reference, kl_w, agree_w, kl, mask)


def _check_mask(mask: torch.Tensor | None, shape: tuple[int, int]) -> None:
    if mask is None:
        return
    if mask.dtype != torch.bool or tuple(mask.shape) != shape:
        raise ValueError(f"mask must be bool of shape {shape} (windows × predicted positions), "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    if not mask.any():
        raise ValueError("the loss mask selects no token (no assistant token in the evaluation windows?)")


def _masked_nll(reference: Reference, mask: torch.Tensor | None) -> np.ndarray:
    """Per-window sums of the reference's NLL over the positions ``mask`` keeps."""
    nll = reference.nll.double()
    return (nll if mask is None else nll * mask).sum(-1).numpy()


def summarize_reference(reference: Reference, *, name: str = "reference", bootstrap: int = 1000, seed: int = 0,
                        mask: torch.Tensor | None = None) -> Eval:
    """The reference model's own perplexity (with its interval) from its stored NLLs (over the
    positions ``mask`` keeps, as :func:`evaluate`)."""
    _check_mask(mask, tuple(reference.nll.shape))
    nll_w = _masked_nll(reference, mask)
    count = (np.full(len(nll_w), reference.nll.shape[1], dtype=float) if mask is None
             else mask.sum(-1).double().numpy())
    return _summarize(name, nll_w, count, 0.0, bootstrap, seed, mask=mask)


def _summarize(name, nll_w, count, seconds, bootstrap, seed, reference=None, kl_w=None, agree_w=None, kl=None,
               mask=None) -> Eval:
    n = len(nll_w)
    tokens = int(count.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(bootstrap, n))
    cnt_b = count[idx].sum(1)
    if mask is not None:  # with a loss mask a resample may hold no counted token: it says nothing
        idx, cnt_b = idx[cnt_b > 0], cnt_b[cnt_b > 0]
    ppl = math.exp(nll_w.sum() / tokens)
    res = dict(name=name, ppl=ppl, ppl_ci=_ci(np.exp(nll_w[idx].sum(1) / cnt_b)), windows=n, tokens=tokens, seconds=seconds,
               window_nll=tuple(map(float, nll_w)), window_tokens=tuple(map(float, count)))
    if reference is not None:
        ref_w = _masked_nll(reference, mask)
        ref_ppl = math.exp(ref_w.sum() / tokens)
        ratio_b = np.exp((nll_w[idx].sum(1) - ref_w[idx].sum(1)) / cnt_b)
        res.update(
            delta_pct=100 * (ppl / ref_ppl - 1),
            delta_ci=tuple(100 * (v - 1) for v in _ci(ratio_b)),
            kl_mean=float(kl_w.sum() / tokens),
            kl_ci=_ci(kl_w[idx].sum(1) / cnt_b),
            kl_p99=float(torch.quantile(kl.double(), 0.99)),
            top1=float(agree_w.sum() / tokens),
            top1_ci=_ci(agree_w[idx].sum(1) / cnt_b),
            kl_topk=reference.k,
            window_kl=tuple(map(float, kl_w)),
        )
    return Eval(**res)


def paired_difference(a: Eval, b: Eval, *, bootstrap: int = 1000, seed: int = 0) -> dict:
    """``b`` against ``a``, evaluated on the same windows: the KL difference ``b − a``, the KL ratio
    ``b / a`` and the perplexity ratio ``b / a``, each with a paired bootstrap 95% interval (the same
    resampled windows for both, so the windows' shared difficulty cancels, which two separate
    intervals cannot show).  Needs both evaluations' per-window sums (``Eval.window_*``)."""
    for e in (a, b):
        if e.window_nll is None or e.window_kl is None:
            raise ValueError(f"paired_difference: {e.name or 'an evaluation'} has no per-window KL "
                             "(evaluated without a reference, or read from an older result)")
    if a.window_tokens != b.window_tokens:
        raise ValueError(f"paired_difference: {a.name} and {b.name} were not evaluated on the same windows")
    tok = np.asarray(a.window_tokens)
    (nll_a, kl_a), (nll_b, kl_b) = ((np.asarray(e.window_nll), np.asarray(e.window_kl)) for e in (a, b))
    idx = np.random.default_rng(seed).integers(0, len(tok), size=(bootstrap, len(tok)))
    t = tok[idx].sum(1)
    ka, kb = kl_a[idx].sum(1) / t, kl_b[idx].sum(1) / t
    ppl_ratio = np.exp((nll_b[idx].sum(1) - nll_a[idx].sum(1)) / t)
    return {"kl_diff": float((kl_b.sum() - kl_a.sum()) / tok.sum()), "kl_diff_ci": _ci(kb - ka),
            "kl_ratio": float(kl_b.sum() / kl_a.sum()), "kl_ratio_ci": _ci(kb / ka),
            "ppl_ratio": float(math.exp((nll_b.sum() - nll_a.sum()) / tok.sum())), "ppl_ratio_ci": _ci(ppl_ratio)}
