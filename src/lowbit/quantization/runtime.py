"""Running a quantized model: activation quantization at each Linear's input, KV
quantization at the cache write.

``with quantized_execution(model, state) as forward:`` installs forward pre-hooks on the
Linears whose inputs are quantized and yields ``forward(input_ids) -> logits``; the hooks
are removed when the block ends, also after an exception.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .algorithms.roundopt import straight_through as _straight_through
from .kv import KVPlan, kv_forward
from ..numerics.qtensor import QParams, QTensor, compute_qparams, fake_quantize
from .recipe import Recipe
from ..numerics.scheme import Scheme

__all__ = ["ActQuant", "QuantState", "quantized_activations", "quantized_execution", "Forward"]

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ActQuant:
    """What happens to one Linear's input: an optional online rotation ``x ↦ x·R``
    (QuaRot's Hadamard before down_proj), then quantization with ``scheme`` — dynamic
    scales computed per call, or static ``qparams`` from calibration; a two-level scheme
    keeps a calibrated global scale.  Channels in ``keep`` (LLM.int8()-style outliers)
    pass through unquantized."""

    scheme: Scheme | None
    qparams: QParams | None = None
    global_scale: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # an expert no token was routed to
            return x
        if self.rotation is not None:
            x = x @ self.rotation.to(x.device, x.dtype)
        if self.scheme is None:
            return x
        if self.qparams is not None:
            y = fake_quantize(x, self.scheme, _on(self.qparams, x.device))
        elif self.global_scale is not None:
            y = fake_quantize(x, self.scheme, compute_qparams(x, self.scheme, self.global_scale.to(x.device)))
        else:
            y = fake_quantize(x, self.scheme)
        if self.keep is not None and self.keep.numel():
            y[..., self.keep] = x[..., self.keep]
        return y


def _on(qp: QParams, device: torch.device) -> QParams:
    """``qp`` on ``device`` (itself when it is there: static scales computed on the CPU
    follow a model run on a GPU)."""
    if qp.scale.device == device:
        return qp
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return QParams(move(qp.scale), move(qp.zero), move(qp.global_scale))


@dataclass
class QuantState:
    """What ``pipeline.quantize`` did to a model: the QTensor of each quantized weight
    (when kept), how each Linear's input is quantized, and the KV plan."""

    recipe: Recipe
    weights: dict[str, QTensor] = field(default_factory=dict)
    weight_schemes: dict[str, Scheme] = field(default_factory=dict)
    activations: dict[str, ActQuant] = field(default_factory=dict)
    kv: KVPlan | None = None
    calibration: object | None = None  # the CalibStats static scales came from (layer-by-layer runs)
    scale_tuning: dict | None = None  # end-to-end scale tuning's held-out KL per epoch, epoch kept, steps, seconds


@contextmanager
def quantized_activations(model: nn.Module, plan: dict[str, ActQuant], straight_through: bool = False) -> Iterator[None]:
    """Quantize the input of each named Linear while the block runs.

    Linears that read the same tensor with the same quantization (q/k/v, gate/up, as a
    runtime fuses them) quantize it once: the quantized tensor of the last call is reused
    when the next hook receives that very tensor object with an equal :class:`ActQuant`.
    ``straight_through``: an input that carries gradients (a training step) passes them
    straight through the quantization (the rotation is differentiated as it is); the
    values are the same.
    """
    modules = dict(model.named_modules())
    missing = [n for n in plan if n not in modules]
    if missing:
        raise ValueError(f"activation plan names modules the model does not have: {missing[:5]}")
    canonical: dict[tuple, ActQuant] = {}
    last = _LastInput()
    handles = []
    try:
        for name, aq in plan.items():
            shared = canonical.setdefault(_signature(aq), aq)
            handles.append(modules[name].register_forward_pre_hook(_pre_hook(shared, last, straight_through)))
        yield
    finally:
        last.clear()
        for h in handles:
            h.remove()


class _LastInput:
    """The most recent (input, ActQuant, output) of a block's hooks."""

    __slots__ = ("x", "aq", "y")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.x = self.aq = self.y = None


def _signature(aq: ActQuant) -> tuple:
    """Equal signatures ⇔ equal quantization (schemes and every tensor, by value)."""

    def t(x):
        return None if x is None else (tuple(x.shape), str(x.dtype), x.detach().cpu().contiguous().numpy().tobytes())

    qp = aq.qparams
    qps = None if qp is None else (t(qp.scale), t(qp.zero), t(qp.global_scale))
    return (aq.scheme, qps, t(aq.global_scale), t(aq.rotation), t(aq.keep))


def _pre_hook(aq: ActQuant, last: _LastInput, straight_through: bool = False):
    quant = dataclasses.replace(aq, rotation=None) if straight_through else None  # the quantizer after the rotation

    def hook(module, args):
        x = args[0]
        if last.x is x and last.aq is aq:
            y = last.y
        else:
            if straight_through and x.requires_grad and aq.scheme is not None:
                r = x if aq.rotation is None else x @ aq.rotation.to(x.device, x.dtype)
                y = _straight_through(r, quant(r.detach()))
            else:
                y = aq(x)
            last.x, last.aq, last.y = x, aq, y
        return (y,) + tuple(args[1:])

    return hook


def input_device(model: nn.Module) -> torch.device | None:
    """Where ``model`` reads its token ids: its input embeddings' device, or ``None`` when
    accelerate dispatched it over several devices (``hf_device_map``: its hooks move the
    inputs) or it has no embeddings."""
    if getattr(model, "hf_device_map", None):
        return None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    w = getattr(emb, "weight", None)
    return None if w is None or w.is_meta else w.device


def plain_forward(model: nn.Module, kv: KVPlan | None = None) -> Forward:
    """``forward(input_ids) -> logits`` for a batch of token windows; the ids (on the CPU)
    are moved to the model's input device (:func:`input_device`)."""
    dev = input_device(model)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if dev is not None:
            ids = ids.to(dev)
        if kv is None:
            return model(input_ids=ids, use_cache=False).logits
        return kv_forward(model, ids, kv, model.config)

    return forward


@contextmanager
def quantized_execution(model: nn.Module, state: QuantState | None) -> Iterator[Forward]:
    """Yield a forward function that runs ``model`` with the activation and KV
    quantization of ``state`` (weights are already quantized in place)."""
    if state is None:
        yield plain_forward(model)
        return
    with quantized_activations(model, state.activations):
        yield plain_forward(model, state.kv)
