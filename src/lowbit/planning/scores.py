"""What each unit costs in accuracy under each candidate format, for ``lowbit search``.

Measuring the KL divergence with only one unit quantized, for every unit and candidate, is
what the search wants to know, and too slow on a CPU (SmolLM2: 120 fused units × 4 formats
× enough windows).  The proxy here is the second-order (Fisher) term of that KL, from one
forward and one backward pass per window:

    KL(P_ref ‖ P_ΔW) ≈ ½ E[(∂ℓ/∂y · ΔW x)²],   ℓ = −log q(ŷ), ŷ sampled from the model itself.

For a Linear ``y = W x`` and a candidate's rounding error ``ΔW = Q(W) − W`` the change of its
output is ``ΔW x``; ``g = ∂ℓ/∂y`` with labels drawn from the model's own predictions makes
``E[g gᵀ]`` the Fisher information, so that quadratic form is the KL to second order.  Three
estimates of it are kept (:data:`PROXIES`): ``token`` sums ``(g_t · ΔW x_t)²`` per position
(the cross-position terms dropped), ``diagonal`` keeps only ``Σ (g ⊙ ΔW x)²`` (ModelOpt's
gradient score), ``window`` squares the whole window's ``Σ_t g_t · ΔW x_t`` (unbiased, noisy).
:func:`unit_kl` measures the real thing on a subset, so that the proxy's agreement can be shown
(:func:`rank_correlation`).  Rounding is the min-max rounding of
:func:`lowbit.quantization.pipeline.quantize` (with the NVFP4 global scale shared by fused
siblings), so the scores describe what ``quantize`` does — or, with
:func:`calibrated_errors`, the error a weight method (GPTQ, the MSE observer, learned rounding)
leaves in each format, so that a mix to be quantized with GPTQ is chosen by GPTQ's errors: GPTQ
helps some formats far more than others.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..evaluation.metrics import Reference, evaluate
from ..evaluation.workbench import Workbench
from ..numerics.qtensor import compute_qparams, fake_quantize
from ..numerics.scheme import Scheme
from ..quantization.pipeline import quantize
from ..quantization.recipe import Algorithms, Recipe, Rule
from ..quantization.runtime import plain_forward
from ..quantization.targets import shared_global_scales, sibling_groups
from ..util.progress import progress_bar

__all__ = ["PROXIES", "Scores", "weight_errors", "calibrated_errors", "fisher_scores", "unit_kl", "rank_correlation"]

log = logging.getLogger(__name__)

PROXIES = ("token", "diagonal", "window")


@torch.no_grad()
def weight_errors(model: nn.Module, names: list[str], scheme: Scheme) -> dict[str, torch.Tensor]:
    """``Q(W) − W`` of each Linear in ``names`` under ``scheme``, rounded as
    :func:`lowbit.quantization.rounding.round_model` rounds (min-max; fused siblings share an
    NVFP4 global scale)."""
    modules = dict(model.named_modules())
    plan = {n: (scheme, None) for n in names}
    shared = shared_global_scales(modules, plan, sibling_groups(model))
    out = {}
    for n in names:
        w = modules[n].weight.detach()
        out[n] = fake_quantize(w, scheme, compute_qparams(w, scheme, shared.get(n))) - w
    return out


#: methods that change the model beyond its weights' rounding (a basis, a rescaled norm, kept
#: channels): the difference of a weight before and after them is not a rounding error
_NOT_ROUNDING = ("rotation", "smoothquant", "awq", "outliers")


def calibrated_errors(model: nn.Module, names: list[str], schemes: list[Scheme], algorithms: Algorithms,
                      calibration: torch.Tensor, *, stats: Callable | None = None,
                      progress: bool = True) -> list[dict[str, torch.Tensor]]:
    """Per scheme, ``Q(W) − W`` of each Linear in ``names`` after quantizing a copy of ``model``
    with every one of them in that scheme and ``algorithms`` run layer by layer on
    ``calibration`` (one pipeline run per scheme).  Each unit's error is therefore measured with
    the layers before it quantized alike, not in the mix finally chosen: an approximation, as the
    additivity of the scores is.

    Raises:
        ValueError: methods whose effect is not a rounding of the weights alone (rotations,
            SmoothQuant, AWQ, outlier channels) or no calibration windows.
    """
    bad = [k for k in _NOT_ROUNDING if getattr(algorithms, k) is not None]
    if bad:
        raise ValueError(f"scores from the algorithms' errors take weight methods only (GPTQ, the MSE observer, "
                         f"learned rounding); {', '.join(bad)} change more than the weights' rounding")
    if calibration is None or len(calibration) == 0:
        raise ValueError("scores from the algorithms' errors need calibration windows")
    modules = dict(model.named_modules())
    out = []
    for s in schemes:
        q = copy.deepcopy(model)
        recipe = Recipe(name="search-score", rules=(Rule(tuple(names), s),), algorithms=algorithms)
        quantize(q, recipe, calibration, stats=stats, progress=progress)
        qm = dict(q.named_modules())
        out.append({n: (qm[n].weight.detach().float() - modules[n].weight.detach().float()) for n in names})
        del q
    return out


@dataclass
class Scores:
    """``values[proxy][module][c]``: the predicted KL (nats per token) of quantizing only
    ``module`` with candidate ``c``; ``windows``, ``tokens`` and ``seconds`` of the pass."""

    values: dict[str, dict[str, np.ndarray]]
    windows: int
    tokens: int
    seconds: float


def fisher_scores(model: nn.Module, names: list[str], schemes: list[Scheme], windows: torch.Tensor, *,
                  seed: int = 0, progress: bool = True, deltas: list[dict[str, torch.Tensor]] | None = None) -> Scores:
    """The Fisher proxy of the single-module KL for each Linear in ``names`` under each of
    ``schemes``, averaged over the ``(n, seq)`` token ``windows`` (one forward and backward
    pass each, in this process; labels sampled with ``seed``).  ``deltas``: the weight errors
    per scheme (:func:`calibrated_errors`); default min-max rounding's (:func:`weight_errors`)."""
    if len(windows) == 0:
        raise ValueError("fisher_scores: no windows to score on")
    t0 = time.perf_counter()
    modules = dict(model.named_modules())
    missing = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"fisher_scores: not Linear modules of this model: {missing[:3]}")
    if deltas is None:
        deltas = [weight_errors(model, names, s) for s in schemes]
    elif len(deltas) != len(schemes):
        raise ValueError(f"fisher_scores: {len(deltas)} sets of weight errors for {len(schemes)} schemes")
    acc = {p: {n: np.zeros(len(schemes)) for n in names} for p in PROXIES}
    window_sum: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}
    handles = []

    def on_grad(name: str):
        def hook(g: torch.Tensor) -> None:
            x = saved.pop(name)
            g = g.reshape(-1, g.shape[-1]).float()
            for c, d in enumerate(deltas):
                dy = x @ d[name].T  # (tokens, out): the change of this Linear's output
                gd = g * dy
                acc["diagonal"][name][c] += float(gd.pow(2).sum())
                per_token = gd.sum(-1)
                acc["token"][name][c] += float(per_token.pow(2).sum())
                window_sum[name][c] += per_token.sum()
        return hook

    def on_forward(name: str):
        def hook(mod, inputs, out):
            if out.requires_grad:
                saved[name] = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
                out.register_hook(on_grad(name))
        return hook

    def grad_from_embeddings(mod, inputs, out):
        return out.detach().requires_grad_(True)

    flags = {p: p.requires_grad for p in model.parameters()}
    gen = torch.Generator().manual_seed(seed)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        handles.append(model.get_input_embeddings().register_forward_hook(grad_from_embeddings))
        for n in names:
            handles.append(modules[n].register_forward_hook(on_forward(n)))
        with torch.enable_grad():
            for i in progress_bar(range(len(windows)), "search: Fisher scores", enabled=progress):
                for n in names:
                    window_sum[n] = torch.zeros(len(schemes))
                logits = model(input_ids=windows[i : i + 1]).logits[0, :-1].float()
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
                F.cross_entropy(logits, labels, reduction="sum").backward()
                for n in names:
                    acc["window"][n] += window_sum[n].pow(2).numpy()
    finally:
        for h in handles:
            h.remove()
        for p, f in flags.items():
            p.requires_grad_(f)
        saved.clear()
    tokens = len(windows) * (windows.shape[1] - 1)
    values = {p: {n: 0.5 * v / tokens for n, v in acc[p].items()} for p in PROXIES}
    return Scores(values, len(windows), tokens, time.perf_counter() - t0)


