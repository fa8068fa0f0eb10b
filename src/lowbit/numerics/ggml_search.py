"""The k-quants' (and iq4_nl's) round to nearest as llama-quantize does it: a refit, not the block's range.

For q3_k, q4_k, q5_k, q6_k and iq4_nl, llama-quantize does not take a (sub-)block's scale (and
min) from its range.  It rounds the block at a few inverse scales around the range's
one, refits the scale (and min) to each rounding by weighted least squares, and keeps the
fit of least weighted error.  :func:`rtn_params` is that search, batched over every
sub-block of a matrix; its candidates and weights are ggml's (``ggml-quants.c``,
``make_qkx2_quants`` / ``make_qx_quants`` / ``quantize_row_iq4_nl_impl`` and their callers):

======  ======================================  ==========================  ==================
type    inverse scales tried                    weights                     fit
======  ======================================  ==========================  ==================
q4_k    (15 − 1 + 0.1 k) / (max − min), k ≤ 20  rms(block) + |x|            scale and min;
q5_k    (31 − 0.5 + 0.1 k) / (max − min), k ≤ 15                            min ≤ 0
q3_k    −(4 + 0.1 k) / xₘ, k = −9 … 9           x²                          scale only
q6_k    −(32 + 0.1 k) / xₘ, k = −9 … 9          x²                          scale only
iq4_nl  127 / xₘ, (k − 127) / xₘ, k = −7 … 7    x²                          scale only, on the
        (lowbit adds 113 / xₘ)                                              table (nearest entry)
======  ======================================  ==========================  ==================

``min`` is the block's minimum held ≤ 0 (as :func:`lowbit.numerics.ggml.block_params`),
``xₘ`` its element of largest magnitude with its sign.  The min-max parameters are a
candidate too, so the search never keeps a sub-block fit worse (under its weights) than min-max's.
The fitted sub-block scales then go through the same second level (6-/8-bit codes against
fp16 super-scales, :func:`lowbit.numerics.ggml.second_level`); iq4_nl's block scale is stored as fp16.

q3_k: llama-quantize runs this candidate search (``make_qx_quants(…, nmax=4, …)``) only with an
importance matrix; without one it calls the reference quantizer, whose ``make_q3_quants`` refits
the rounding at ``xₘ / −4`` and then moves single elements to another level while that improves
the x²-weighted fit (a coordinate descent that, by its acceptance test, only runs for sub-blocks
whose signed extreme is negative).  lowbit runs the candidate search on both paths: one batched
code path with q6_k's, weighted by the importance when there is one, as llama.cpp's own imatrix
path.  It does not reproduce the reference's no-imatrix bytes, and on Gaussian weights its plain
squared error is 0.97× min-max's (``tests/numerics/test_ggml_search.py``) where a throwaway
re-implementation of the reference's descent reached 0.95× on the same weights: the x²-weighted
objective both optimize is not the plain error.

Beyond a smaller error, the refit finds a grid the weights already lie on: re-quantizing a
model shipped as a GGUF and dequantized (the packaged Gemma-3-270m is a Q4_K_M file) gives
back its stored values, where min-max rounds them a second time
(``tests/numerics/test_ggml_search.py``).

With an ``importance`` per input column (an activation second moment, as llama.cpp's
imatrix), the weights are ``importance · sqrt(σ² + x²)`` with ``σ²`` twice the mean square of
the super-block (llama.cpp's weighting for q3_k/q4_k/q5_k and iq4_nl — whose "super-block" is
its block of 32 — with an imatrix; lowbit uses it for q6_k too).
"""

from __future__ import annotations

import torch

from . import ggml as G

__all__ = ["rtn_params", "search_weights"]

#: per type: (largest code counted from the block's low end, first step, step, last index)
_AFFINE = {"q4_k": (15, -1.0, 0.1, 20), "q5_k": (31, -0.5, 0.1, 15)}
_SYMMETRIC_STEPS = [0.1 * k for k in range(-9, 10)]
_GRID_STEPS = range(-7, 8)                                # iq4_nl: ggml's offsets from the table's low end
_REFITS = 2                                              # rounds at the best fit, refit (lowbit's)
_CHUNK = 1 << 16                                          # sub-blocks per batched fit


