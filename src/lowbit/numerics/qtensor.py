"""Quantized tensors: the one numeric path every other part of lowbit uses.

``quantize(x, scheme)`` returns a :class:`QTensor` (codes plus scales), and
``dequantize`` turns it back into floats with the convention of :mod:`lowbit.numerics.scheme`::

    x ≈ (decode(code) − zero) · scale · global_scale

``fake_quantize`` gives the same numbers as ``dequantize(quantize(x))`` without
materialising the codes; it is what runs inside a model during evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ggml as G
from .ggml_search import rtn_params as ggml_rtn_params
from .granularity import blocked, from_matrix_view, matrix_view, unblocked
from .scheme import Scheme, _global_divisor

__all__ = ["QTensor", "QParams", "quantize", "dequantize", "fake_quantize", "sqnr", "compute_qparams", "NonFiniteError"]


class NonFiniteError(ValueError):
    """A tensor to quantize holds NaN or inf: its scales would be meaningless."""


@dataclass
class QParams:
    """Scales of one tensor: ``scale`` and ``zero`` are ``(R, C)`` per block (fp32,
    already rounded to how they are stored); ``global_scale`` is a 0-d fp32 tensor.

    GGUF k-quants (``scheme.ggml``) add a second level: ``super_scale`` (and ``super_min``)
    ``(R, C // sub-blocks per super-block)`` fp16 values, of which ``scale`` (and ``zero``)
    are whole multiples (:func:`lowbit.numerics.ggml.second_level`)."""

    scale: torch.Tensor
    zero: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    super_scale: torch.Tensor | None = None
    super_min: torch.Tensor | None = None


@dataclass
class QTensor:
    """A quantized tensor, unpacked.

    Attributes:
        codes: ``uint8`` bit patterns of the element format, shape of the original tensor.
        scale: ``(R, C)`` fp32 scale per block (see ``Granularity.scale_shape``).
        zero: ``(R, C)`` zero points in the element format's values, or ``None``.
        global_scale: 0-d fp32 tensor, or ``None``.
        scheme: the scheme the tensor was quantized with.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    global_scale: torch.Tensor | None
    scheme: Scheme
    super_scale: torch.Tensor | None = None
    super_min: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero, self.global_scale, self.super_scale, self.super_min)

    def values(self) -> torch.Tensor:
        """The element values ``decode(code)`` (fp32), before scaling."""
        return self.scheme.format.decode(self.codes)


def _check_finite(x: torch.Tensor, what: str) -> None:
    bad = ~torch.isfinite(x)
    if bad.any():
        n = int(bad.sum())
        raise NonFiniteError(
            f"{what}: {n} of {x.numel()} elements are NaN or inf; quantization scales would be "
            "corrupted. Fix the input (e.g. check the checkpoint for overflowed weights)."
        )


def compute_qparams(x: torch.Tensor, scheme: Scheme, global_scale: torch.Tensor | None = None) -> QParams:
    """Scales of ``x`` under ``scheme`` from its own block minima and maxima.

    For a scheme with a global scale, ``global_scale`` may be given (a calibrated
    activation scale); otherwise it is computed from ``x``.
    """
    m = matrix_view(x.detach(), scheme.granularity).to(torch.float32)
    if scheme.ggml:
        _check_finite(m, "quantize")
        scale, zero, super_scale, super_min = ggml_rtn_params(m, scheme.ggml_type)
        return QParams(scale, zero, None, super_scale, super_min)
    lo, hi, g = block_range(m, scheme, global_scale)  # NaN and inf propagate into these
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        _check_finite(x, "quantize")
    scale, zero = scheme.scales_from_range(lo, hi, g)
    return QParams(scale, zero, g)


