"""Learned rounding in the layer-by-layer pass: each decoder layer, once its weight method
has quantized it, has its rounding offsets and clip factors tuned against its float outputs
(:func:`lowbit.quantization.algorithms.optimize_rounding`), and its outputs — the next
layer's inputs — are computed again with the tuned weights.

Per layer, :meth:`LayerRounding.before` (the layer still in float, after AWQ balancing)
keeps the layer's float weights, its inputs and the training targets;
:meth:`LayerRounding.after` (after the layer's pass) trains, writes the weights and their
QTensors, and returns the layer's new outputs.  Only one layer's copies are alive at a time.
Where the recipe quantizes a Linear's input, the layer trains and computes its outputs with
that input quantized as the pass fixed it, the gradients passed straight through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call

from ..numerics.qtensor import dequantize
from . import algorithms as A
from .methods import RoundOptConfig
from .recipe import Recipe
from .runtime import QuantState, quantized_activations

__all__ = ["LayerRounding", "check_round_opt", "compute_dtype", "frozen_parameters"]

log = logging.getLogger(__name__)


def check_round_opt(recipe: Recipe) -> None:
    """Refuse, before any work, what learned rounding does not do yet: a quantized KV cache
    (the trained layer would have to run its quantizer at the cache write).  Quantized
    inputs are trained through (:meth:`LayerRounding.after`)."""
    if recipe.algorithms.round_opt is None:
        return
    if recipe.kv_cache is not None:
        raise NotImplementedError("round_opt with a quantized KV cache is not implemented; remove kv_cache from "
                                  "the recipe")


def compute_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of learned rounding's training steps for ``compute`` (see
    :class:`~lowbit.quantization.methods.RoundOptConfig`); None: the weights' own (fp32)."""
    if setting == "fp32":
        return None
    if setting == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    elif device.type == "cpu":
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    else:
        native = False
    return torch.bfloat16 if native else None


