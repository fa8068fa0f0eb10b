"""End-to-end scale tuning: the codes stay as the layer-by-layer pass chose them, and every
quantized weight's scales are trained together to bring the whole model's next-token
distribution back to the float model's.

The idea is EfficientQAT's second stage (Chen et al., "EfficientQAT: Efficient
Quantization-Aware Training for Large Language Models", 2024, §3.3, "E2E-QP": after block-wise
training, only the quantization step sizes are trained end to end, the integer codes
frozen).  Here the objective is the KL divergence from the float model's distribution to the
quantized model's on calibration windows (distillation, no labels), which is what lowbit's
evaluator measures; the layer-by-layer methods before it (GPTQ, AWQ, learned rounding) each
see one layer or block, so errors that only show through the layers after it are left to
this stage.  Written for lowbit's QTensors, not taken from the paper's code.

Each block's scale is ``s = round_scale(s₀ · exp(θ))`` with one trainable ``θ`` per block
(Adam; a relative step, so blocks with small and large scales move alike); the rounding to
the stored scale dtype (bf16, FP8, E8M0) is passed through by the straight-through
estimator, so what is trained is what is stored.  Zero points, global scales and codes are
not changed; the result is an ordinary :class:`~lowbit.numerics.qtensor.QTensor` per weight.
The KL on ``held`` windows (not trained on) is measured before training and after each
epoch; the epoch with the lowest is kept, and the start when none is lower, so the stage
never returns a model worse on those windows than the one it was given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...numerics.granularity import blocked, from_matrix_view, matrix_view, unblocked
from ...numerics.qtensor import QTensor
from ...numerics.scheme import _global_divisor
from ...util.progress import progress_bar
from .roundopt import straight_through

__all__ = ["tune_scales", "ScaleTuneResult", "kl_to_reference"]

log = logging.getLogger(__name__)

Logits = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ScaleTuneResult:
    """The tuned QTensors (the given objects where no epoch beat the start), the held-out KL
    at the start and after each epoch, and the epoch kept (0: the start)."""

    qtensors: dict[str, QTensor]
    held_kl: list[float]
    kept_epoch: int
    steps: int


def kl_to_reference(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(reference ‖ quantized), in nats (fp32)."""
    v = logits.shape[-1]
    logp = F.log_softmax(logits.float().reshape(-1, v), dim=-1)
    logq = F.log_softmax(ref_logits.float().reshape(-1, v), dim=-1)
    return F.kl_div(logp, logq, log_target=True, reduction="batchmean")


class _Scales:
    """One weight's trainable scale factors, and its fixed ``code − zero`` in blocked layout
    (decoded once: a step only multiplies them by the scales, as ``dequantize`` does)."""

    def __init__(self, qt: QTensor) -> None:
        if qt.scheme.ggml:
            raise NotImplementedError(f"scale tuning: GGUF type {qt.scheme.ggml} (two-level scales) is not supported")
        self.qt, gran = qt, qt.scheme.granularity
        v = matrix_view(qt.values(), gran)
        self.rows, self.cols = v.shape
        self.vb = blocked(v, gran) if qt.zero is None else blocked(v, gran) - qt.zero.to(torch.float32)[:, None, :, None]
        self.div = None if qt.global_scale is None else _global_divisor(qt.global_scale)
        self.s0 = qt.scale.to(torch.float32)
        self.theta = torch.zeros_like(self.s0, requires_grad=True)

    def _scale(self) -> torch.Tensor:
        raw = self.s0 * torch.exp(self.theta)
        return straight_through(raw, self.qt.scheme.round_scale(raw.detach()))

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``(code − zero) · scale / global divisor``: ``dequantize``'s values, differentiable in θ."""
        s = self._scale() if self.div is None else self._scale() / self.div
        out = unblocked(self.vb * s[:, None, :, None], self.rows, self.cols)
        return from_matrix_view(out, self.qt.shape, self.qt.scheme.granularity).to(dtype)

    @torch.no_grad()
    def qtensor(self) -> QTensor:
        return dataclasses.replace(self.qt, scale=self.qt.scheme.round_scale(self.s0 * torch.exp(self.theta)))


def tune_scales(
    forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    reference: Logits,
    qtensors: dict[str, QTensor],
    dtypes: dict[str, torch.dtype],
    train: Sequence[torch.Tensor],
    held: Sequence[torch.Tensor],
    *,
    epochs: int = 1,
    lr: float = 1e-3,
    progress: bool = True,
) -> ScaleTuneResult:
    """Train the scales of ``qtensors`` so that ``forward`` matches ``reference``.

    Args:
        forward: ``forward(weights by name, ids) -> logits``, differentiable in the weights
            (the quantized model with those weights in place of its own).
        reference: ``reference(ids) -> logits`` of the float model.
        qtensors: the weights' quantization as the layer-by-layer pass left it, by name.
        dtypes: the dtype each weight is used in (the model's parameter dtype).
        train: ``(b, seq)`` token batches trained on, one Adam step each, every epoch.
        held: token batches the KL is measured on to choose the epoch kept (not trained on).
        epochs: passes over ``train``.
        lr: Adam's step size on the log scale factors ``θ``.
        progress: show a progress bar over the steps.

    Returns:
        :class:`ScaleTuneResult`.
    """
    if epochs < 1 or not lr > 0:
        raise ValueError(f"tune_scales: epochs must be >= 1 and lr > 0, got {epochs}, {lr}")
    if not train or not held:
        raise ValueError("tune_scales: needs training and held-out windows")
    if set(dtypes) != set(qtensors):
        raise ValueError("tune_scales: dtypes and qtensors name different weights")
    scales = {n: _Scales(qt) for n, qt in qtensors.items()}

    @torch.no_grad()
    def held_kl(ws: dict[str, torch.Tensor]) -> float:
        total, tokens = 0.0, 0
        for ids in held:  # the reference's logits are computed again, not kept (a large vocabulary's are big)
            n = ids.numel()
            total += float(kl_to_reference(forward(ws, ids), reference(ids))) * n
            tokens += n
        return total / tokens

    with torch.no_grad():
        history = [held_kl({n: s.weight(dtypes[n]) for n, s in scales.items()})]
    best, best_epoch = None, 0
    opt = torch.optim.Adam([s.theta for s in scales.values()], lr=lr)
    steps = 0
    for epoch in range(1, epochs + 1):
        for ids in progress_bar(train, f"tuning scales end to end, epoch {epoch}/{epochs}", enabled=progress):
            with torch.no_grad():
                ref = reference(ids)
            with torch.enable_grad():
                loss = kl_to_reference(forward({n: s.weight(dtypes[n]) for n, s in scales.items()}, ids), ref)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"scale tuning: the KL is not finite at step {steps}")
            opt.step()
            steps += 1
        with torch.no_grad():
            kl = held_kl({n: s.weight(dtypes[n]) for n, s in scales.items()})
        history.append(kl)
        log.info("scale tuning epoch %d: held-out KL %.5f (start %.5f)", epoch, kl, history[0])
        if kl < min(history[:-1]):
            best, best_epoch = {n: s.qtensor() for n, s in scales.items()}, epoch
    if best is None:
        log.info("scale tuning: no epoch beat the start on the held-out windows; the scales are kept")
        return ScaleTuneResult(dict(qtensors), history, 0, steps)
    return ScaleTuneResult(best, history, best_epoch, steps)
