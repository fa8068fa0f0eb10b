"""Outlier channels kept in high precision (mixed-precision decomposition).

Dettmers, Lewis, Belkada, Zettlemoyer, "LLM.int8(): 8-bit Matrix Multiplication for
Transformers at Scale" (NeurIPS 2022), §3.2.
"""

from __future__ import annotations

import torch

from ...numerics.qtensor import fake_quantize
from ...numerics.scheme import Scheme

__all__ = ["outlier_channels", "fake_quantize_with_outliers"]


def outlier_channels(
    act_absmax: torch.Tensor,
    threshold: float | None = 6.0,
    *,
    top_k: int | None = None,
) -> torch.Tensor:
    """LLM.int8() (Dettmers et al., NeurIPS 2022), §3.2: the set of outlier feature
    dimensions ``O = {j : max|X_j| ≥ α}`` with ``α = 6`` in the paper; or, with
    ``top_k``, the ``k`` channels of largest ``max|X_j|`` (a fixed budget, which a
    per-model threshold cannot promise).

    Args:
        act_absmax: ``(in,)`` per-channel ``max|X_j|`` over calibration tokens.
        threshold: α; ignored when ``top_k`` is given.
        top_k: number of channels to keep instead of a threshold.

    Returns:
        Sorted ``int64`` channel indices.
    """
    a = act_absmax.detach().reshape(-1)
    if top_k is not None:
        if not 0 <= top_k <= a.numel():
            raise ValueError(f"outlier_channels: top_k must be in [0, {a.numel()}], got {top_k}")
        return torch.topk(a, top_k).indices.sort().values
    if threshold is None:
        raise ValueError("outlier_channels: give a threshold or top_k")
    return torch.nonzero(a >= threshold).reshape(-1)


def fake_quantize_with_outliers(x: torch.Tensor, scheme: Scheme, keep_cols: torch.Tensor) -> torch.Tensor:
    """LLM.int8() §3.2, the mixed-precision decomposition: ``XW ≈ X_O W_O + Q(X_Ō) Q(W_Ō)`` — the columns in
    ``keep_cols`` stay exact, the rest are fake-quantized with ``scheme``, with scales
    computed *without* the kept columns (they are removed from the low-precision product,
    so they must not widen its ranges).

    Works for a weight ``(out, in)`` (keep input columns of ``W``) and for activations
    ``(…, in)`` with a per-token scheme (keep the same channels of ``X``).

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    keep = torch.as_tensor(keep_cols, dtype=torch.long, device=x.device).reshape(-1)
    cols = x.shape[-1]
    if keep.numel() and (keep.min() < 0 or keep.max() >= cols):
        raise ValueError(f"fake_quantize_with_outliers: keep_cols must be in [0, {cols}), got {keep.tolist()[:8]}")
    rest = x.clone()
    rest[..., keep] = 0                       # zero adds nothing to a block's range (0 is always representable)
    out = fake_quantize(rest, scheme)
    out[..., keep] = x[..., keep]
    return out
