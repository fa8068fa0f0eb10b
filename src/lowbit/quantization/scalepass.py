"""End-to-end scale tuning after the layer-by-layer pass (``algorithms: {tune_scales: ...}``):
the glue between :func:`lowbit.quantization.algorithms.tune_scales` and a model.

:func:`reference_copy` keeps the float model (taken before the pass changes anything);
:func:`tune_model_scales`, once every layer is done, trains the scales of every quantized
weight against it on the calibration windows (the last ``holdout`` of them choose the epoch
kept), writes the tuned weights into the model and their QTensors into the state.  Inputs
quantized by the recipe are quantized in training as at run time, the gradients passed
straight through.
"""

from __future__ import annotations

import copy
import logging
import time

import torch
from torch import nn
from torch.func import functional_call

from ..numerics.qtensor import dequantize
from . import algorithms as A
from .recipe import Recipe
from .roundpass import frozen_parameters
from .runtime import QuantState, quantized_activations

__all__ = ["reference_copy", "tune_model_scales"]

log = logging.getLogger(__name__)


def reference_copy(model: nn.Module, recipe: Recipe, windows: int, lazy: bool, streaming: bool) -> nn.Module | None:
    """A float copy of ``model`` when the recipe tunes scales end to end (else None);
    refuses, before any work, what the stage cannot do (``windows``: calibration windows)."""
    cfg = recipe.algorithms.tune_scales
    if cfg is None:
        return None
    if windows <= cfg.holdout:
        raise ValueError(f"tune_scales: {windows} calibration windows, but holdout is {cfg.holdout}: give more windows "
                         "(--calib-windows) or a smaller holdout")
    what = ("a lazily loaded model (--low-memory): it trains the whole model at once" if lazy else
            "a layer-by-layer export (on_layer): the layers change after they are done" if streaming else
            "a quantized KV cache: remove kv_cache from the recipe" if recipe.kv_cache is not None else None)
    if what:
        raise NotImplementedError(f"tune_scales (end-to-end scale tuning) with {what}")
    return copy.deepcopy(model).eval()


def tune_model_scales(model: nn.Module, reference: nn.Module, recipe: Recipe, state: QuantState,
                      calibration: torch.Tensor, keep_qtensors: bool, progress: bool) -> None:
    """Tune the scales of every QTensor in ``state`` (see the module); the model's weights
    are replaced by the tuned ones; ``state`` keeps the QTensors only if ``keep_qtensors``."""
    cfg = recipe.algorithms.tune_scales
    n = calibration.shape[0]
    t0 = time.perf_counter()
    modules = dict(model.named_modules())
    names = list(state.weights)
    dtypes = {m: modules[m].weight.dtype for m in names}
    acts = {m: aq for m, aq in state.activations.items() if aq.scheme is not None or aq.rotation is not None}
    device = next(model.parameters()).device
    train = [w[None].to(device) for w in calibration[: n - cfg.holdout]]
    held = list(calibration[n - cfg.holdout:].to(device).split(recipe.algorithms.batch))

    def forward(ws: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        with quantized_activations(model, acts, straight_through=True):
            return functional_call(model, {f"{m}.weight": w for m, w in ws.items()}, (ids,), {"use_cache": False}).logits

    def ref(ids: torch.Tensor) -> torch.Tensor:
        return reference(ids, use_cache=False).logits

    with frozen_parameters(model):
        result = A.tune_scales(forward, ref, {m: state.weights[m] for m in names}, dtypes, train, held,
                               epochs=cfg.epochs, lr=cfg.lr, progress=progress)
    with torch.no_grad():
        for m, qt in result.qtensors.items():
            modules[m].weight.copy_(dequantize(qt, dtypes[m]))
            if keep_qtensors:
                state.weights[m] = qt
            else:
                del state.weights[m]
    state.scale_tuning = {"held_kl": result.held_kl, "kept_epoch": result.kept_epoch, "steps": result.steps,
                          "seconds": time.perf_counter() - t0}
    log.info("end-to-end scale tuning: held-out KL %s, epoch %d kept, %.1f s",
             " → ".join(f"{k:.5f}" for k in result.held_kl), result.kept_epoch, state.scale_tuning["seconds"])