def search_weights(b: torch.Tensor, t: G.GGMLType, importance: torch.Tensor | None = None) -> torch.Tensor:
    """The per-element weights of the fit for sub-blocks ``b`` ``(rows, blocks, block)``;
    ``importance`` is ``(rows, blocks, block)`` or ``None``."""
    if importance is not None:
        per = t.super_block // t.block
        rows, nb, n = b.shape
        sup = b.reshape(rows, nb // per, per * n)
        sigma2 = 2 * sup.pow(2).mean(dim=-1, keepdim=True)
        return importance * (sigma2 + sup.pow(2)).sqrt().reshape(b.shape)
    if t.has_min:
        return b.pow(2).mean(dim=-1, keepdim=True).sqrt() + b.abs()
    return b.pow(2)


def rtn_params(m: torch.Tensor, t: G.GGMLType, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest parameters of ``m`` ``(rows, cols)`` in ggml type ``t`` as llama-quantize
    chooses them: the one-level types from each block's range
    (:func:`lowbit.numerics.ggml.minmax_params`), the k-quants by the search above.
    ``importance``: ``(rows, cols)`` non-negative weights, or ``None`` for ggml's defaults.

    Returns ``(scale, zero, super_scale, super_min)`` as :func:`lowbit.numerics.ggml.minmax_params`.
    """
    if not t.two_level and not t.grid:
        return G.minmax_params(m, t)
    b = G.subblock_view(m.to(torch.float32), t)
    rows, nb, n = b.shape
    imp = None if importance is None else G.subblock_view(importance.to(torch.float32), t)
    w, x = search_weights(b, t, imp).reshape(-1, n), b.reshape(-1, n)
    scales, offsets = [], []
    for i in range(0, x.shape[0], _CHUNK):                # a bounded slice of sub-blocks at a time
        xc, wc = x[i:i + _CHUNK], w[i:i + _CHUNK]
        if t.has_min:
            sc, o = _affine_fit(xc, wc, *_AFFINE[t.name])
            offsets.append(o.float())
        else:
            sc = _symmetric_fit(xc, wc, t)
        scales.append(sc.float())
    scale = torch.cat(scales).reshape(rows, nb)
    if not t.two_level:
        return G._fp16(scale), None, None, None
    return G.second_level(scale, torch.cat(offsets).reshape(rows, nb) if t.has_min else None, t)


def _rowsum(v: torch.Tensor) -> torch.Tensor:
    """``v.sum(-1)`` as a matrix-vector product (on this project's 2-core CPU 1.6× faster than
    torch's reduction over a last dimension of 32), returned in float64 for the fits' solves."""
    return (v @ torch.ones(v.shape[-1], 1, dtype=v.dtype, device=v.device)).squeeze(-1).double()


def _sums(w: torch.Tensor, x: torch.Tensor, levels: torch.Tensor):
    """``Σ w·l``, ``Σ w·l²``, ``Σ w·x·l`` per row."""
    wl = w * levels
    return _rowsum(wl), _rowsum(wl * levels), _rowsum(wl.mul_(x))


def _ones_where_not(mask: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, v, torch.ones_like(v))


def _affine_fit(x: torch.Tensor, w: torch.Tensor, top: int, first: float, step: float, last: int):
    """Per row of ``x`` ``(N, n)``: the scale ``s > 0`` and offset ``o ≥ 0`` (``x ≈ s·l − o``,
    ``l`` in ``[0, top]``) of least ``Σ w (s·l − o − x)²`` among the min-max fit, the least-squares
    refits of the roundings at the inverse scales ``(top + first + step·k) / range``, and (lowbit's
    addition) refits of the rounding at the best fit so far.  Errors are in closed form from the
    sums; returns float64 ``(s, o)``."""
    lo = x.amin(dim=-1).clamp(max=0.0)
    rng = x.amax(dim=-1) - lo
    live = rng > 0
    rng = _ones_where_not(live, rng)
    rel = x - lo[:, None]
    wx = w * x
    sw, swx, swx2 = _rowsum(w), _rowsum(wx), _rowsum(wx * x)

    def error(s, m, swl, swl2, swxl):        # Σ w (s·l + m − x)², expanded
        return s * s * swl2 + m * m * sw + swx2 + 2 * (s * m * swl - s * swxl - m * swx)

    scale = torch.where(live, rng / top, torch.zeros_like(rng)).double()
    mn = lo.double()
    best = error(scale, mn, *_sums(w, x, torch.round(rel * (top / rng)[:, None]).clamp_(0, top)))
    for i in range(last + 1 + _REFITS):
        if i <= last:
            levels = (rel * ((top + first + step * i) / rng)[:, None]).round_().clamp_(0, top)
        else:                                             # re-round at the best fit so far, refit
            safe = _ones_where_not(scale > 0, scale).float()
            levels = ((x - mn.float()[:, None]) / safe[:, None]).round_().clamp_(0, top)
        swl, swl2, swxl = _sums(w, x, levels)
        det = sw * swl2 - swl * swl
        solvable = det > 0
        det = _ones_where_not(solvable, det)
        s = (sw * swxl - swx * swl) / det
        m = (swl2 * swx - swl * swxl) / det
        above = m > 0                                     # the min is held at or below 0
        s = torch.where(above, swxl / _ones_where_not(swl2 > 0, swl2), s)
        m = torch.where(above, torch.zeros_like(m), m)
        e = error(s, m, swl, swl2, swxl)
        take = live & solvable & (s > 0) & (e < best)
        scale, mn, best = torch.where(take, s, scale), torch.where(take, m, mn), torch.where(take, e, best)
    return scale, -mn


def _inverse_scales(t: G.GGMLType) -> list[float]:
    """The candidate inverse scales of a symmetric type, as multiples of ``1 / xₘ``: ggml's
    ``−(top + 0.1 k)`` (``top = −vmin``) for the integer grids; for iq4_nl's table (entries
    ``g₀ … g₁₅``) ggml's ``−g₀`` (the extreme toward the high end, where it saturates) and
    ``g₀ + k``, and lowbit's ``g₁₅`` (the extreme exactly on the highest entry: without it a block
    stored that way is not always found again)."""
    if t.grid:
        g0 = float(t.grid[0])
        return [-g0] + [g0 + k for k in _GRID_STEPS] + [float(t.grid[-1])]
    return [-(-t.vmin + step) for step in _SYMMETRIC_STEPS]


def _symmetric_fit(x: torch.Tensor, w: torch.Tensor, t: G.GGMLType) -> torch.Tensor:
    """Per row of ``x`` ``(N, n)``: the signed scale ``s`` (``x ≈ s·l``, ``l`` an element value of
    ``t``: an integer in ``[vmin, vmax]`` or, for iq4_nl, a table entry; the rounding is
    :func:`lowbit.numerics.ggml.round_values`) of least ``Σ w (s·l − x)²`` among ``xₘ / vmin``, the
    least-squares refits of the roundings at the inverse scales :func:`_inverse_scales` and
    (lowbit's addition) refits of the rounding at the best fit so far.  Returns float64 ``s``."""
    xm = G._signed_extreme(x)
    live = xm != 0
    xm_safe = _ones_where_not(live, xm)
    swx2 = _rowsum(w * x * x)
    scale = torch.where(live, xm / t.vmin, torch.zeros_like(xm))
    _, swl2, swxl = _sums(w, x, G.round_values(x / _ones_where_not(live, scale)[:, None], t))
    scale = scale.double()
    best = scale * scale * swl2 - 2 * scale * swxl + swx2
    inverse = _inverse_scales(t)
    for i in range(len(inverse) + _REFITS):
        if i < len(inverse):
            levels = G.round_values(x * (inverse[i] / xm_safe)[:, None], t)
        else:                                             # re-round at the best fit so far, refit
            levels = G.round_values(x / _ones_where_not(scale != 0, scale).float()[:, None], t)
        _, swl2, swxl = _sums(w, x, levels)
        ok = swl2 > 0
        s = swxl / _ones_where_not(ok, swl2)
        e = swx2 - s * swxl                               # at the least-squares s
        take = live & ok & (e < best)
        scale, best = torch.where(take, s, scale), torch.where(take, e, best)
    return scale
