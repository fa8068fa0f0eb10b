"""The layer-by-layer loop behind GPTQ, AWQ, SmoothQuant, rotations and outlier channels.

1. Rotations, if asked, are applied to the whole model first (function-preserving).
2. The inputs of the first decoder layer are captured for every calibration window.
3. For each decoder layer in turn:
   a. SmoothQuant / AWQ only: run the layer as it is on its inputs, recording each
      Linear input's absmax (and AWQ's token sample), and balance scales into the layer
      (function-preserving);
   b. one pass of the layer over all its inputs, in lockstep (:mod:`lowbit.lockstep`):
      at the first Linear of each group that reads one input, every chunk adds that
      input to the group's statistics — channel absmax, mean x², the Hessian ``XᵀX``
      (GPTQ), a token sample (AWQ clipping) — then the group's weights are quantized
      (GPTQ, AWQ clipping, MSE observer or min-max) and its input quantization fixed,
      and every chunk goes on through the quantized group.  Each Linear thus sees the
      inputs the quantized Linears before it produce (GPTQ's "true sequential"), K/V
      absmax are recorded at the cache write, and the pass's outputs — the quantized
      layer's, activation quantization included — are the next layer's inputs.
Only one layer's inputs, activations and statistics are alive at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from . import algorithms as A
from . import heap
from .calibrate import CalibStats
from .kv import KVObserver, cache_kwarg, make_cache
from .lockstep import run_in_lockstep
from .models import arch_of, decoder_layers
from .offload import LayerStore, is_lazy
from .progress import staged_progress
from .pipeline import activation_plan, kv_plan_from, shared_global_scales, sibling_groups
from .qtensor import QTensor, compute_qparams, dequantize, quantize as quantize_tensor
from .recipe import GPTQ_DEFAULTS, Recipe
from .runtime import ActQuant, QuantState, quantized_activations
from .scheme import Scheme
from .transforms import (balance, balance_groups, residual_rotation_supported, rotate_down_input, rotate_residual_ends,
                         rotate_residual_layer)

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
    depend on positions only and broadcast over the batch).

    No decoder layer runs: for the arguments each layer's forward is replaced, for one
    call, by a stub that records them (so the layers may still be on the meta device)."""
    layers = decoder_layers(model)
    kwargs: list[dict] = [{} for _ in layers]

    def stub(i):
        def forward(hidden_states, *args, **kw):
            kwargs[i] = {k: v for k, v in kw.items() if k != "hidden_states"}
            if i == len(layers) - 1:
                raise _Stop  # nothing after the last layer is needed
            return hidden_states
        return forward

    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    try:
        model(input_ids=windows[:1], use_cache=False)
    except _Stop:
        pass
    finally:
        for layer in layers:
            del layer.forward
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
    gram_upper: torch.Tensor | None = None  # XᵀX on and above the diagonal blocks (see _add_gram)
    samples: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0

    def add(self, x: torch.Tensor, hessian: bool, squares: bool, sample_every: int, bf16_gram: bool = False) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        a = torch.maximum(x.amax(0), -x.amin(0))  # torch.aminmax is ~10× slower here
        self.absmax = a if self.absmax is None else torch.maximum(self.absmax, a)
        if squares:
            sq = (x * x).sum(0)
            self.sq_sum = sq if self.sq_sum is None else self.sq_sum + sq
        if hessian:
            if self.gram_upper is None:
                self.gram_upper = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32)
            _add_gram(self.gram_upper, x, bf16=bf16_gram)
        if sample_every:
            self.samples.append(x[::sample_every].clone())
        self.tokens += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor | None:
        """``XᵀX`` over every recorded token (symmetric), or ``None`` if not recorded."""
        if self.gram_upper is None:
            return None
        u = self.gram_upper
        return torch.triu(u) + torch.triu(u, 1).T

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