def block_range(
    m: torch.Tensor, scheme: Scheme, global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per block of ``scheme``'s granularity of the ``(rows, cols)`` matrix ``m``: ``(lo, hi)``
    of shape ``(R, C)`` — for symmetric schemes ``±max|·|``, except with ``signed_scale``, whose
    scale follows the extreme's side — and the global scale of a two-level scheme
    (``global_scale``, else computed from ``m``; ``None`` for one-level schemes).  What min-max
    scales are computed from, and what clipping searches shrink."""
    b = blocked(m, scheme.granularity)                                       # (R, br, C, bc)
    lo, hi = b.amin(dim=(1, 3)), b.amax(dim=(1, 3))                          # (R, C)
    if scheme.symmetric and not scheme.signed_scale:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    if scheme.global_scale and global_scale is None:
        global_scale = scheme.global_scale_from_amax(hi.max())
    return lo, hi, (global_scale if scheme.global_scale else None)


def _effective_scale(qp: QParams) -> torch.Tensor:
    if qp.global_scale is None:
        return qp.scale
    return qp.scale / _global_divisor(qp.global_scale)


def _quantize_blocks(
    x: torch.Tensor, scheme: Scheme, qp: QParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """Element values (in the format's domain) of ``x``, as a blocked ``(R, br, C, bc)``
    tensor, with the broadcastable effective scale and zero."""
    m = matrix_view(x, scheme.granularity).to(torch.float32)
    rows, cols = m.shape
    b = blocked(m, scheme.granularity)
    s = _effective_scale(qp)[:, None, :, None]
    # a zero scale means an all-zero (or underflowed) block: dividing by inf sends every
    # element of it to zero (to the zero point, for asymmetric schemes); scales are negative
    # only where the scheme asks for it (signed_scale)
    safe = torch.where(s != 0, s, torch.full_like(s, float("inf")))
    scaled = b / safe
    z = None
    if qp.zero is not None:
        z = qp.zero[:, None, :, None]
        scaled.add_(z)
    q = scheme.format.round(scaled)
    return q, s, z, rows, cols


def quantize(x: torch.Tensor, scheme: Scheme, qparams: QParams | None = None) -> QTensor:
    """Quantize ``x`` with ``scheme``; scales come from ``qparams`` (static, calibrated)
    or from ``x`` itself.

    Raises:
        NonFiniteError: ``x`` holds NaN or inf.
    """
    if qparams is not None:
        _check_finite(x, "quantize")
    qp = qparams if qparams is not None else compute_qparams(x, scheme)
    if scheme.ggml:
        vals = G.element_values(matrix_view(x, scheme.granularity), scheme.ggml_type, qp.scale, qp.zero).reshape(x.shape)
    else:
        q, _, _, rows, cols = _quantize_blocks(x, scheme, qp)
        vals = from_matrix_view(unblocked(q, rows, cols), tuple(x.shape), scheme.granularity)
    codes = scheme.format.encode(vals)
    return QTensor(codes, qp.scale, qp.zero, qp.global_scale, scheme, qp.super_scale, qp.super_min)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(decode(code) − zero) · scale · global_scale`` in ``dtype``."""
    scheme = qt.scheme
    v = matrix_view(qt.values(), scheme.granularity)
    if scheme.ggml:
        return G.dequantize_values(v, scheme.ggml_type, qt.scale, qt.zero).reshape(qt.shape).to(dtype)
    rows, cols = v.shape
    b = blocked(v, scheme.granularity)
    qp = qt.qparams
    if qp.zero is not None:
        b = b - qp.zero[:, None, :, None]
    out = b * _effective_scale(qp)[:, None, :, None]
    return from_matrix_view(unblocked(out, rows, cols), qt.shape, scheme.granularity).to(dtype)


def fake_quantize(x: torch.Tensor, scheme: Scheme, qparams: QParams | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype, without materialising codes.

    With scales computed from ``x``, NaN or inf in ``x`` raise :class:`NonFiniteError`.
    With given (static) ``qparams`` no check is made, for speed inside a model: inf
    saturates to the largest code and NaN stays NaN in the output.
    """
    qp = qparams if qparams is not None else compute_qparams(x, scheme)
    if scheme.ggml:
        t, m = scheme.ggml_type, matrix_view(x, scheme.granularity)
        return G.dequantize_values(G.element_values(m, t, qp.scale, qp.zero), t, qp.scale, qp.zero).reshape(x.shape).to(x.dtype)
    q, s, z, rows, cols = _quantize_blocks(x, scheme, qp)
    if z is not None:
        q = q.sub_(z)
    out = q.mul_(s)
    return from_matrix_view(unblocked(out, rows, cols), tuple(x.shape), scheme.granularity).to(x.dtype)


def sqnr(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10·log10(Σx² / Σ(x − x̂)²)``
    (``inf`` when the two are equal)."""
    x = x.to(torch.float64)
    noise = (x - x_hat.to(torch.float64)).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(x.pow(2).sum() / noise))
