"""One decoder layer's pass of the layer-by-layer pipeline: every calibration chunk runs
the layer in lockstep, and each group of Linears that reads one input is quantized when
all chunks have reached it (see :mod:`lowbit.layerwise`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from . import algorithms as A
from ..util import heap
from .calibrate import CalibStats
from .inputstats import InputStats
from .kv import KVObserver, cache_kwarg, make_cache
from ..util.lockstep import run_in_lockstep
from .targets import activation_plan, shared_global_scales
from ..numerics.qtensor import QTensor, compute_qparams, dequantize, quantize as quantize_tensor
from .recipe import GPTQ_DEFAULTS
from .runtime import ActQuant
from ..numerics.scheme import Scheme

__all__ = ["LayerPass"]


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


class LayerPass:
    """What the layers' passes of one quantization run share: the model, the plan, the
    methods, and the QuantState and statistics they fill in."""

    def __init__(self, model, modules, plan, algo, state, stats, online, siblings, need_h, sample_every, *,
                 kv: bool, keep_qtensors: bool, times: dict) -> None:
        self.model, self.modules, self.plan, self.algo = model, modules, plan, algo
        self.state, self.stats, self.online, self.siblings = state, stats, online, siblings
        self.need_h, self.sample_every = need_h, sample_every
        self.bf16_gram = need_h and {**GPTQ_DEFAULTS, **algo.gptq}["hessian"] == "bf16"
        # channel absmax feeds static input scales and outlier channels only
        self.need_absmax = algo.outliers is not None or any(
            i is not None and (not i.dynamic or i.global_scale) for _, i in plan.values())
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
        istats: dict[str, InputStats] = {}
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
                    istats.setdefault(g, InputStats()).add(
                        x, absmax=self.need_absmax, gram=self.need_h, squares=algo.mse_importance,
                        sample_every=self.sample_every, bf16_gram=self.bf16_gram)
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

    def _quantize_group(self, members: list[str], st: "InputStats", leader: dict[str, str]) -> dict[str, ActQuant]:
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
        if st.absmax is not None:
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


def _quantize_weight(w: torch.Tensor, scheme: Scheme, st: InputStats, algo, global_scale):
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