def _add_gram(upper: torch.Tensor, x: torch.Tensor, blocks: int = 4, bf16: bool = False) -> None:
    """``upper += XᵀX`` for ``x`` ``(tokens, d)``, only where a row block meets the columns
    from its own block on: ``upper[a, a:] += x[:, a]ᵀ x[:, a:]``.  The blocks below the
    diagonal are never formed (the matrix is symmetric), which takes (b+1)/2b of the
    flops; measured on this project's CPU, 2× faster than one full GEMM at d = 1536 and
    1.2× at d = 576.  Entries left of the diagonal inside a diagonal block are
    accumulated too but not read (:attr:`_InputStats.hessian` takes the upper triangle).

    With ``bf16`` the products are of bf16-rounded inputs, accumulated in fp32 (oneDNN's
    bf16 math mode, AMX or AVX512-BF16; elsewhere oneDNN stays in fp32): another 2.6× at
    d = 1536.  Each input loses bits below 2⁻⁹ of itself, so an entry's error is about
    2⁻⁹·√(2/n) of ``√(H_ii H_jj)`` over ``n`` tokens — measured 5·10⁻⁴ on one 2,048-token
    chunk, ~10⁻⁴ over 64k tokens — against GPTQ's dampening of 10⁻² of the mean
    diagonal."""
    d = x.shape[1]
    edges = [round(d * k / blocks) for k in range(blocks + 1)]
    with _matmul_precision("bf16" if bf16 else None):
        for a, b in zip(edges[:-1], edges[1:]):
            upper[a:b, a:].addmm_(x[:, a:b].T, x[:, a:])


@contextmanager
def _matmul_precision(mode: str | None) -> Iterator[None]:
    """oneDNN's fp32 matmul precision set to ``mode`` while the block runs (restored after,
    also on error); ``None`` leaves it as it is."""
    flag = torch.backends.mkldnn.matmul
    previous = flag.fp32_precision
    if mode is not None:
        flag.fp32_precision = mode
    try:
        yield
    finally:
        flag.fp32_precision = previous


def _groups_of_inputs(names: list[str], arch, prefix: str) -> dict[str, str]:
    """Linear name → the name of the first Linear that reads the same input."""
    leader = {n: n for n in names}
    for b in arch.balances:
        members = [f"{prefix}.{n}" for n in b.next]
        for m in members:
            if m in leader:
                leader[m] = members[0]
    return leader


