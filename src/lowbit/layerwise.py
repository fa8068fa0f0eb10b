"""The layer-by-layer loop behind GPTQ, AWQ, SmoothQuant, rotations and outlier channels.

1. Rotations, if asked, are applied to the whole model first (function-preserving).
2. The inputs of the first decoder layer are captured for every calibration window.
3. For each decoder layer in turn:
   a. run it on its inputs with hooks that record, per Linear input, the channel absmax,
      mean |x|, mean x², the Hessian ``XᵀX`` (GPTQ) and a token sample (AWQ), and the
      K/V absmax at the cache write;
   b. balance scales into the layer (SmoothQuant or AWQ) and update those statistics
      analytically (an input divided by ``s`` has its absmax divided by ``s`` and its
      Hessian by ``s sᵀ``);
   c. quantize the layer's weights (GPTQ, AWQ clipping, MSE observer or min-max);
   d. run the *quantized* layer, activation quantization included, to produce the next
      layer's inputs.
Only one layer's inputs, outputs and statistics are alive at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from . import algorithms as A
from .calibrate import CalibStats
from .kv import KVObserver, cache_kwarg, make_cache
from .models import arch_of, decoder_layers
from .progress import progress_bar
from .qtensor import QTensor, compute_qparams, dequantize, quantize as quantize_tensor
from .recipe import GPTQ_DEFAULTS, Recipe
from .runtime import ActQuant, quantized_activations
from .scheme import Scheme
from .transforms import balance, balance_groups, residual_rotation_supported, rotate_down_inputs, rotate_residual

__all__ = ["quantize_layerwise"]

log = logging.getLogger(__name__)


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


def _stop(module, args):
    raise _Stop


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def capture_inputs(model: nn.Module, windows: torch.Tensor, batch: int) -> tuple[list[torch.Tensor], list[dict]]:
    """The first decoder layer's input for each batch of windows, and the keyword
    arguments every decoder layer is called with (recorded once, on one window; they
    depend on positions only and broadcast over the batch)."""
    layers = decoder_layers(model)
    kwargs: list[dict] = [{} for _ in layers]

    def record(i):
        def hook(mod, args, kw):
            kwargs[i] = {k: v for k, v in kw.items() if k != "hidden_states"}
        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model(input_ids=windows[:1], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    inputs: list[torch.Tensor] = []

    def grab(mod, args, kw):
        inputs.append((args[0] if args else kw["hidden_states"]).detach())
        raise _Stop

    h = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for b in range(0, len(windows), batch):
            try:
                model(input_ids=windows[b : b + batch], use_cache=False)
            except _Stop:
                pass
    finally:
        h.remove()
    return inputs, kwargs


@dataclass
class _InputStats:
    """Statistics of one Linear input (shared by the Linears that read the same tensor):
    channel absmax always; ``XᵀX`` (GPTQ), ``Σx²`` (MSE importance) and a token sample
    (AWQ) only when a method needs them."""

    absmax: torch.Tensor | None = None
    sq_sum: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    samples: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0

    def add(self, x: torch.Tensor, hessian: bool, squares: bool, sample_every: int) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        a = torch.maximum(x.amax(0), -x.amin(0))  # torch.aminmax is ~10× slower here
        self.absmax = a if self.absmax is None else torch.maximum(self.absmax, a)
        if squares:
            sq = (x * x).sum(0)
            self.sq_sum = sq if self.sq_sum is None else self.sq_sum + sq
        if hessian:
            if self.hessian is None:
                self.hessian = x.T @ x
            else:
                self.hessian.addmm_(x.T, x)
        if sample_every:
            self.samples.append(x[::sample_every].clone())
        self.tokens += x.shape[0]

    def scale_inputs(self, s: torch.Tensor) -> None:
        """The input became x / s (a balancing scale moved into the weights)."""
        self.absmax = self.absmax / s
        if self.sq_sum is not None:
            self.sq_sum = self.sq_sum / (s * s)
        if self.hessian is not None:
            self.hessian = self.hessian / s[:, None] / s[None, :]
        self.samples = [x / s for x in self.samples]

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


def _groups_of_inputs(names: list[str], arch, prefix: str) -> dict[str, str]:
    """Linear name → the name of the first Linear that reads the same input."""
    leader = {n: n for n in names}
    for b in arch.balances:
        members = [f"{prefix}.{n}" for n in b.next]
        for m in members:
            if m in leader:
                leader[m] = members[0]
    return leader


def _rotations(model: nn.Module, cfg: dict) -> dict[str, torch.Tensor]:
    """Apply the configured rotations; return the online ones (module name → matrix)."""
    seed = int(cfg.get("seed", 0))
    cfgd = model.config
    online = {}
    if cfg.get("residual", True):
        why = residual_rotation_supported(model)
        if why:
            log.warning("residual rotation skipped: %s", why)
        else:
            rotate_residual(model, A.random_hadamard(cfgd.hidden_size, seed))
    if cfg.get("down", True):
        online = rotate_down_inputs(model, A.random_hadamard(cfgd.intermediate_size, seed + 1))
    return online


@torch.no_grad()
def quantize_layerwise(
    model: nn.Module,
    recipe: Recipe,
    calibration: torch.Tensor,
    *,
    keep_qtensors: bool = False,
    progress: bool = True,
):
    """Quantize ``model`` in place with the calibration methods of ``recipe``.

    Args:
        model: a transformers causal LM of a known architecture.
        recipe: schemes and ``recipe.algorithms``.
        calibration: ``(n, seq)`` token windows.
        keep_qtensors: keep the QTensor of each quantized weight (GPTQ, min-max, MSE or
            AWQ-clipped weights; outlier-channel weights have none).
        progress: show a progress bar over layers.

    Returns:
        A :class:`~lowbit.runtime.QuantState`.
    """
    from .pipeline import activation_plan, kv_plan_from, shared_global_scales, sibling_groups
    from .runtime import QuantState

    algo = recipe.algorithms
    arch = arch_of(model)
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    plan = recipe.resolve(names)
    online = _rotations(model, algo.rotation) if algo.rotation is not None else {}
    modules = dict(model.named_modules())
    inputs, layer_kwargs = capture_inputs(model, calibration, algo.batch)
    layers = decoder_layers(model)
    state = QuantState(recipe)
    stats = CalibStats()
    kw_cache = cache_kwarg(model)
    awq_cfg = algo.awq
    need_h = algo.gptq is not None
    sample_every = 0
    if awq_cfg is not None:
        tokens = int(awq_cfg.get("tokens", 4096))
        total = sum(x.shape[0] * x.shape[1] for x in inputs)
        sample_every = max(1, total // tokens)
    siblings = sibling_groups(model)
    times = {"statistics": 0.0, "balancing": 0.0, "weights": 0.0, "propagation": 0.0}

    for i in progress_bar(range(len(layers)), f"quantizing {recipe.name} layer by layer", enabled=progress):
        layer = layers[i]
        prefix = f"{arch.layers}.{i}"
        lnames = [n for n in names if n.startswith(prefix + ".")]
        leader = _groups_of_inputs(lnames, arch, prefix)
        istats = {n: _InputStats() for n in set(leader.values())}
        rot_only = {n: ActQuant(None, rotation=online[n]) for n in lnames if n in online}

        # (a) statistics of every input, with the layer as it is
        def hook_for(n):
            def hook(mod, args):
                istats[n].add(args[0], need_h, algo.mse_importance, sample_every)
            return hook

        obs = KVObserver()
        t_s = time.perf_counter()
        with quantized_activations(model, rot_only):
            handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in istats]
            # down_proj is the last Linear to run: once its input is recorded, the rest of
            # the layer's work would be thrown away
            handles.append(modules[f"{prefix}.{arch.down}"].register_forward_pre_hook(_stop))
            try:
                for h in inputs:
                    kw = dict(layer_kwargs[i])
                    kw[kw_cache] = make_cache(model.config, obs.on_write)
                    try:
                        layer(h, **kw)
                    except _Stop:
                        pass
            finally:
                for hd in handles:
                    hd.remove()

        times["statistics"] += time.perf_counter() - t_s

        # (b) balancing
        t_b = time.perf_counter()
        if algo.smoothquant is not None or awq_cfg is not None:
            for prev, prev_name, nexts, next_names in balance_groups(model, i, arch):
                quantized = [n for n in next_names if n in plan and plan[n][0] is not None]
                if not quantized:
                    continue
                st = istats[leader[next_names[0]]]
                ws = [m.weight.detach().float() for m in nexts]
                if algo.smoothquant is not None:
                    if not any(plan.get(n, (None, None))[1] is not None for n in next_names):
                        continue  # SmoothQuant helps activation quantization only
                    s = A.smoothquant_scales(st.absmax, ws, float(algo.smoothquant.get("alpha", 0.5)))
                else:
                    s, _ = A.awq_scales(st.x, ws, plan[quantized[0]][0], grid=int(awq_cfg.get("grid", 20)),
                                        duo_scaling=bool(awq_cfg.get("duo_scaling", False)))
                off = arch.norm_offset if not isinstance(prev, nn.Linear) else 0.0
                balance(prev, nexts, s, norm_offset=off)
                st.scale_inputs(s)
        times["balancing"] += time.perf_counter() - t_b

        # (c) weights; linears that read one input share its Hessian and run as one GPTQ call
        t_w = time.perf_counter()
        shared = shared_global_scales(modules, plan, siblings)
        todo = [n for n in lnames if n in plan and plan[n][0] is not None]
        for batch_names in _weight_batches(todo, leader, plan, algo, modules):
            scheme = plan[batch_names[0]][0]
            st = istats[leader[batch_names[0]]]
            ws = [modules[n].weight.detach().float() for n in batch_names]
            results = _split(_quantize_weight(torch.cat(ws), scheme, st, algo, shared.get(batch_names[0])),
                             [w.shape[0] for w in ws])
            for n, qt in zip(batch_names, results):
                if isinstance(qt, QTensor):
                    new = dequantize(qt)
                    if keep_qtensors:
                        state.weights[n] = qt
                else:
                    new = qt
                modules[n].weight.copy_(new.to(modules[n].weight.dtype))
                state.weight_schemes[n] = scheme
        times["weights"] += time.perf_counter() - t_w

        # statistics for static activation and KV scales, after balancing
        for n in lnames:
            stats.input_absmax[n] = istats[leader[n]].absmax
        stats.k_absmax.update(obs.k_absmax)
        stats.v_absmax.update(obs.v_absmax)
        layer_acts = activation_plan({n: plan[n] for n in lnames if n in plan}, stats, online, _keep_channels(algo, stats, lnames, plan))
        state.activations.update(layer_acts)

        # (d) the quantized layer produces the next layer's inputs
        t_p = time.perf_counter()
        with quantized_activations(model, layer_acts):
            inputs = [_layer_out(layer(h, **layer_kwargs[i])) for h in inputs]
        times["propagation"] += time.perf_counter() - t_p
        del istats

    stats.tokens = int(calibration.numel())
    for n, H in online.items():  # rotated inputs that are not quantized still need the online rotation
        state.activations.setdefault(n, ActQuant(None, rotation=H))
    state.kv = kv_plan_from(recipe, stats)
    state.calibration = stats
    log.info("layer by layer (%s): %s", recipe.name, ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return state


def _weight_batches(names: list[str], leader: dict[str, str], plan, algo, modules) -> list[list[str]]:
    """Linears quantized in one call: with GPTQ, those that read the same input and use
    the same scheme, when their scale blocks are one row high (so that stacking rows
    changes no scale); every other linear alone."""
    batches: dict[tuple, list[str]] = {}
    for n in names:
        scheme = plan[n][0]
        stackable = algo.gptq is not None and algo.outliers is None and scheme.granularity.kind in ("channel", "group")
        key = (leader[n], scheme) if stackable else (n,)
        batches.setdefault(key, []).append(n)
    return list(batches.values())


def _split(q, rows: list[int]):
    """Split a quantized stack of weights back into its members."""
    if len(rows) == 1:
        return [q]
    if not isinstance(q, QTensor):
        return list(torch.split(q, rows))
    codes = torch.split(q.codes, rows)
    scales = torch.split(q.scale, rows)
    zeros = torch.split(q.zero, rows) if q.zero is not None else [None] * len(rows)
    return [QTensor(c, s, z, q.global_scale, q.scheme) for c, s, z in zip(codes, scales, zeros)]


def _keep_channels(algo, stats: CalibStats, lnames: list[str], plan) -> dict[str, torch.Tensor]:
    if algo.outliers is None:
        return {}
    out = {}
    for n in lnames:
        if n in plan and plan[n][1] is not None:
            cfg = algo.outliers
            out[n] = A.outlier_channels(stats.input_absmax[n], cfg.get("threshold", 6.0), top_k=cfg.get("top_k"))
    return out


def _quantize_weight(w: torch.Tensor, scheme: Scheme, st: _InputStats, algo, global_scale):
    """One weight by the configured method; a QTensor, or a plain tensor (outliers)."""
    importance = st.sq_sum / max(st.tokens, 1) if algo.mse_importance else None

    def observe(wg, cols, g):
        imp = importance[cols] if importance is not None else None
        return A.mse_qparams(wg, scheme, importance=imp, global_scale=g)

    if algo.outliers is not None:
        keep = A.outlier_channels(st.absmax, algo.outliers.get("threshold", 6.0), top_k=algo.outliers.get("top_k"))
        return A.fake_quantize_with_outliers(w, scheme, keep)
    if algo.gptq is not None:
        cfg = {**GPTQ_DEFAULTS, **algo.gptq}
        return A.gptq(
            w, st.hessian, scheme,
            block_size=int(cfg["block_size"]), damp=float(cfg["damp"]),
            act_order=bool(cfg["act_order"]), static_groups=bool(cfg["static_groups"]),
            qparams_fn=observe if algo.observer == "mse" else None, global_scale=global_scale,
        )
    if algo.awq is not None and algo.awq.get("clip", True):
        qp = A.awq_clip(st.x, w, scheme, global_scale=global_scale)
        return quantize_tensor(w, scheme, qp)
    if algo.observer == "mse":
        imp = importance
        return quantize_tensor(w, scheme, A.mse_qparams(w, scheme, importance=imp, global_scale=global_scale))
    return quantize_tensor(w, scheme, compute_qparams(w, scheme, global_scale))
