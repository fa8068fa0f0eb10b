"""The layer-by-layer loop behind GPTQ, AWQ, SmoothQuant, rotations and outlier channels.

1. Rotations, if asked (function-preserving): the part outside the decoder layers first,
   each layer's own part when the loop reaches that layer.
2. The inputs of the first decoder layer are captured for every calibration window.
3. For each decoder layer in turn:
   a. SmoothQuant / AWQ only: run the layer as it is on its inputs, recording each
      Linear input's absmax (and AWQ's token sample), and balance scales into the layer
      (function-preserving; :mod:`.balancing`, which also says what it does per MoE expert);
   b. one pass of the layer over all its inputs, in lockstep (:mod:`lowbit.util.lockstep`):
      at the first Linear of each group that reads one input, every chunk adds that
      input to the group's statistics — channel absmax, mean x², the Hessian ``XᵀX``
      (GPTQ), a token sample (AWQ clipping) — then the group's weights are quantized
      (GPTQ, AWQ clipping, MSE observer or min-max) and its input quantization fixed,
      and every chunk goes on through the quantized group.  Each Linear thus sees the
      inputs the quantized Linears before it produce (GPTQ's "true sequential"), K/V
      absmax are recorded at the cache write, and the pass's outputs — the quantized
      layer's, activation quantization included — are the next layer's inputs.
      ``algorithms.recompute`` runs the chunks one at a time instead, each from the layer's
      input up to the next group not yet quantized (:func:`lowbit.util.lockstep.run_by_replay`):
      the same result with one chunk's activations alive, for more compute.
Only one layer's inputs, activations and statistics are alive at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from . import algorithms as A
from ..util import heap
from .balancing import Stop, balance_layer, expert_sample_every, moe_expert_count
from .calibrate import CalibStats
from .kv import cache_kwarg
from .layerpass import LayerPass, PassContext
from ..models.arch import arch_of, decoder_layers, expert_groups
from ..models.experts import all_tokens_to_every_expert, expert_modules
from ..models.offload import LayerStore, is_lazy
from .targets import kv_plan_from, sibling_groups
from ..util.device import move
from ..util.progress import staged_progress
from .methods import RotationConfig
from .recipe import Recipe
from .roundpass import LayerRounding, check_round_opt
from .runtime import ActQuant, QuantState
from .scalepass import reference_copy, tune_model_scales
from .transforms import residual_rotation_supported, rotate_down_input, rotate_residual_ends, rotate_residual_layer

__all__ = ["quantize_layerwise"]

log = logging.getLogger(__name__)


@torch.no_grad()
def capture_inputs(model: nn.Module, windows: torch.Tensor, batch: int) -> tuple[list[torch.Tensor], list[dict]]:
    """The first decoder layer's input for each batch of windows, and the keyword
    arguments every decoder layer is called with (recorded once, on one window; they
    depend on positions only and broadcast over the batch).

    No decoder layer runs: for the arguments each layer's forward is replaced, for one
    call, by a stub that records them (so the layers may still be on the meta device)."""
    layers = decoder_layers(model)
    kwargs: list[dict] = [{} for _ in layers]

    def stub(i):
        def forward(hidden_states, *args, **kw):
            kwargs[i] = {k: v for k, v in kw.items() if k != "hidden_states"}
            if i == len(layers) - 1:
                raise Stop  # nothing after the last layer is needed
            return hidden_states
        return forward

    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    try:
        model(input_ids=windows[:1], use_cache=False)
    except Stop:
        pass
    finally:
        for layer in layers:
            del layer.forward
    inputs: list[torch.Tensor] = []

    def grab(mod, args, kw):
        inputs.append((args[0] if args else kw["hidden_states"]).detach())
        raise Stop

    h = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for b in range(0, len(windows), batch):
            try:
                model(input_ids=windows[b : b + batch], use_cache=False)
            except Stop:
                pass
    finally:
        h.remove()
    return inputs, kwargs


def _groups_of_inputs(names: list[str], arch, prefix: str, experts: list[tuple[str, ...]] = ()) -> dict[str, str]:
    """Linear name → the name of the first Linear that reads the same input (``experts``:
    each MoE expert's gate and up, :func:`lowbit.models.arch.expert_groups`)."""
    leader = {n: n for n in names}
    groups = [[f"{prefix}.{n}" for n in b.next] for b in arch.balances] + [list(g) for g in experts]
    for members in groups:
        for m in members:
            if m in leader:
                leader[m] = members[0]
    return leader


def _refuse_on_moe(model: nn.Module, algo) -> None:
    """What the layer-by-layer pass does not do on mixture-of-experts models, and why.

    Rotations: the residual rotation folds the MLP's norm into every reader of the
    residual stream and rotates their inputs, the router included, so the router's
    weights would change (it is kept exact: a small error flips the top-k choice); the
    online rotation of down_proj inputs is not implemented per expert (each expert's
    intermediate width, its own online rotation).  Learned rounding (``round_opt``) is not
    implemented for experts.  SmoothQuant and AWQ work per expert
    (:mod:`lowbit.quantization.balancing`)."""
    if not expert_modules(model):
        return
    if algo.rotation is not None:
        raise ValueError(
            "rotations: not supported on mixture-of-experts models — the residual rotation would fold the MLP "
            "norm into the router and rotate its input, changing the router's weights (kept exact), and the "
            "online down_proj rotation is not implemented per expert; AWQ, SmoothQuant, GPTQ, the MSE observer "
            "and min-max rounding quantize every expert")
    if algo.round_opt is not None:
        raise ValueError(
            "learned rounding (round_opt): not implemented for mixture-of-experts models; AWQ, SmoothQuant, GPTQ, "
            "the MSE observer and min-max rounding quantize every expert")


def _rotations(model: nn.Module, cfg: RotationConfig | None) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """Apply the model-level part of the configured rotations now; return the online
    rotations (module name → matrix) and the per-layer part, ``rotate(i)``, which the
    pipeline applies to each decoder layer when it reaches it (each layer's rotation is
    independent of the others', so this equals rotating the whole model first)."""
    if cfg is None:
        return {}, lambda i: None
    seed = cfg.seed
    cfgd = model.config
    arch = arch_of(model)
    Q = H = None
    if cfg.residual:
        why = residual_rotation_supported(model)
        if why:
            log.warning("residual rotation skipped: %s", why)
        else:
            Q = A.random_hadamard(cfgd.hidden_size, seed)
            rotate_residual_ends(model, Q)
    online = {}
    if cfg.down:
        H = A.random_hadamard(cfgd.intermediate_size, seed + 1)
        online = {f"{arch.layers}.{i}.{arch.down}": H for i in range(len(decoder_layers(model)))}

    def rotate(i: int) -> None:
        if Q is not None:
            rotate_residual_layer(model, i, Q)
        if H is not None:
            rotate_down_input(model, i, H)

    return online, rotate


@torch.no_grad()
def quantize_layerwise(
    model: nn.Module,
    recipe: Recipe,
    calibration: torch.Tensor,
    *,
    keep_qtensors: bool = False,
    progress: bool = True,
    store: LayerStore | None = None,
    on_layer: Callable[[int, QuantState], None] | None = None,
    device: torch.device | str | None = None,
):
    """Quantize ``model`` in place with the calibration methods of ``recipe``.

    Args:
        model: a transformers causal LM of a known architecture.
        recipe: schemes and ``recipe.algorithms``.
        calibration: ``(n, seq)`` token windows.
        keep_qtensors: keep the QTensor of each quantized weight (GPTQ, min-max, MSE or
            AWQ-clipped weights; outlier-channel weights have none).
        progress: show a progress bar over layers.
        store: for a model loaded with :func:`lowbit.models.offload.load_lazy`: each decoder
            layer is loaded from it when the pipeline reaches the layer and released
            (written back to disk, freed) when the layer is done, so that one decoder
            layer is in memory at a time.  The model is left with its layers released:
            ``store.materialize()`` brings them back.
        on_layer: ``on_layer(i, state)`` when decoder layer ``i`` is done, before it is
            released (see :func:`lowbit.quantization.pipeline.quantize`).
        device: where each decoder layer runs (e.g. a GPU while the model stays in CPU
            memory or in ``store``): the calibration activations move there once, each
            layer is moved there when the loop reaches it and back to where it was when
            done, so that one decoder layer is on the device at a time; its statistics
            (Hessians, AWQ samples) are formed there.  What the layer leaves in the state
            (QTensors, input scales, K/V absmax) is moved back with it.  ``None``: the
            layers run where they are.

    Returns:
        A :class:`~lowbit.quantization.runtime.QuantState`.
    """
    algo = recipe.algorithms
    arch = arch_of(model)
    if store is None and is_lazy(model):
        raise ValueError("the model has parameters on the meta device (loaded lazily): pass its LayerStore")
    _refuse_on_moe(model, algo)
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    plan = recipe.resolve(names)
    check_round_opt(recipe)
    # tune_scales' float model (None without it); what the stage cannot do is refused here, before any work
    reference = reference_copy(model, recipe, calibration.shape[0], store is not None, on_layer is not None)
    keep = keep_qtensors or reference is not None  # tune_scales trains the QTensors' scales
    experts = expert_groups(model)
    online, rotate = _rotations(model, algo.rotation)
    modules = dict(model.named_modules())
    inputs, layer_kwargs = capture_inputs(model, calibration, algo.batch)
    if device is not None:
        device = torch.device(device)
        inputs = [x.to(device) for x in inputs]
        layer_kwargs = [move(kw, device) for kw in layer_kwargs]
    if store is not None:
        store.release_outside()  # the embeddings and lm_head are not needed until the end
    layers = decoder_layers(model)
    state = QuantState(recipe)
    stats = CalibStats()
    awq_cfg = algo.awq
    need_h = algo.gptq is not None
    sample_every = 0
    if awq_cfg is not None:
        tokens = awq_cfg.tokens
        total = sum(x.shape[0] * x.shape[1] for x in inputs)
        sample_every = max(1, total // tokens)
    siblings = sibling_groups(model)
    times = {"balancing": 0.0, "pass": 0.0, "weights": 0.0, "rounding": 0.0}
    expert_of = _expert_index(model)
    expert_every = expert_sample_every(model, sample_every, moe_expert_count(expert_of), algo.experts_see_all_tokens)
    ctx = PassContext(model, modules, plan, algo, state, stats, online, siblings, need_h, sample_every,
                      kv_cache_kwarg=cache_kwarg(model) if recipe.kv_cache is not None else None,
                      keep_qtensors=keep or algo.round_opt is not None,  # round_opt starts from them
                      expert_of=expert_of, expert_sample_every=expert_every)
    rounding = LayerRounding(algo.round_opt, inputs) if algo.round_opt is not None else None
    method = ctx.method.label
    with heap.map_large_allocations():  # see lowbit.util.heap
        for i, stage in staged_progress(range(len(layers)), f"quantizing {recipe.name} layer by layer",
                                        enabled=progress):
            layer_pass = LayerPass(ctx, lambda g, stage=stage: stage(f"{method} {g.rsplit('.', 2)[-2]}.{g.rsplit('.', 1)[-1]}"))
            prefix = f"{arch.layers}.{i}"
            lnames = [n for n in names if n.startswith(prefix + ".")]
            leader = _groups_of_inputs(lnames, arch, prefix, [g for g in experts if g[0].startswith(prefix + ".")])
            if store is not None:
                store.load(i)
            rotate(i)
            home = onload(layers[i], device)
            if algo.smoothquant is not None or awq_cfg is not None:
                stage("SmoothQuant scales" if algo.smoothquant is not None else "AWQ scales")
                t_b = time.perf_counter()
                with all_tokens_to_every_expert(layers[i]) if algo.experts_see_all_tokens else _nothing():
                    balance_layer(model, i, arch, layers[i], inputs, layer_kwargs[i], modules, plan, leader, online,
                                  algo, sample_every, prefix, expert_of, expert_every)
                times["balancing"] += time.perf_counter() - t_b
            if rounding is not None:
                stage("float targets")
                t_r = time.perf_counter()
                rounding.before(layers[i], inputs, layer_kwargs[i], [n for n in lnames if plan.get(n, (None,))[0]],
                                prefix, modules)
                times["rounding"] += time.perf_counter() - t_r
            stage("statistics")
            t_p = time.perf_counter()
            with all_tokens_to_every_expert(layers[i]) if algo.experts_see_all_tokens else _nothing():
                inputs, weight_seconds = layer_pass.layer_pass(i, layers[i], inputs, layer_kwargs[i], lnames, leader,
                                                               outputs=rounding is None)
            times["weights"] += weight_seconds
            times["pass"] += time.perf_counter() - t_p - weight_seconds
            if rounding is not None:  # tune the layer's rounding; its outputs are computed again
                stage("learned rounding")
                t_r = time.perf_counter()
                inputs = None  # the pass's outputs: recomputed from the tuned weights, not kept beside them
                inputs = rounding.after(i, layers[i], layer_kwargs[i], modules, state, keep, ctx.anchors)
                times["rounding"] += time.perf_counter() - t_r
            if home is not None:
                offload(layers[i], home, state, stats, prefix)
            if on_layer is not None:
                state.kv = kv_plan_from(recipe, stats)  # this layer's K/V scales are known now
                on_layer(i, state)
            if store is not None:
                store.release(i)

    stats.tokens = int(calibration.numel())
    for n, H in online.items():  # rotated inputs that are not quantized still need the online rotation
        state.activations.setdefault(n, ActQuant(None, rotation=H))
    state.kv = kv_plan_from(recipe, stats)
    state.calibration = stats
    log.info("layer by layer (%s): %s", recipe.name, ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    if reference is not None:
        tune_model_scales(model, reference, recipe, state, calibration, keep_qtensors, progress)
    return state


@contextmanager
def _nothing():
    yield


def onload(layer: nn.Module, device: torch.device | None) -> torch.device | None:
    """Move ``layer`` to ``device`` for its pass; returns where it was (``None``: no move)."""
    if device is None:
        return None
    home = next(layer.parameters()).device
    if home == device:
        return None
    layer.to(device)
    return home


def offload(layer: nn.Module, home: torch.device, state: QuantState, stats: CalibStats, prefix: str) -> None:
    """Move ``layer`` back to ``home`` with what its pass left in ``state`` and ``stats``
    (names under ``prefix``; K/V absmax of every layer so far)."""
    layer.to(home)
    mine = lambda name: name.startswith(prefix + ".")  # noqa: E731
    for n, qt in list(state.weights.items()):
        if mine(n):
            state.weights[n] = dataclasses.replace(qt, **{f: move(getattr(qt, f), home)
                                                          for f in ("codes", "scale", "zero", "global_scale")})
    for n, aq in list(state.activations.items()):
        if mine(n):
            qp = aq.qparams
            state.activations[n] = dataclasses.replace(
                aq, qparams=None if qp is None else dataclasses.replace(qp, **{f: move(getattr(qp, f), home) for f in
                                                                              ("scale", "zero", "global_scale")}),
                global_scale=move(aq.global_scale, home), rotation=move(aq.rotation, home), keep=move(aq.keep, home))
    for d in (stats.input_absmax, stats.k_absmax, stats.v_absmax):
        for k, v in list(d.items()):
            d[k] = v.to(home)


def _expert_index(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Linear name → ``(its experts module, expert index)``, for every MoE expert's Linear."""
    out = {}
    for mname, experts in expert_modules(model).items():
        for e, expert in enumerate(experts):
            for lname, m in expert.named_modules():
                if isinstance(m, nn.Linear):
                    out[f"{mname}.{e}.{lname}"] = (mname, e)
    return out