def _rotations(model: nn.Module, cfg: dict | None) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    """Apply the model-level part of the configured rotations now; return the online
    rotations (module name → matrix) and the per-layer part, ``rotate(i)``, which the
    pipeline applies to each decoder layer when it reaches it (each layer's rotation is
    independent of the others', so this equals rotating the whole model first)."""
    if cfg is None:
        return {}, lambda i: None
    seed = int(cfg.get("seed", 0))
    cfgd = model.config
    arch = arch_of(model)
    Q = H = None
    if cfg.get("residual", True):
        why = residual_rotation_supported(model)
        if why:
            log.warning("residual rotation skipped: %s", why)
        else:
            Q = A.random_hadamard(cfgd.hidden_size, seed)
            rotate_residual_ends(model, Q)
    online = {}
    if cfg.get("down", True):
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
):
    """Quantize ``model`` in place with the calibration methods of ``recipe``.

    Args:
        model: a transformers causal LM of a known architecture.
        recipe: schemes and ``recipe.algorithms``.
        calibration: ``(n, seq)`` token windows.
        keep_qtensors: keep the QTensor of each quantized weight (GPTQ, min-max, MSE or
            AWQ-clipped weights; outlier-channel weights have none).
        progress: show a progress bar over layers.
        store: for a model loaded with :func:`lowbit.offload.load_lazy`: each decoder
            layer is loaded from it when the pipeline reaches the layer and released
            (written back to disk, freed) when the layer is done, so that one decoder
            layer is in memory at a time.  The model is left with its layers released:
            ``store.materialize()`` brings them back.
        on_layer: ``on_layer(i, state)`` when decoder layer ``i`` is done, before it is
            released (see :func:`lowbit.pipeline.quantize`).

    Returns:
        A :class:`~lowbit.runtime.QuantState`.
    """
    algo = recipe.algorithms
    arch = arch_of(model)
    if store is None and is_lazy(model):
        raise ValueError("the model has parameters on the meta device (loaded lazily): pass its LayerStore")
    modules = dict(model.named_modules())
    names = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    plan = recipe.resolve(names)
    online, rotate = _rotations(model, algo.rotation)
    modules = dict(model.named_modules())
    inputs, layer_kwargs = capture_inputs(model, calibration, algo.batch)
    if store is not None:
        store.release_outside()  # the embeddings and lm_head are not needed until the end
    layers = decoder_layers(model)
    state = QuantState(recipe)
    stats = CalibStats()
    awq_cfg = algo.awq
    need_h = algo.gptq is not None
    sample_every = 0
    if awq_cfg is not None:
        tokens = int(awq_cfg.get("tokens", 4096))
        total = sum(x.shape[0] * x.shape[1] for x in inputs)
        sample_every = max(1, total // tokens)
    siblings = sibling_groups(model)
    times = {"balancing": 0.0, "pass": 0.0, "weights": 0.0}

    ctx = _Run(model, modules, plan, algo, state, stats, online, siblings, need_h, sample_every,
               kv=recipe.kv_cache is not None, keep_qtensors=keep_qtensors, times=times)
    method = "GPTQ" if algo.gptq is not None else ("AWQ clipping" if awq_cfg is not None and awq_cfg.get("clip", True)
                                                    else ("MSE scales" if algo.observer == "mse" else "rounding"))
    for i, stage in staged_progress(range(len(layers)), f"quantizing {recipe.name} layer by layer", enabled=progress):
        ctx.stage = lambda g, stage=stage: stage(f"{method} {g.rsplit('.', 2)[-2]}.{g.rsplit('.', 1)[-1]}")
        prefix = f"{arch.layers}.{i}"
        lnames = [n for n in names if n.startswith(prefix + ".")]
        leader = _groups_of_inputs(lnames, arch, prefix)
        if store is not None:
            store.load(i)
        rotate(i)
        if algo.smoothquant is not None or awq_cfg is not None:
            stage("SmoothQuant scales" if algo.smoothquant is not None else "AWQ scales")
            t_b = time.perf_counter()
            _balance_layer(model, i, arch, layers[i], inputs, layer_kwargs[i], modules, plan, leader, online,
                           algo, sample_every, prefix)
            times["balancing"] += time.perf_counter() - t_b
        stage("statistics")
        t_p, w0 = time.perf_counter(), times["weights"]
        inputs = ctx.layer_pass(i, layers[i], inputs, layer_kwargs[i], lnames, leader)
        times["pass"] += time.perf_counter() - t_p - (times["weights"] - w0)
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
    return state


def _balance_layer(model, i, arch, layer, inputs, kwargs, modules, plan, leader, online, algo, sample_every,
                   prefix) -> None:
    """SmoothQuant or AWQ for decoder layer ``i``: record its inputs' absmax (and AWQ's token
    sample) with the layer as it is, up to down_proj's input, then move each balancing
    group's scales into the layer (function-preserving).  The statistics are discarded:
    the layer's pass that follows records them again on the balanced layer."""
    istats = {n: _InputStats() for n in set(leader.values())}
    rot_only = {n: ActQuant(None, rotation=online[n]) for n in leader if n in online}

    def hook_for(n):
        def hook(mod, args):
            istats[n].add(args[0], False, False, sample_every if algo.awq is not None else 0)
        return hook

    with quantized_activations(model, rot_only):
        handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in istats]
        # down_proj is the last Linear to run: once its input is recorded, the rest of the
        # layer's work would be thrown away
        handles.append(modules[f"{prefix}.{arch.down}"].register_forward_pre_hook(_stop))
        try:
            for h in inputs:
                try:
                    layer(h, **kwargs)
                except _Stop:
                    pass
        finally:
            for hd in handles:
                hd.remove()
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
            s, _ = A.awq_scales(st.x, ws, plan[quantized[0]][0], grid=int(algo.awq.get("grid", 20)),
                                duo_scaling=bool(algo.awq.get("duo_scaling", False)))
        off = arch.norm_offset if not isinstance(prev, nn.Linear) else 0.0
        balance(prev, nexts, s, norm_offset=off)


