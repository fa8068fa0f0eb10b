"""How one weight is quantized in the layer-by-layer pass: the method is picked once per
run from the recipe's algorithms, with one result type whatever the method.

Precedence (:attr:`~lowbit.quantization.recipe.Algorithms.weight_method`): outlier channels
(LLM.int8()-style, the kept input channels returned explicitly), GPTQ (with MSE group scales
when the observer is ``mse``), AWQ's clipping search, the MSE observer, min-max rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.qtensor import QTensor, compute_qparams, dequantize, quantize as quantize_tensor
from ..numerics.scheme import Scheme
from . import algorithms as A
from .inputstats import InputStats
from .recipe import Algorithms

__all__ = ["QuantizedWeight", "WeightMethod"]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as its method left it.

    ``weight``: the new values (dequantized, float); ``qtensor``: its codes and scales, or
    ``None`` when some input channels stay in high precision; ``keep``: those channels'
    indices (outlier channels), else ``None``; ``anchor``: for learned rounding after GPTQ,
    the weights as GPTQ rounded them (:func:`~lowbit.quantization.algorithms.gptq`'s
    ``rounding_inputs``), else ``None``.
    """

    weight: torch.Tensor  # (out, in)
    qtensor: QTensor | None
    keep: torch.Tensor | None = None
    anchor: torch.Tensor | None = None

    def split(self, rows: list[int]) -> list["QuantizedWeight"]:
        """The members of a stack of weights quantized together, in order."""
        if len(rows) == 1:
            return [self]
        weights = torch.split(self.weight, rows)
        if self.qtensor is None:
            return [QuantizedWeight(w, None, self.keep) for w in weights]
        q = self.qtensor

        def parts(x):
            return torch.split(x, rows) if x is not None else [None] * len(rows)

        return [QuantizedWeight(w, QTensor(c, s, z, q.global_scale, q.scheme, ss, sm), None, a)
                for w, c, s, z, ss, sm, a in zip(weights, parts(q.codes), parts(q.scale), parts(q.zero),
                                                 parts(q.super_scale), parts(q.super_min), parts(self.anchor))]


@dataclass(frozen=True)
class WeightMethod:
    """The weight quantizer of one run (``algo``: the recipe's algorithms)."""

    algo: Algorithms

    @property
    def label(self) -> str:
        return self.algo.weight_method

    def stackable(self, scheme: Scheme) -> bool:
        """Whether weights reading one input can be quantized as one stacked matrix: GPTQ on
        schemes whose scale blocks are one row high (stacking rows changes no scale)."""
        return self.algo.gptq is not None and self.algo.outliers is None and \
            scheme.granularity.kind in ("channel", "group")

    def keep_channels(self, st: InputStats) -> torch.Tensor | None:
        """The input channels kept in high precision (outlier channels), else ``None``."""
        o = self.algo.outliers
        return None if o is None else A.outlier_channels(st.absmax, o.threshold, top_k=o.top_k)

    def quantize(self, w: torch.Tensor, scheme: Scheme, st: InputStats,
                 global_scale: torch.Tensor | None = None) -> QuantizedWeight:
        """Quantize ``w`` ``(out, in)`` with the statistics ``st`` of its input."""
        algo = self.algo
        importance = st.sq_sum / max(st.tokens, 1) if algo.mse_importance else None
        keep = self.keep_channels(st)
        if keep is not None:
            return QuantizedWeight(A.fake_quantize_with_outliers(w, scheme, keep), None, keep)
        if algo.gptq is not None:
            cfg = algo.gptq

            def observe(wg, cols, g):
                imp = importance[cols] if importance is not None else None
                return A.mse_qparams(wg, scheme, importance=imp, global_scale=g)

            out = A.gptq(w, st.hessian, scheme, block_size=cfg.block_size, damp=cfg.damp, act_order=cfg.act_order,
                         static_groups=cfg.static_groups, qparams_fn=observe if algo.observer == "mse" else None,
                         global_scale=global_scale, rounding_inputs=algo.round_opt is not None)
            if algo.round_opt is not None:  # learned rounding starts from the weights GPTQ rounded
                qt, anchor = out
                return QuantizedWeight(dequantize(qt), qt, None, anchor)
            qt = out
        elif algo.awq is not None and algo.awq.clip:
            qt = quantize_tensor(w, scheme, A.awq_clip(st.x, w, scheme, global_scale=global_scale))
        elif algo.observer == "mse":
            qt = quantize_tensor(w, scheme, A.mse_qparams(w, scheme, importance=importance, global_scale=global_scale))
        else:
            qt = quantize_tensor(w, scheme, compute_qparams(w, scheme, global_scale))
        return QuantizedWeight(dequantize(qt), qt)
