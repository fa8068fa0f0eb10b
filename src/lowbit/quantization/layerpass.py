"""One decoder layer's pass of the layer-by-layer pipeline: every calibration chunk runs
the layer in lockstep (or, with ``algorithms.recompute``, by replay: one chunk at a time,
recomputed from the layer's input for each group), and each group of Linears that reads
one input is quantized when all chunks have reached it (see
:mod:`lowbit.quantization.layerwise`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..numerics.scheme import Scheme
from ..util import heap
from ..util.lockstep import run_by_replay, run_in_lockstep
from .balancing import experts_by_module
from .calibrate import CalibStats
from .inputstats import InputStats
from .kv import KVObserver, make_cache
from .recipe import Algorithms
from .replaycache import FrozenChildren
from .runtime import ActQuant, QuantState
from .targets import activation_plan, shared_global_scales
from .weights import WeightMethod

__all__ = ["LayerPass", "PassContext"]

log = logging.getLogger(__name__)


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class PassContext:
    """What the layers' passes of one quantization run share: the model and its plan, the
    weight method, and the QuantState and statistics the passes fill in.

    ``online``: rotations applied to Linear inputs at run time; ``siblings``: fused groups
    sharing a global scale; ``need_h``: GPTQ's Hessians are accumulated;
    ``sample_every``: AWQ's token sampling stride (0: none); ``kv_cache_kwarg``: the
    forward keyword of the KV cache when K/V scales are calibrated, else ``None``;
    ``expert_of``: MoE expert Linear → ``(experts module, expert index)``, for the rule on
    experts that saw fewer than ``algo.expert_min_tokens`` tokens (min-max rounding);
    ``anchors``: Linear → the weights its method rounded, where they are not the layer's
    weights (GPTQ), for learned rounding (:mod:`lowbit.quantization.roundpass`) to take.
    ``expert_sample_every``: AWQ's sampling stride for expert inputs.
    """

    model: nn.Module
    modules: dict[str, nn.Module]
    plan: dict[str, tuple[Scheme | None, Scheme | None]]
    algo: Algorithms
    state: QuantState
    stats: CalibStats
    online: dict[str, torch.Tensor]
    siblings: list[tuple[str, ...]]
    need_h: bool
    sample_every: int
    kv_cache_kwarg: str | None
    keep_qtensors: bool
    expert_of: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    anchors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # learned rounding's starts
    expert_sample_every: int = 0  # AWQ's stride for expert inputs (lowbit.quantization.balancing)

    @property
    def method(self) -> WeightMethod:
        return WeightMethod(self.algo)

    @property
    def bf16_gram(self) -> bool:
        return self.need_h and self.algo.gptq.hessian == "bf16"

    @property
    def need_absmax(self) -> bool:
        """Channel absmax feeds static input scales and outlier channels only."""
        return self.algo.outliers is not None or any(
            i is not None and (not i.dynamic or i.global_scale) for _, i in self.plan.values())


class LayerPass:
    """One decoder layer's pass at a time, over a run's :class:`PassContext`."""

    def __init__(self, ctx: PassContext, stage: Callable[[str], None] = lambda group: None) -> None:
        self.ctx = ctx
        self.stage = stage  # shows the group being quantized
        self.rounded_experts: set[tuple[str, int]] = set()  # too few tokens: min-max rounding

    def layer_pass(self, i: int, layer: nn.Module, inputs: list[torch.Tensor], kwargs: dict, lnames: list[str],
                   leader: dict[str, str], outputs: bool = True) -> tuple[list[torch.Tensor] | None, float]:
        """Layer ``i`` over every chunk of ``inputs`` in one pass, quantizing as it goes;
        returns the layer's outputs per chunk (``None`` when ``outputs`` is false and the
        pass could skip making them) and the seconds spent quantizing weights.

        Every chunk runs the real forward, in lockstep (:mod:`lowbit.util.lockstep`): at the
        first Linear of each group that reads one input, every chunk's input is added to
        the group's statistics; when all chunks are there, the group's weights are
        quantized and its input quantization fixed; then every chunk continues through
        the quantized group.  So each Linear's statistics come from inputs the quantized
        Linears before it produced (GPTQ's "true sequential" order), and the outputs are
        the quantized layer's.  In lockstep ``inputs`` is consumed (its entries are released
        as the layer reads them), so that a chunk's input can be freed inside the layer.

        With ``algorithms.recompute`` the chunks run by replay
        (:func:`~lowbit.util.lockstep.run_by_replay`): the same statistics in the same order
        and the same outputs, bit for bit, with one chunk's intermediate activations alive
        instead of all of them, for the cost of running each chunk up to each group again.
        ``inputs`` is then left as it is (every round reads it).
        """
        ctx = self.ctx
        hooked = [n for n in lnames if n in ctx.plan or n in ctx.online]
        istats: dict[str, InputStats] = {}
        acts: dict[str, ActQuant] = {}  # quantization of each input, its rotation already applied
        done: set[str] = set()
        meeting = []  # the meet() of the lockstep run, once it has started
        obs: list[KVObserver | None] = [None]  # the K/V observer of the current round (replay runs several)
        need_absmax, bf16_gram, squares = ctx.need_absmax, ctx.bf16_gram, ctx.algo.mse_importance
        weight_seconds = 0.0

        def hook_for(n):
            g, rot = leader[n], ctx.online.get(n)
            every = ctx.expert_sample_every if g in ctx.expert_of else ctx.sample_every

            def hook(mod, args):
                x = args[0]
                if rot is not None:
                    x = x @ rot.to(x.device, x.dtype)
                if g not in done:
                    istats.setdefault(g, InputStats()).add(
                        x, absmax=need_absmax, gram=ctx.need_h, squares=squares,
                        sample_every=every, bf16_gram=bf16_gram)
                    meeting[0](g)
                aq = acts.get(n)
                return ((aq(x) if aq is not None else x),) + tuple(args[1:])
            return hook

        def on_meet(g: str) -> None:
            nonlocal weight_seconds
            heap.trim()  # see lowbit.util.heap: keeps the peak near the live activations
            self.stage(g)
            t = time.perf_counter()
            members = [n for n in hooked if leader[n] == g]
            layer_acts = self._quantize_group(members, istats.pop(g), leader)
            acts.update({n: dataclasses.replace(aq, rotation=None) for n, aq in layer_acts.items()
                         if aq.scheme is not None})
            done.add(g)
            weight_seconds += time.perf_counter() - t

        replay = ctx.algo.recompute
        frozen = None  # replay: outputs of children whose Linears are all quantized (lowbit.quantization.replaycache)
        if replay and not ctx.kv_cache_kwarg:
            group_of = {id(ctx.modules[n]): leader[n] for n in hooked}
            frozen = FrozenChildren(layer, lambda c: {group_of[id(m)] for m in c.modules() if id(m) in group_of},
                                    {leader[n] for n in hooked}, final_round=outputs)

        def work(k: int, meet):
            meeting[:] = [meet]
            if replay:
                h = inputs[k]
            else:
                h, inputs[k] = inputs[k], None
            kw = dict(kwargs)
            if ctx.kv_cache_kwarg:
                if k == 0:  # a new round: K/V are counted once, from the round that finishes
                    obs[0] = KVObserver()
                kw[ctx.kv_cache_kwarg] = make_cache(ctx.model.config, obs[0].on_write, store=False)
            if frozen is None:
                return _layer_out(layer(h, **kw))
            if k == 0:
                frozen.start_round(done)
            with frozen.chunk(k):
                return _layer_out(layer(h, **kw))

        handles = [ctx.modules[n].register_forward_pre_hook(hook_for(n)) for n in hooked]
        chunks = list(range(len(inputs)))
        try:
            if replay:
                # without outputs, stop once every group is quantized — unless K/V are observed, which
                # needs the round in which every chunk runs the whole layer
                last = set() if outputs or ctx.kv_cache_kwarg else {leader[n] for n in hooked}
                result = run_by_replay(work, chunks, on_meet, stop_after=last)
            else:
                result = run_in_lockstep(work, chunks, on_meet)
        finally:
            for hd in handles:
                hd.remove()
        missed = [n for n in hooked if leader[n] not in done]
        if missed:
            raise RuntimeError(f"layer {i}: these Linears never ran, so they were not quantized: {missed}")
        self._report_rounded_experts(i)
        if obs[0] is not None:
            ctx.stats.k_absmax.update(obs[0].k_absmax)
            ctx.stats.v_absmax.update(obs[0].v_absmax)
            ctx.stats.k_moments.update(obs[0].k_moments)
        return result, weight_seconds

    def _report_rounded_experts(self, i: int) -> None:
        """Log, per MoE layer, how many experts fell back to min-max rounding (too few tokens)."""
        ctx = self.ctx
        for mname, all_e in experts_by_module(ctx.expert_of).items():
            rounded = sorted(e for m, e in self.rounded_experts if m == mname)
            if rounded:
                log.warning("%d of %d experts in layer %d saw < %d tokens: RTN (min-max rounding) for experts %s",
                            len(rounded), len(all_e), i, ctx.algo.expert_min_tokens, rounded)
        self.rounded_experts.clear()

    def _quantize_group(self, members: list[str], st: InputStats, leader: dict[str, str]) -> dict[str, ActQuant]:
        """Quantize the weights of Linears that read one input, from its statistics; record
        the statistics for static scales; return how their inputs are quantized."""
        ctx = self.ctx
        plan, modules, state, method = ctx.plan, ctx.modules, ctx.state, ctx.method
        members_plan = {n: plan[n] for n in members if n in plan}
        shared = shared_global_scales(modules, members_plan, ctx.siblings)
        todo = [n for n in members if n in plan and plan[n][0] is not None]
        few = [n for n in todo if n in ctx.expert_of and st.tokens < ctx.algo.expert_min_tokens]
        self.rounded_experts.update(ctx.expert_of[n] for n in few)
        for batch_names in _weight_batches(todo, leader, plan, method):
            scheme = plan[batch_names[0]][0]
            ws = [modules[n].weight.detach().float() for n in batch_names]
            how = _MIN_MAX if batch_names[0] in few else method
            result = how.quantize(torch.cat(ws), scheme, st, shared.get(batch_names[0]))
            for n, q in zip(batch_names, result.split([w.shape[0] for w in ws])):
                if q.qtensor is not None and ctx.keep_qtensors:
                    state.weights[n] = q.qtensor
                if q.anchor is not None:
                    ctx.anchors[n] = q.anchor
                modules[n].weight.copy_(q.weight.to(modules[n].weight.dtype))
                state.weight_schemes[n] = scheme
        if st.absmax is not None:
            for n in members:
                ctx.stats.input_absmax[n] = st.absmax
        keep = method.keep_channels(st)
        kept = {} if keep is None else {n: keep for n in members if n in plan and plan[n][1] is not None}
        layer_acts = activation_plan(members_plan, ctx.stats, ctx.online, kept)
        state.activations.update(layer_acts)
        return layer_acts


_MIN_MAX = WeightMethod(Algorithms())


def _weight_batches(names: list[str], leader: dict[str, str], plan, method: WeightMethod) -> list[list[str]]:
    """Linears quantized in one call: those that read the same input and use the same
    scheme when the method can stack them (:meth:`WeightMethod.stackable`); every other
    linear alone."""
    batches: dict[tuple, list[str]] = {}
    for n in names:
        scheme = plan[n][0]
        key = (leader[n], scheme) if method.stackable(scheme) else (n,)
        batches.setdefault(key, []).append(n)
    return list(batches.values())