@contextmanager
def frozen_parameters(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters without ``requires_grad`` (a training step differentiates only in
    the weights it is handed), each set back as it was on exit."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _out(o):
    return o[0] if isinstance(o, tuple) else o


def _batches(inputs: list[torch.Tensor], n: int, batch: int) -> list[torch.Tensor]:
    """The first ``n`` windows of batched layer inputs regrouped in batches of ``batch``
    windows (what ``torch.cat`` then ``split`` gives): views of ``inputs`` where a batch
    lies inside one of them, a copy only where it spans two."""
    out: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    have = 0
    for x in inputs:
        start = 0
        while start < x.shape[0] and n > 0:
            take = min(batch - have, x.shape[0] - start, n)
            parts.append(x[start:start + take])
            have, start, n = have + take, start + take, n - take
            if have == batch:
                out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
                parts, have = [], 0
        if n <= 0:
            break
    if parts:
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return out


class LayerRounding:
    """Learned rounding over a run: the training windows (and, for ``target: float``, their
    float stream through the layers) and one layer's work at a time."""

    #: take the layer's outputs on the training windows from the final loss check where it
    #: chose the result (bit for bit what computing them again gives; a switch for the test)
    reuse_outputs = True

    def __init__(self, cfg: RoundOptConfig, inputs: list[torch.Tensor]) -> None:
        self.cfg = cfg
        self.float_in = [x.clone() for x in _batches(inputs, cfg.windows, cfg.batch)] if cfg.target == "float" else None
        self.seconds = 0.0
        self.losses: list[tuple[float, float]] = []  # per layer: training loss at the start and kept
        self._saved: dict | None = None

    @torch.no_grad()
    def before(self, layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict, names: list[str], prefix: str,
               modules: dict[str, nn.Module]) -> None:
        """Layer still in float: keep its weights (``names``: its quantized Linears), its
        inputs, and the targets of the training windows."""
        cfg = self.cfg
        train_in = _batches(inputs, cfg.windows, cfg.batch)
        source = self.float_in if cfg.target == "float" else train_in
        targets = [_out(layer(x, **kwargs)) for x in source]
        if self.float_in is not None:
            self.float_in = targets                # the float model's inputs of the next layer
        self._saved = {
            "weights": {n: modules[n].weight.detach().clone() for n in names},
            "inputs": list(inputs),  # the tensors themselves: the pass replaces, never changes, them
            "batches": list(zip(train_in, targets)),
            "prefix": prefix,
        }

    @torch.no_grad()
    def after(self, i: int, layer: nn.Module, kwargs: dict, modules: dict[str, nn.Module], state: QuantState,
              keep_qtensors: bool, anchors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Train layer ``i``'s rounding from the QTensors its pass left in ``state``, with
        offsets on the float weights or, where its method left one in ``anchors`` (GPTQ:
        the weights as it rounded them; taken out of the dict), on that; write the tuned
        weights (and QTensors, when kept); return its outputs on the kept inputs.  The
        layer's inputs are quantized as its pass fixed them, in training and in the outputs."""
        prefix = self._saved["prefix"]
        acts = {n[len(prefix) + 1:]: aq for n, aq in state.activations.items()
                if n.startswith(prefix + ".") and aq.scheme is not None}
        with quantized_activations(layer, acts, straight_through=True):
            return self._after(i, layer, kwargs, modules, state, keep_qtensors, anchors)

    def _after(self, i: int, layer: nn.Module, kwargs: dict, modules: dict[str, nn.Module], state: QuantState,
               keep_qtensors: bool, anchors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        saved, self._saved = self._saved, None
        cfg, prefix = self.cfg, saved["prefix"]
        weights = {n: anchors.pop(n, w) for n, w in saved["weights"].items()}
        missing = [n for n in weights if n not in state.weights]
        if missing:
            raise RuntimeError(f"layer {i}: no QTensor to start learned rounding from for {missing}")
        local = {n: n[len(prefix) + 1:] + ".weight" for n in weights}

        def forward(ws: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return _out(functional_call(layer, {local[n]: w for n, w in ws.items()}, (x,), kwargs))

        # the final check's outputs can stand for the layer's outputs where a training batch is a whole
        # input chunk and the check's weights have the layer's dtype; only then are they kept
        chunks = {(x.data_ptr(), tuple(x.shape)) for x in saved["inputs"]}
        keep = (self.reuse_outputs and all(weights[n].dtype == modules[n].weight.dtype for n in weights)
                and any((x.data_ptr(), tuple(x.shape)) in chunks for x, _ in saved["batches"]))
        with frozen_parameters(layer):
            result = A.optimize_rounding(forward, weights, {n: state.weights[n] for n in weights}, saved["batches"],
                                         steps=cfg.steps, lr=cfg.lr, clip_lr=cfg.clip_lr, learn_clip=cfg.learn_clip,
                                         clip_min=cfg.clip_min, checks=cfg.checks, threads=cfg.threads,
                                         compute=compute_dtype(cfg.compute, next(iter(weights.values())).device),
                                         keep_outputs=keep)
        for n, qt in result.qtensors.items():
            modules[n].weight.copy_(dequantize(qt, modules[n].weight.dtype))
            if keep_qtensors:
                state.weights[n] = qt
            else:
                del state.weights[n]
        self.losses.append((result.loss_init, result.loss_final))
        log.info("layer %d learned rounding: block-output MSE %.4g → %.4g (%d steps)", i, result.loss_init,
                 result.loss_final, result.steps)
        # the final check's outputs, where it chose the result, on whole input chunks: what the layer
        # computes on that chunk with the weights just written (the same values)
        done = {} if result.outputs is None else {
            k: y for (x, _), y in zip(saved.pop("batches"), result.outputs)
            if (k := (x.data_ptr(), tuple(x.shape))) in chunks}
        ins, outputs = saved.pop("inputs"), []
        while ins:  # each input chunk is released as its output is made
            x = ins.pop(0)
            y = done.pop((x.data_ptr(), tuple(x.shape)), None)
            outputs.append(_out(layer(x, **kwargs)) if y is None else y)
        self.seconds += time.perf_counter() - t0
        return outputs
