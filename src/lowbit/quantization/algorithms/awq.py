"""AWQ: activation-aware weight quantization — per-channel scaling and clipping search.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight
Quantization for On-Device LLM Compression and Acceleration" (MLSys 2024), §3.2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ...numerics.granularity import block, blocked, unblocked
from ...numerics.qtensor import QParams, _check_finite, block_range, fake_quantize
from ...numerics.scheme import Scheme
from .rtn import _BestPerBlock, clip_ratios

__all__ = ["awq_scales", "awq_clip", "OutFn"]

#: ``out_fn(x, weights) -> output``: what a balancing group computes from its input
#: ``x`` and its linears' weights, when that is more than the parallel products ``x Wₖᵀ``
#: (e.g. ``silu(x W_gateᵀ) · (x W_upᵀ)``).
OutFn = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


def awq_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    scheme: Scheme,
    *,
    grid: int = 20,
    out_fn: OutFn | None = None,
    duo_scaling: bool = False,
    n_tokens: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, float]:
    """AWQ (Lin et al., MLSys 2024), §3.2 eq. (4)–(5): the per-input-channel scale ``s``
    that protects salient channels, searched over one exponent per balancing group::

        s = s_X^α,   α* = argmin_α  Σ_k ‖ Q(W_k · diag(s)) (diag(s)⁻¹ · Xᵀ) − W_k Xᵀ ‖²

    with ``s_X`` the mean ``|x_j|`` per input channel and ``α ∈ {0, 1/grid, …, 1}``.
    Each ``s`` is normalised to ``s / √(max s · min s)`` (as the reference does, so
    that scales sit around 1).  ``α = 0`` is ``s = 1``, plain rounding, and ties keep
    the smaller α, so the chosen ``s`` is never worse than RTN on the calibration set.

    Args:
        x: ``(tokens, in)`` calibration inputs of the balancing group.
        weights: the ``(out_k, in)`` weights of the linears that read ``x``.
        scheme: the weight scheme ``Q`` they will be quantized with.
        grid: number of steps of α.
        out_fn: the group's output, if not the parallel products (see :data:`OutFn`);
            it must accept the scaled input and the quantized scaled weights.
        duo_scaling: ``s = s_X^α / s_W^(1−α)`` with ``s_W`` the mean of ``|W|``
            normalised by its scale block's max (AutoAWQ / llm-compressor's default).
        n_tokens: measure the error on this many tokens drawn with ``seed``
            (``s_X`` always uses all of them); ``None``: all.

    Returns:
        ``(s, α)``: the ``(in,)`` float32 scales to fold with
        :func:`lowbit.quantization.algorithms.smoothquant.smooth` (``X → X/s``, ``W_k → W_k s``), and
        the chosen α.  Cost: ``grid + 1`` fake-quantizations, each judged by ``in²·Σ out_k``
        multiply-adds (``tokens·in·Σ out_k`` with ``out_fn``, which runs the group).
    """
    if grid < 1:
        raise ValueError(f"awq_scales: grid must be ≥ 1, got {grid}")
    xf = _check_inputs(x, weights, "awq_scales")
    ws = [w.detach().to(torch.float32) for w in weights]
    s_x = xf.abs().mean(dim=0)                                               # (in,)
    s_w = _normalised_weight_mean(ws, scheme) if duo_scaling else None       # (in,)
    xe = _subsample(xf, n_tokens, seed)                                      # (t, in)
    error = _output_error(xe, ws) if out_fn is None else _fn_error(xe, ws, out_fn)

    best = (math.inf, torch.ones_like(s_x), 0.0)
    for k in range(grid + 1):
        alpha = k / grid
        s = s_x.pow(alpha) if s_w is None else s_x.pow(alpha) / s_w.pow(1.0 - alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()                                   # (in,)
        err = error(s, [fake_quantize(w * s, scheme) for w in ws])           # Q(W_k · diag(s))
        if err < best[0]:
            best = (err, s, alpha)
    if not math.isfinite(best[0]):
        raise ValueError("awq_scales: the output error is not finite for any α")
    return best[1], best[2]


ErrFn = Callable[[torch.Tensor, list[torch.Tensor]], float]


def _output_error(x: torch.Tensor, ws: list[torch.Tensor]) -> ErrFn:
    """``(s, [Q(W_k·diag(s))]) ↦ Σ_k ‖(X/s) Q_kᵀ − X W_kᵀ‖²`` through the Gram matrix:
    with ``D_k = Q_k·diag(1/s) − W_k`` the error is ``Σ_k Σ_rows d G dᵀ``, ``G = XᵀX``.

    The same number as the products themselves, for ``in²·out`` multiply-adds per call
    instead of ``tokens·in·out`` (AWQ samples thousands of tokens; layers are hundreds to a
    few thousand wide), and without subtracting two outputs of nearly equal size: on
    Gaussian inputs with salient channels it is within 1e-8 of the float64 products."""
    g = x.T @ x                                                              # (in, in)

    def error(s: torch.Tensor, q: list[torch.Tensor]) -> float:
        d = torch.cat([qk / s - w for qk, w in zip(q, ws)])                  # (Σ out_k, in)
        return float(((d @ g) * d).sum(dtype=torch.float64))
    return error


def _fn_error(x: torch.Tensor, ws: list[torch.Tensor], out_fn: OutFn) -> ErrFn:
    """``(s, [Q(W_k·diag(s))]) ↦ ‖out_fn(X/s, Q) − out_fn(X, W)‖²``."""
    ref = out_fn(x, ws)

    def error(s: torch.Tensor, q: list[torch.Tensor]) -> float:
        return float((out_fn(x / s, q) - ref).pow(2).sum())
    return error


def awq_clip(
    x: torch.Tensor,
    w: torch.Tensor,
    scheme: Scheme,
    *,
    grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    seed: int = 0,
    global_scale: torch.Tensor | None = None,
) -> QParams:
    """AWQ (Lin et al., MLSys 2024), the weight-clipping search (§3.2 and the reference's
    ``auto_clip``): per scale block ``b`` choose the ratio ``r`` that minimises the
    block's contribution to the output error on calibration inputs::

        r_b = argmin_r  Σ_tokens Σ_{rows i ∈ b} ( Σ_{cols j ∈ b} x_tj (w_ij − Q_r(w_ij)) )²

    ``Q_r`` uses the scale of the shrunk range ``[r·min, r·max]`` (both ends shrink
    together), ``r ∈ {1, 1 − 1/grid, …, 1 − max_shrink}``.  Ratio 1 (min-max) is tried
    first and kept on ties, so no block is worse than min-max on this objective.

    Args:
        x: ``(tokens, in)`` inputs of the linear (after any AWQ scaling).
        w: ``(out, in)`` weight (after any AWQ scaling).
        scheme: weight scheme with channel, group, block or tensor granularity.
        grid, max_shrink: the ratios tried (:func:`lowbit.quantization.algorithms.rtn.clip_ratios`).
        n_tokens: tokens used (drawn with ``seed``); the cost is
            ``len(ratios) · n_tokens · in · out`` multiply-adds.
        global_scale: for NVFP4, the tensor's global scale (default from ``w``).

    Returns:
        :class:`QParams` for ``w``, for :func:`lowbit.numerics.qtensor.quantize` or GPTQ.
    """
    xf = _check_inputs(x, [w], "awq_clip")
    wf = w.detach().to(torch.float32)
    rows, cols = wf.shape
    gran = scheme.granularity
    if gran.kind not in ("tensor", "channel", "group", "block"):
        raise ValueError(f"awq_clip: {gran} is not a weight granularity")
    br, gc = gran.block_shape(rows, cols)
    br, gc = min(br, rows), min(gc, cols)
    xe = _subsample(xf, n_tokens, seed)                                      # (t, in)

    lo, hi, g = block_range(wf, scheme, global_scale)                       # (R, C)

    xg = _column_groups(xe, gc)                                              # (C, t, gc)
    ref = torch.bmm(xg, _column_groups(wf, gc).transpose(1, 2))              # (C, t, out) partial outputs
    best = _BestPerBlock()
    for r in clip_ratios(grid, max_shrink):
        scale, zero = scheme.scales_from_range(lo * r, hi * r, g)
        q = fake_quantize(wf, scheme, QParams(scale, zero, g))               # (out, in)
        d = torch.bmm(xg, _column_groups(q, gc).transpose(1, 2)).sub_(ref)  # (C, t, out)
        per_row = d.pow_(2).sum(dim=1).T                                     # (out, C)
        err = blocked(per_row, block(br, 1)).sum(dim=(1, 3))              # (R, C)
        best.offer(err, scale, zero)
    return QParams(best.scale, best.zero, g)


def _check_inputs(x: torch.Tensor, weights: list[torch.Tensor], what: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be (tokens, in), got shape {tuple(x.shape)}")
    if not weights:
        raise ValueError(f"{what}: needs at least one weight")
    for k, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(f"{what}: weight {k} has shape {tuple(w.shape)}; expected (out, {x.shape[1]})")
        _check_finite(w, what)
    _check_finite(x, what)
    return x.detach().to(torch.float32)


def _subsample(x: torch.Tensor, n: int | None, seed: int) -> torch.Tensor:
    if n is None or x.shape[0] <= n:
        return x
    # a seeded CPU generator: the same sample on every device
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]  # device: CPU-generated
    return x[idx.sort().values.to(x.device)]


def _column_groups(m: torch.Tensor, gc: int) -> torch.Tensor:
    """``(n, cols)`` → ``(ceil(cols/gc), n, gc)``, zero-padding a ragged last group."""
    n, cols = m.shape
    pad = (-cols) % gc
    if pad:
        m = torch.nn.functional.pad(m, (0, pad))
    return m.reshape(n, -1, gc).transpose(0, 1)


def _normalised_weight_mean(ws: list[torch.Tensor], scheme: Scheme) -> torch.Tensor:
    """Mean over all rows of ``|W|`` divided by its scale block's absmax, per input channel."""
    parts = []
    for w in ws:
        b = blocked(w.abs(), scheme.granularity)                            # (R, br, C, bc)
        amax = b.amax(dim=(1, 3), keepdim=True)
        n = b / torch.where(amax > 0, amax, torch.ones_like(amax))
        parts.append(unblocked(n, *w.shape))                                 # (out_k, in)
    return torch.cat(parts, dim=0).mean(dim=0).clamp(min=1e-4)
