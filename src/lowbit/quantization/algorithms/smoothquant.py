"""SmoothQuant: migrate activation outliers into the weights with a per-channel scale.

Xiao, Lin, Seznec, Wu, Demouth, Han, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models" (ICML 2023), §4.
"""

from __future__ import annotations

import torch

__all__ = ["smoothquant_scales", "smooth"]


def smoothquant_scales(
    act_absmax: torch.Tensor,
    weights: list[torch.Tensor],
    alpha: float = 0.5,
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """SmoothQuant (Xiao et al., ICML 2023), §4 eq. (4): the migration strength α::

        s_j = max(|X_j|)^α / max(|W_j|)^(1−α)

    so that ``X·diag(s)⁻¹`` and ``diag(s)·W`` split the range of channel ``j`` between
    them.  When several linears read the same input (q/k/v, gate/up) they share one
    ``s``, and ``max(|W_j|)`` is taken over all of their rows, as the reference does.

    Args:
        act_absmax: ``(in,)`` per-channel ``max|X_j|`` over the calibration tokens.
        weights: the ``(out_k, in)`` weights of the linears that read this input.
        alpha: migration strength in ``[0, 1]``; 0 leaves activations alone, 1 moves
            all of their range into the weights.
        eps: floor for both maxima and for ``s`` (channels that never fire, all-zero
            weight columns), so that ``s`` is finite and positive.

    Returns:
        ``(in,)`` float32 scales, all ``≥ eps``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_scales: alpha must be in [0, 1], got {alpha}")
    if not weights:
        raise ValueError("smoothquant_scales: needs at least one weight")
    n = act_absmax.shape[-1]
    for k, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != n:
            raise ValueError(f"smoothquant_scales: weights[{k}] has shape {tuple(w.shape)}; expected (out, {n})")
    x_max = act_absmax.detach().to(torch.float32).abs().clamp(min=eps)                    # (in,)
    w_max = torch.stack([w.detach().abs().amax(dim=0).to(torch.float32) for w in weights]).amax(dim=0)
    w_max = w_max.clamp(min=eps)                                                           # (in,)
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    if not torch.isfinite(s).all():
        raise ValueError("smoothquant_scales: act_absmax or the weights hold NaN or inf")
    return s.clamp(min=eps)


def smooth(
    prev_weight: torch.Tensor,
    prev_bias: torch.Tensor | None,
    next_weights: list[torch.Tensor],
    s: torch.Tensor,
    *,
    norm_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """SmoothQuant (Xiao et al., ICML 2023), §4 eq. (3): ``Y = (X diag(s)⁻¹)(diag(s) W)``.

    Folds ``1/s`` into whatever produces ``X`` and ``s`` into the linears that read it,
    so that the block computes the same function (in exact arithmetic) with a flatter
    ``X``.  Used by SmoothQuant and AWQ alike; returns new tensors, touches nothing.

    Args:
        prev_weight: what produces ``X``: a norm's ``(in,)`` weight, whose output is
            ``x̂ · (norm_offset + w)`` (RMSNorm / LayerNorm: 0; Gemma's ``1 + w``: 1),
            or a Linear's ``(in, in_prev)`` weight, whose output rows are channels of X.
        prev_bias: ``(in,)`` bias of the norm or linear, or ``None``.
        next_weights: ``(out_k, in)`` weights of the linears that read ``X``.
        s: ``(in,)`` positive scales (:func:`smoothquant_scales`, :func:`awq_scales`).
        norm_offset: see ``prev_weight``; only for a 1-D (norm) ``prev_weight``.

    Returns:
        ``(prev_weight', prev_bias', next_weights')`` in the input dtypes::

            norm:    w' = (offset + w) / s − offset,   b' = b / s
            linear:  W' = diag(s)⁻¹ W,                 b' = b / s
            next:    W_k' = W_k diag(s)

        Arithmetic is float32, then cast back.  (With a 1-D ``prev_weight`` and
        ``s = offset + w`` this folds a norm's weight into the next linears.)
    """
    n = s.shape[0]
    if s.dim() != 1 or not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError("smooth: s must be a 1-D tensor of finite positive scales")
    if prev_weight.shape[0] != n:
        raise ValueError(f"smooth: prev_weight has shape {tuple(prev_weight.shape)}; its first dim must be {n}")
    if prev_weight.dim() == 2 and norm_offset:
        raise ValueError("smooth: norm_offset applies to a norm's 1-D weight, not to a linear")
    if prev_bias is not None and prev_bias.shape != (n,):
        raise ValueError(f"smooth: prev_bias has shape {tuple(prev_bias.shape)}; expected ({n},)")
    for k, w in enumerate(next_weights):
        if w.dim() != 2 or w.shape[1] != n:
            raise ValueError(f"smooth: next_weights[{k}] has shape {tuple(w.shape)}; expected (out, {n})")
    s32 = s.detach().to(torch.float32)

    pw = prev_weight.detach().to(torch.float32)
    if pw.dim() == 1:
        new_prev = (norm_offset + pw) / s32 - norm_offset                    # (in,)
    else:
        new_prev = pw / s32[:, None]                                         # (in, in_prev)
    new_bias = None if prev_bias is None else (prev_bias.detach().to(torch.float32) / s32).to(prev_bias.dtype)
    new_next = [(w.detach().to(torch.float32) * s32[None, :]).to(w.dtype) for w in next_weights]  # (out_k, in)
    return new_prev.to(prev_weight.dtype), new_bias, new_next
