"""Round-to-nearest observers: how the scales of plain rounding are chosen.

Min-max is :func:`lowbit.numerics.qtensor.compute_qparams`.  This module adds the MSE observer:
a search over clipping ratios per block, optionally weighted by how much each input
channel matters (activation-weighted, as llama.cpp's importance matrix and
llm-compressor's weighted MSE observer).
"""

from __future__ import annotations

import torch

from ...numerics import ggml as G
from ...numerics.ggml_search import rtn_params as ggml_rtn_params
from ...numerics.granularity import blocked, matrix_shape, matrix_view
from ...numerics.qtensor import QParams, _check_finite, block_range, fake_quantize
from ...numerics.scheme import Scheme

__all__ = ["mse_qparams", "clip_ratios"]


def clip_ratios(grid: int, max_shrink: float) -> list[float]:
    """``1, 1 − 1/grid, …, 1 − max_shrink``: the ratios a clipping search tries, largest
    first (so that ties keep the min-max range)."""
    if grid < 1 or not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"clip ratios need grid ≥ 1 and 0 ≤ max_shrink < 1, got grid={grid}, max_shrink={max_shrink}")
    steps = int(round(max_shrink * grid))
    return [1.0 - k / grid for k in range(steps + 1)]


class _BestPerBlock:
    """The running best of a clipping search, block by block: :meth:`offer` takes a
    candidate's per-block error and its ``(scale, zero)`` and keeps them where the error
    is strictly smaller than the best so far (so ties keep the earlier candidate)."""

    __slots__ = ("err", "scale", "zero")

    def __init__(self) -> None:
        self.err = self.scale = self.zero = None

    def offer(self, err: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        if self.err is None:
            self.err, self.scale, self.zero = err, scale, zero
            return
        better = err < self.err
        self.err = torch.where(better, err, self.err)
        self.scale = torch.where(better, scale, self.scale)
        if zero is not None:
            self.zero = torch.where(better, zero, self.zero)


def mse_qparams(
    w: torch.Tensor,
    scheme: Scheme,
    *,
    grid: int = 100,
    max_shrink: float = 0.2,
    importance: torch.Tensor | None = None,
    norm: float = 2.0,
    global_scale: torch.Tensor | None = None,
) -> QParams:
    """MSE observer: the grid search over clipping ratios of the GPTQ reference
    quantizer (Frantar et al., ICLR 2023, code ``quant.py``, ``mse=True``) and of
    llm-compressor's MSE observer, optionally weighted by input-channel importance
    (llama.cpp's importance matrix): per block ``b`` choose the clipping ratio

        r_b = argmin_{r ∈ {1, 1−1/grid, …, 1−max_shrink}}  Σ_{(i,j) ∈ b} a_j · |w_ij − Q_r(w_ij)|^p

    where ``Q_r`` quantizes with the scale of the shrunk range ``[r·min, r·max]``
    (both ends shrink together; values outside saturate), ``a_j`` is the importance of
    input channel ``j`` (e.g. mean ``x_j²`` over calibration tokens) and ``p = norm``.

    Ratio 1 is the min-max scale and is tried first, and ties keep it, so the result is
    never worse than min-max on this objective.  Scales are rounded to their storage
    format *inside* the search (E8M0 powers of two, NVFP4's FP8 block scales), so the
    error compared is the error that will be stored.

    Args:
        w: tensor to quantize, viewed as ``(rows, cols)`` (a Linear's ``(out, in)``).
        scheme: any scheme; its granularity defines the blocks.
        grid, max_shrink: the ratios tried (:func:`clip_ratios`).
        importance: ``(cols,)`` non-negative weights, or ``None`` for uniform.
        norm: the exponent ``p`` of the error.
        global_scale: for two-level schemes (NVFP4), the tensor's global scale; default
            computed from ``w`` as min-max does.  It is not searched.

    Returns:
        :class:`QParams` with ``(R, C)`` scales (and zeros).  Cost: ``len(ratios)``
        fake-quantizations of ``w``.
    """
    gran = scheme.granularity
    rows, cols = matrix_shape(tuple(w.shape), gran)
    _check_finite(w, "mse_qparams")
    m = matrix_view(w.detach(), gran).to(torch.float32)                      # (rows, cols)
    if importance is None:
        weight = None
    else:
        imp = importance.detach().to(torch.float32).reshape(-1)
        if imp.shape[0] != cols or (imp < 0).any() or not torch.isfinite(imp).all():
            raise ValueError(f"mse_qparams: importance must be ({cols},) finite and non-negative, got {tuple(importance.shape)}")
        weight = blocked(imp.expand(rows, cols), gran)                       # (R, br, C, bc)
    if scheme.ggml:
        return _ggml_search(m, scheme.ggml_type, clip_ratios(grid, max_shrink), weight, norm)
    lo, hi, g = block_range(m, scheme, global_scale)                        # (R, C)

    best = _BestPerBlock()
    for r in clip_ratios(grid, max_shrink):
        scale, zero = scheme.scales_from_range(lo * r, hi * r, g)
        q = matrix_view(fake_quantize(w.detach().to(torch.float32), scheme, QParams(scale, zero, g)), gran)
        e = blocked((m - q).abs_().pow_(norm), gran)                         # (R, br, C, bc)
        if weight is not None:
            e = e.mul_(weight)
        err = e.sum(dim=(1, 3))                                              # (R, C)
        best.offer(err, scale, zero)
    return QParams(best.scale, best.zero, g)


def _ggml_search(m: torch.Tensor, t: G.GGMLType, ratios: list[float], weight: torch.Tensor | None,
                 norm: float) -> QParams:
    """The clipping search on a GGUF type's exact grid: per block, the candidate whose stored
    parameters give the least (weighted) error.  Candidates: llama-quantize's round to nearest
    (:func:`lowbit.numerics.ggml_search.rtn_params`: for k-quants a least-squares refit of each
    sub-block's scale and min, weighted by the importance when there is one) and the range shrunk
    by each ratio (:func:`lowbit.numerics.ggml.block_params`).  For k-quants the super-scales
    stay those of the first candidate and each sub-block's quantized 6-/8-bit scale is searched
    against them, so every candidate is evaluated with the two-level rounding that will be stored."""
    rows, cols = m.shape
    w = None if weight is None else weight.reshape(rows, cols // t.block, t.block)
    first = ggml_rtn_params(m, t, None if w is None else w.reshape(rows, cols))
    supers = (first[2], first[3]) if t.two_level else None
    best = _BestPerBlock()
    candidates = [first] + [G.block_params(m, t, r, supers) for r in ratios if t.two_level or r != 1.0]
    for scale, zero, _, _ in candidates:
        q = G.dequantize_values(G.element_values(m, t, scale, zero), t, scale, zero)
        e = (m - q).abs_().pow_(norm).reshape(rows, cols // t.block, t.block)
        if w is not None:
            e = e.mul_(w)
        best.offer(e.sum(dim=-1), scale, zero)
    return QParams(best.scale, best.zero, None, first[2], first[3])
