"""Learned rounding and clipping: per-weight rounding offsets and per-block clip factors,
tuned by signed gradient descent to minimise a block's output error.

The problem is AdaRound's (Nagel et al., "Up or Down? Adaptive Rounding for Post-Training
Quantization", ICML 2020, §3–4: choose each weight's rounding direction to minimise a
layer's or block's output error, not the weight error); the optimizer is SignRound's
(Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the Quantization
of LLMs", 2023/2024, §3, eq. 1–4): an offset ``V`` added before rounding, with rounding
passed through by the straight-through estimator, and clip factors on each block's range,
all updated by ``p ← p − lr · sign(∂L/∂p)`` with a linearly decaying ``lr``.  Written for
lowbit's numerics, not taken from either paper's code.

For a weight ``W`` with the scale ``s`` and zero ``z`` of its initial quantization
(min-max, an MSE or AWQ clipping search, or GPTQ), in the element domain ``y = W / s``::

    code = round_fmt(y + (V₀ + V) · step(y) + z)        Ŵ = (code − z) · s

``round_fmt`` is the element format's own rounding (integers, or the non-uniform FP4/FP8
grids), ``step(y)`` the format's grid spacing at ``|y|`` (1 for integers; for minifloats
the spacing of ``y``'s binade, so an offset of 1 is one grid step wherever ``y`` lies).
``V₀`` places the start exactly on the initial codes: 0 when they are round-to-nearest of
``W`` at their scales (then ``V ∈ [−½, ½]`` reaches both neighbours, AdaRound's space),
else ``(ŷ₀ − y) / step(y)`` with ``V ∈ [−1, 1]`` (one grid step either way).  For GPTQ the
pipeline passes as ``W`` the weights GPTQ rounded (each column with the error fed back to
it): their round-to-nearest is GPTQ's result, so it starts in AdaRound's space too.  (With
``W`` the float weights it would start on grid points, where every offset must travel ½
before any code changes; measured on SmolLM2 layers 0 and 10, 64 steps then made no check
better than GPTQ's start.)

With clipping learned, the stored scale is ``round_scale(α · s₀)`` for symmetric schemes
(``α ∈ [clip_min, 1]`` per block); asymmetric ones scale the block's range ends
``hi = α · hi₀``, ``lo = β · lo₀`` and derive scale and zero point as min-max does.  Scale
rounding to its storage dtype (bf16, FP8, E8M0) and the zero point's rounding are passed
through by the straight-through estimator too, so what is trained is what is stored.

The result is an ordinary :class:`~lowbit.numerics.qtensor.QTensor`; export needs nothing new.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...numerics.granularity import blocked, from_matrix_view, matrix_shape, matrix_view, unblocked
from ...numerics.qtensor import QTensor, dequantize, quantize
from ...numerics.scheme import Scheme, _global_divisor
from ...util.parallel import torch_threads

__all__ = ["LearnedRounding", "optimize_rounding", "RoundingResult", "straight_through"]

log = logging.getLogger(__name__)

_KINDS = ("tensor", "channel", "group", "block")


class _PassThrough(torch.autograd.Function):
    """Forward: the given rounded values, exactly; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, x, rounded):
        return rounded.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward (bit for bit), identity backward: the straight-through estimator."""
    return _PassThrough.apply(x, rounded)


class _IntFakeQuant(torch.autograd.Function):
    """``(q − z) · s`` with ``q = clamp(round(W / s + v + z), min, max)`` (``z`` None for symmetric
    schemes): an integer weight's learned rounding in one function, five passes over the weight
    forward and four backward (the generic path's composition of ops makes about twice as many).
    The values are the generic path's bit for bit; the gradients are the same straight-through
    ones: ``g · s`` for ``v`` (the same product); for ``s`` the block sums of ``g · (q − z − W/s)``
    (what the generic path's two terms, ``g · (q − z)`` from the product and ``−g · s · W/s²`` from
    the division, add up to, summed in another order); for ``z`` zero (there ``−g · s`` from the
    subtraction and ``+g · s`` through the rounding cancel exactly).  A zero scale (an all-zero
    block) gives zeros, as there."""

    @staticmethod
    def forward(ctx, wb, s, z, v, lo: float, hi: float):
        safe = torch.where(s != 0, s, torch.full_like(s, float("inf")))
        y = wb / safe
        u = y + v if z is None else y + v + z
        q = torch.round(u).clamp_(lo, hi)                  # torch.round: half to even, as Format.round
        if z is not None:
            q = q - z
        ctx.save_for_backward(s, q, y)
        return q * s

    @staticmethod
    def backward(ctx, g):
        s, q, y = ctx.saved_tensors                        # q with the zero point taken off
        grad_s = grad_v = None
        if ctx.needs_input_grad[3]:
            grad_v = g * s
        if ctx.needs_input_grad[1]:
            grad_s = (g * (q - y)).sum(dim=(1, 3), keepdim=True)
        return None, grad_s, None, grad_v, None, None


def _grid_step(y: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """The element format's grid spacing at ``|y|`` (detached): 1 for integers; for a
    minifloat with ``m`` mantissa bits ``2^(max(⌊log2|y|⌋, 1 − bias) − m)``, clamped to the
    largest binade (values beyond ``max`` saturate)."""
    fmt = scheme.format
    if fmt.kind == "int":
        return torch.ones((), dtype=y.dtype, device=y.device)
    a = y.detach().abs().clamp(min=fmt.min_normal, max=fmt.max)
    _, e = torch.frexp(a)                                   # a = m · 2^e, m ∈ [0.5, 1): ⌊log2 a⌋ = e − 1
    return torch.exp2((e - 1 - fmt.mantissa_bits).to(y.dtype))


class LearnedRounding:
    """The trainable rounding of one weight, started from its initial quantization.

    ``offset`` (``V``, shape of the blocked weight) and ``alpha`` / ``beta`` (clip factors,
    one per block; ``beta`` only for asymmetric schemes) are leaf tensors with
    ``requires_grad``; :meth:`weight` is differentiable in them; :meth:`qtensor` gives
    the codes and scales they stand for.
    """

    #: integer schemes take :class:`_IntFakeQuant` (off: the generic path, for
    #: ``benchmarks/roundopt_step.py``'s side-by-side timing)
    use_fused = True

    def __init__(self, w: torch.Tensor, init: QTensor, *, learn_clip: bool = True, clip_min: float = 0.5) -> None:
        scheme = init.scheme
        gran = scheme.granularity
        if scheme.ggml:
            raise NotImplementedError(f"learned rounding: GGUF type {scheme.ggml} (two-level integer scales) "
                                      "is not supported; use GPTQ or the MSE observer for GGUF")
        if gran.kind not in _KINDS:
            raise ValueError(f"learned rounding: granularity {gran} is not a weight granularity")
        if scheme.format.kind != "int" and scheme.format.kind != "float":
            raise NotImplementedError(f"learned rounding: element format {scheme.format.name}")
        if tuple(init.shape) != tuple(w.shape):
            raise ValueError(f"learned rounding: init shape {init.shape} differs from the weight's {tuple(w.shape)}")
        if not 0 < clip_min <= 1:
            raise ValueError(f"clip_min must be in (0, 1], got {clip_min}")
        self.scheme, self.init, self.shape = scheme, init, tuple(w.shape)
        self.rows, self.cols = matrix_shape(self.shape, gran)
        self.learn_clip, self.clip_min = learn_clip, clip_min
        self.wb = blocked(matrix_view(w.detach(), gran).to(torch.float32), gran)        # (R, br, C, bc)
        self.s0 = init.scale.to(torch.float32)[:, None, :, None]                        # stored scale
        self.div = None if init.global_scale is None else _global_divisor(init.global_scale)
        fmt = scheme.format
        if scheme.symmetric:
            self.lo0 = self.hi0 = None
        else:
            z0 = init.zero.to(torch.float32)[:, None, :, None]
            self.lo0, self.hi0 = (fmt.min - z0) * self.s0, (fmt.max - z0) * self.s0
        y0 = self._y(self.s0)
        self.rtn = rtn = torch.equal(quantize(w.detach().to(torch.float32), scheme, init.qparams).values(),
                                     init.values())
        if rtn:                                              # AdaRound's space: floor or ceil of y
            self.v0, self.radius = torch.zeros((), device=w.device), 0.5
        else:                                                # start on the given codes, ±1 step
            vals = blocked(matrix_view(init.values(), gran), gran)
            z = 0.0 if init.zero is None else init.zero.to(torch.float32)[:, None, :, None]
            self.v0, self.radius = (vals - z - y0) / _grid_step(y0, scheme), 1.0
        dev = self.wb.device
        self.offset = torch.zeros_like(self.wb, requires_grad=True)
        nb = self.s0.shape
        self.alpha = torch.ones(nb, device=dev, requires_grad=learn_clip)
        self.beta = None if scheme.symmetric else torch.ones(nb, device=dev, requires_grad=learn_clip)
        # integers without a global scale take the fused path (same values, half the passes)
        self.fused = self.use_fused and fmt.kind == "int" and self.div is None

    # -- the forward ----------------------------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        ps = [self.offset]
        if self.learn_clip:
            ps += [self.alpha] + ([self.beta] if self.beta is not None else [])
        return ps

    def _effective(self, s_stored: torch.Tensor) -> torch.Tensor:
        return s_stored if self.div is None else s_stored / self.div

    def _y(self, s_stored: torch.Tensor) -> torch.Tensor:
        s = self._effective(s_stored)
        safe = torch.where(s != 0, s, torch.full_like(s, float("inf")))              # zero scale: all zeros
        return self.wb / safe

    def _scale_zero(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored scale and zero point from the clip factors (differentiable, STE roundings)."""
        scheme, fmt = self.scheme, self.scheme.format
        if not self.learn_clip:
            return self.s0, (None if self.init.zero is None else self.init.zero.to(torch.float32)[:, None, :, None])
        if scheme.symmetric:
            raw = self.alpha * self.s0
            return straight_through(raw, scheme.round_scale(raw.detach())), None
        hi, lo = self.alpha * self.hi0, self.beta * self.lo0
        raw = (hi - lo) / (fmt.max - fmt.min)
        s = straight_through(raw, scheme.round_scale(raw.detach()))
        safe = torch.where(s > 0, s, torch.ones_like(s))
        zraw = fmt.min - lo / safe
        z = straight_through(zraw, torch.round(zraw.detach()).clamp(fmt.min, fmt.max))
        return s, torch.where(s > 0, z, torch.zeros_like(z))

    def _values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(element values with zero point, stored scale, zero)`` in blocked layout."""
        s, z = self._scale_zero()
        y = self._y(s)
        u = y + (self.v0 + self.offset) * _grid_step(y, self.scheme)
        if z is not None:
            u = u + z
        return straight_through(u, self.scheme.format.round(u.detach())), s, z

    def weight(self) -> torch.Tensor:
        """The quantized weight ``(code − zero) · scale`` in the weight's shape, differentiable."""
        if self.fused:
            s, z = self._scale_zero()
            v = self.offset if self.rtn else self.v0 + self.offset     # v0 is 0 in AdaRound's space
            fmt = self.scheme.format
            out = unblocked(_IntFakeQuant.apply(self.wb, s, z, v, float(fmt.min), float(fmt.max)),
                            self.rows, self.cols)
            return from_matrix_view(out, self.shape, self.scheme.granularity)
        q, s, z = self._values()
        if z is not None:
            q = q - z
        out = unblocked(q * self._effective(s), self.rows, self.cols)
        return from_matrix_view(out, self.shape, self.scheme.granularity)

    @torch.no_grad()
    def qtensor(self) -> QTensor:
        """The codes and scales of the current offsets and clip factors."""
        q, s, z = self._values()
        vals = from_matrix_view(unblocked(q, self.rows, self.cols), self.shape, self.scheme.granularity)
        codes = self.scheme.format.encode(vals)
        zero = None if z is None else z[:, 0, :, 0].clone()
        return QTensor(codes, s[:, 0, :, 0].clone(), zero, self.init.global_scale, self.scheme)

    @torch.no_grad()
    def sign_step(self, lr: float, clip_lr: float) -> None:
        """``p ← clamp(p − lr · sign(∂L/∂p))`` for the offsets, with ``clip_lr`` for the clip
        factors; gradients are cleared."""
        for p in self.parameters():
            if p.grad is None:
                continue
            p.sub_((lr if p is self.offset else clip_lr) * torch.sign(p.grad))
            p.grad = None
        self.offset.clamp_(-self.radius, self.radius)
        if self.learn_clip:
            self.alpha.clamp_(self.clip_min, 1.0)
            if self.beta is not None:
                self.beta.clamp_(self.clip_min, 1.0)

    @torch.no_grad()
    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(p.detach().clone() for p in (self.offset, self.alpha, self.beta) if p is not None)

    @torch.no_grad()
    def restore(self, snap: tuple[torch.Tensor, ...]) -> None:
        for p, v in zip([p for p in (self.offset, self.alpha, self.beta) if p is not None], snap):
            p.copy_(v)


@dataclass(frozen=True)
class RoundingResult:
    """What :func:`optimize_rounding` returns: the chosen QTensors (the initial objects
    themselves when nothing beat them), the mean-squared block-output error over every
    training batch at the start and for the result, the steps run, and (``keep_outputs``) the
    block's outputs on each batch with the result's weights, when the final check chose it."""

    qtensors: dict[str, QTensor]
    loss_init: float
    loss_final: float
    steps: int
    outputs: list[torch.Tensor] | None = None  # keep_outputs: the block's outputs on the batches, when kept

    @property
    def improved(self) -> bool:
        return self.loss_final < self.loss_init


def optimize_rounding(
    forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    weights: dict[str, torch.Tensor],
    inits: dict[str, QTensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float | None = None,
    clip_lr: float | None = None,
    learn_clip: bool = True,
    clip_min: float = 0.5,
    checks: int = 2,
    threads: int = 0,
    compute: torch.dtype | None = None,
    keep_outputs: bool = False,
) -> RoundingResult:
    """Tune the rounding of ``weights`` jointly so that ``forward`` (a block: a decoder layer)
    with the quantized weights reproduces the targets (SignRound, Cheng et al. §3).

    Args:
        forward: ``forward(quantized weights by name, x) -> y``; differentiable in the weights.
        weights: the anchor ``W`` of every offset, by name: the float weights, or (GPTQ)
            the weights as the method rounded them, so that rounding them to nearest at the
            inits' scales gives the inits' codes (then ``V ∈ [−½, ½]``, see the module).
        inits: their initial quantization (same names): min-max, MSE, AWQ-clipped or GPTQ.
        batches: ``(input, target)`` pairs; step ``t`` trains on ``batches[t % len]``.
        steps: sign-gradient steps (0: the inits are returned unchanged).
        lr: the offsets' starting step size, decaying linearly to 0; default ``1 / steps``.
        clip_lr: the clip factors' starting step size (decaying alike); default ``lr / 10``.
        learn_clip: also tune the per-block clip factors.
        clip_min: the smallest clip factor.
        checks: how many times (evenly spaced, the last after the final step) the loss over
            every batch is measured; the best of those and the start is returned, so the
            result never has a larger loss on ``batches`` than the inits.
        threads: torch's intra-op threads while tuning (0: as they are).  On an idle 2-core
            CPU two threads ran a SmolLM2 layer's step 1.66× faster than one
            (``benchmarks/roundopt_step.py``); on 2 cores shared with other jobs one thread
            was 3–4× faster than two (every elementwise op paid a synchronisation).
        compute: the dtype the training steps' forward and backward run in under autocast
            (``torch.bfloat16``: matmuls in bf16, the weights' rounding and the loss in fp32);
            None: the weights' own.  The loss checks, and so the choice of the result, are
            always computed in the weights' dtype: what is kept is judged as it is stored.
        keep_outputs: the final check runs on the stored weights (``dequantize`` of the
            QTensors: the same values) and keeps ``forward``'s outputs; when that check
            chose the result they are returned (``outputs``), so that a caller that needs
            the block's outputs on these batches need not compute them again.

    Returns:
        :class:`RoundingResult`.
    """
    if steps < 0 or checks < 1:
        raise ValueError(f"optimize_rounding: steps must be >= 0 and checks >= 1, got {steps}, {checks}")
    if set(weights) != set(inits):
        raise ValueError(f"optimize_rounding: weights and inits name different tensors: {sorted(weights)} vs {sorted(inits)}")
    if not batches:
        raise ValueError("optimize_rounding: no training batches")
    with torch_threads(threads):
        return _optimize(forward, weights, inits, batches, steps, lr, clip_lr, learn_clip, clip_min, checks, compute,
                         keep_outputs)


def _optimize(forward, weights, inits, batches, steps, lr, clip_lr, learn_clip, clip_min, checks,
              compute, keep_outputs) -> RoundingResult:
    names = list(weights)
    dtypes = {n: weights[n].dtype for n in names}
    device = next(iter(weights.values())).device.type

    def full_loss(ws: dict[str, torch.Tensor], keep: list | None = None) -> float:
        total = 0.0
        with torch.no_grad():
            for x, t in batches:
                y = forward(ws, x)
                total += float(torch.nn.functional.mse_loss(y.float(), t.float(), reduction="sum"))
                if keep is not None:
                    keep.append(y)
        return total / sum(t.numel() for _, t in batches)

    loss0 = full_loss({n: dequantize(inits[n], dtypes[n]) for n in names})
    if steps == 0:
        return RoundingResult(dict(inits), loss0, loss0, 0)
    lr = 1.0 / steps if lr is None else lr
    clip_lr = lr / 10 if clip_lr is None else clip_lr
    rounding = {n: LearnedRounding(weights[n], inits[n], learn_clip=learn_clip, clip_min=clip_min) for n in names}
    at = {round(steps * k / checks) for k in range(1, checks + 1)}
    best, best_loss, kept = None, loss0, None
    with torch.enable_grad():
        for t in range(steps):
            x, target = batches[t % len(batches)]
            ws = {n: r.weight().to(dtypes[n]) for n, r in rounding.items()}
            with torch.autocast(device, dtype=compute or torch.float32, enabled=compute is not None):
                y = forward(ws, x)
            loss = torch.nn.functional.mse_loss(y.float(), target.float())
            loss.backward()
            decay = 1.0 - t / steps
            for r in rounding.values():
                r.sign_step(lr * decay, clip_lr * decay)
            if t + 1 in at:
                last = keep_outputs and t + 1 == steps
                outputs = [] if last else None
                with torch.no_grad():
                    current = full_loss({n: dequantize(r.qtensor(), dtypes[n]) if last else r.weight().to(dtypes[n])
                                         for n, r in rounding.items()}, outputs)
                if current < best_loss:
                    best, best_loss = {n: r.snapshot() for n, r in rounding.items()}, current
                    kept = outputs
    if best is None:
        log.info("learned rounding: no check beat the start (%.4g); the initial quantization is kept", loss0)
        return RoundingResult(dict(inits), loss0, loss0, steps)
    for n, r in rounding.items():
        r.restore(best[n])
    out = {n: r.qtensor() for n, r in rounding.items()}
    if not math.isfinite(best_loss):
        raise FloatingPointError("learned rounding: the block-output loss is not finite")
    return RoundingResult(out, loss0, best_loss, steps, kept)