def _slice(ref: Reference, n: int) -> Reference:
    return Reference(ref.argmax[:n], ref.nll[:n], ref.topk_ids[:n], ref.topk_logprobs[:n])


@torch.no_grad()
def unit_kl(bench: Workbench, names: list[str], scheme: Scheme, windows: int) -> float:
    """The measured KL (mean over the first ``windows`` evaluation windows) with only the
    Linears ``names`` rounded to ``scheme`` — the quantity the proxy predicts."""
    if not 0 < windows <= len(bench.windows):
        raise ValueError(f"unit_kl: windows must be in 1..{len(bench.windows)}, got {windows}")
    ref = _slice(bench.reference, windows)  # before any weight changes: the reference is computed lazily
    modules = dict(bench.model.named_modules())
    deltas = weight_errors(bench.model, names, scheme)
    originals = {n: modules[n].weight.detach().clone() for n in names}
    try:
        for n in names:
            modules[n].weight.add_(deltas[n])
        ev = evaluate(plain_forward(bench.model), bench.windows[:windows], ref,
                      name="unit", seed=bench.seed, progress=False, workers=bench.workers)
    finally:
        for n in names:
            modules[n].weight.copy_(originals[n])
    return float(ev.kl_mean)


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def rank_correlation(a, b) -> float:
    """Spearman's rank correlation of two equally long sequences."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) != len(b) or len(a) < 3:
        raise ValueError(f"rank_correlation: need two sequences of the same length >= 3, got {len(a)} and {len(b)}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(np.sqrt((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom else 0.0