class _Run:
    """What the layers' passes of one quantization run share: the model, the plan, the
    methods, and the QuantState and statistics they fill in."""

    def __init__(self, model, modules, plan, algo, state, stats, online, siblings, need_h, sample_every, *,
                 kv: bool, keep_qtensors: bool, times: dict) -> None:
        self.model, self.modules, self.plan, self.algo = model, modules, plan, algo
        self.state, self.stats, self.online, self.siblings = state, stats, online, siblings
        self.need_h, self.sample_every = need_h, sample_every
        self.bf16_gram = need_h and {**GPTQ_DEFAULTS, **algo.gptq}["hessian"] == "bf16"
        self.kw_cache = cache_kwarg(model) if kv else None
        self.keep_qtensors = keep_qtensors
        self.times = times
        self.stage: Callable[[str], None] = lambda group: None  # shows the group being quantized

    def layer_pass(self, i: int, layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict, lnames: list[str],
                   leader: dict[str, str]) -> list[torch.Tensor]:
        """Layer ``i`` over every chunk of ``inputs`` in one pass, quantizing as it goes.

        Every chunk runs the real forward, in lockstep (:mod:`lowbit.lockstep`): at the
        first Linear of each group that reads one input, every chunk's input is added to
        the group's statistics; when all chunks are there, the group's weights are
        quantized and its input quantization fixed; then every chunk continues through
        the quantized group.  So each Linear's statistics come from inputs the quantized
        Linears before it produced (GPTQ's "true sequential" order), and the outputs are
        the quantized layer's.  ``inputs`` is consumed (its entries are released as the
        layer reads them), so that a chunk's input can be freed inside the layer.
        """
        hooked = [n for n in lnames if n in self.plan or n in self.online]
        istats: dict[str, _InputStats] = {}
        acts: dict[str, ActQuant] = {}  # quantization of each input, its rotation already applied
        done: set[str] = set()
        meeting = []  # the meet() of the lockstep run, once it has started
        obs = KVObserver() if self.kw_cache else None
        algo = self.algo

        def hook_for(n):
            g, rot = leader[n], self.online.get(n)

            def hook(mod, args):
                x = args[0]
                if rot is not None:
                    x = x @ rot.to(x.dtype)
                if g not in done:
                    istats.setdefault(g, _InputStats()).add(x, self.need_h, algo.mse_importance, self.sample_every,
                                                            self.bf16_gram)
                    meeting[0](g)
                aq = acts.get(n)
                return ((aq(x) if aq is not None else x),) + tuple(args[1:])
            return hook

        def on_meet(g: str) -> None:
            heap.trim()  # see lowbit.heap: keeps the peak near the live activations
            self.stage(g)
            t = time.perf_counter()
            members = [n for n in hooked if leader[n] == g]
            layer_acts = self._quantize_group(members, istats.pop(g), leader)
            acts.update({n: dataclasses.replace(aq, rotation=None) for n, aq in layer_acts.items()
                         if aq.scheme is not None})
            done.add(g)
            self.times["weights"] += time.perf_counter() - t

        pending = list(range(len(inputs)))

        def work(k: int, meet):
            meeting[:] = [meet]
            h, inputs[k] = inputs[k], None
            kw = dict(kwargs)
            if obs is not None:
                kw[self.kw_cache] = make_cache(self.model.config, obs.on_write, store=False)
            return _layer_out(layer(h, **kw))

        handles = [self.modules[n].register_forward_pre_hook(hook_for(n)) for n in hooked]
        try:
            outputs = run_in_lockstep(work, pending, on_meet)
        finally:
            for hd in handles:
                hd.remove()
        missed = [n for n in hooked if leader[n] not in done]
        if missed:
            raise RuntimeError(f"layer {i}: these Linears never ran, so they were not quantized: {missed}")
        if obs is not None:
            self.stats.k_absmax.update(obs.k_absmax)
            self.stats.v_absmax.update(obs.v_absmax)
        return outputs

    def _quantize_group(self, members: list[str], st: "_InputStats", leader: dict[str, str]) -> dict[str, ActQuant]:
        """Quantize the weights of Linears that read one input, from its statistics; record
        the statistics for static scales; return how their inputs are quantized."""
        plan, modules, algo, state = self.plan, self.modules, self.algo, self.state
        members_plan = {n: plan[n] for n in members if n in plan}
        shared = shared_global_scales(modules, members_plan, self.siblings)
        todo = [n for n in members if n in plan and plan[n][0] is not None]
        for batch_names in _weight_batches(todo, leader, plan, algo, modules):
            scheme = plan[batch_names[0]][0]
            ws = [modules[n].weight.detach().float() for n in batch_names]
            results = _split(_quantize_weight(torch.cat(ws), scheme, st, algo, shared.get(batch_names[0])),
                             [w.shape[0] for w in ws])
            for n, qt in zip(batch_names, results):
                if isinstance(qt, QTensor):
                    new = dequantize(qt)
                    if self.keep_qtensors:
                        state.weights[n] = qt
                else:
                    new = qt
                modules[n].weight.copy_(new.to(modules[n].weight.dtype))
                state.weight_schemes[n] = scheme
        for n in members:
            self.stats.input_absmax[n] = st.absmax
        layer_acts = activation_plan(members_plan, self.stats, self.online,
                                     _keep_channels(algo, self.stats, members, plan))
        state.activations.update(layer_acts)
        return layer_acts


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
