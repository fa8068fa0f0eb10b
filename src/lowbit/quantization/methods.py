"""Settings of the calibration methods, as frozen typed configs that own their defaults.

Each config validates in ``__post_init__`` (a recipe that parses runs: ``damp: "lots"`` or
``block_size: -3`` fail when the recipe is read, not after calibration) and is parsed from
YAML by :func:`lowbit.util.validate.from_mapping`, the same field-driven parser
:class:`~lowbit.numerics.scheme.Scheme` uses.  ``algorithms: {gptq: {}}`` (or ``gptq: true``)
turns a method on with its defaults; leaving the key out leaves it off.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTQConfig", "AWQConfig", "SmoothQuantConfig", "RotationConfig", "OutlierConfig", "RoundOptConfig",
           "ScaleTuneConfig", "METHODS"]


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ (Frantar et al. 2023; :func:`lowbit.quantization.algorithms.gptq`).

    ``act_order`` + ``static_groups`` (the default, llm-compressor's ``actorder: static``):
    columns in decreasing ``H_ii`` order, group scales from the original weights in storage
    order — an ordinary group-quantized tensor, no ``g_idx``; on SmolLM2 INT4 g64 it halves
    each layer's output error against storage order.  ``damp``: the fraction of the mean
    Hessian diagonal added to it.  ``hessian``: ``bf16`` forms ``XᵀX`` from bf16 products
    accumulated in fp32 (oneDNN's bf16 math where the CPU has it), ``fp32`` in plain fp32.
    """

    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    static_groups: bool = True
    hessian: str = "bf16"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp must be in [0, 1), got {self.damp}")
        if self.hessian not in ("bf16", "fp32"):
            raise ValueError(f"hessian must be bf16 or fp32, got {self.hessian!r}")


@dataclass(frozen=True)
class AWQConfig:
    """AWQ (Lin et al. 2024; :func:`lowbit.quantization.algorithms.awq_scales`): a grid search
    over ``s = mean|x|^α`` (``grid`` points of α in [0, 1); with ``duo_scaling`` also divided
    by the weight's mean magnitude), then, with ``clip``, a search of each group's clipping
    ratio.  ``tokens``: calibration tokens sampled per layer input for the searches."""

    grid: int = 20
    clip: bool = True
    duo_scaling: bool = False
    tokens: int = 4096

    def __post_init__(self) -> None:
        if self.grid < 1:
            raise ValueError(f"grid must be >= 1, got {self.grid}")
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")


@dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant (Xiao et al. 2023, eq. 4): ``s_j = max|X_j|^α / max|W_j|^(1−α)``."""

    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")


@dataclass(frozen=True)
class RotationConfig:
    """Seeded random Hadamard rotations (QuaRot / SpinQuant-style) of the residual stream
    (``residual``) and of the down_proj inputs (``down``)."""

    seed: int = 0
    residual: bool = True
    down: bool = True


@dataclass(frozen=True)
class OutlierConfig:
    """Input channels whose calibrated absmax exceeds ``threshold`` × the median stay in high
    precision (LLM.int8()-style; at most ``top_k`` of them when given)."""

    threshold: float = 6.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        _positive("threshold", self.threshold)
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


@dataclass(frozen=True)
class RoundOptConfig:
    """Learned rounding (SignRound-style; :func:`lowbit.quantization.algorithms.optimize_rounding`):
    after the weight method (min-max, MSE, AWQ clipping or GPTQ) has quantized a decoder
    layer, its per-weight rounding offsets and per-block clip factors are tuned jointly by
    ``steps`` signed-gradient steps (step size ``lr``, default ``1 / steps``, and
    ``clip_lr`` for the clip factors, default ``lr / 10``; both decay linearly) to minimise
    the layer's output error.  (With the clip factors at ``lr`` too, on SmolLM2 layers 0, 10
    and 20 at int4 g64, learning them made the layer's error *worse* than offsets alone:
    −38/−39/−41% against −59/−52/−57% on the training windows; at ``lr / 10``: −64/−51/−60%.)

    ``windows``: calibration windows the layer is trained on (the first ones of the
    calibration set), ``batch`` of them per step.  ``target``: ``float`` — the float
    model's outputs of that layer (a float stream of the training windows is carried
    through the layers; the quantized layer reads the quantized stream, so it also makes
    up for the error of the layers before it, as AutoRound does); ``layer`` — the float
    layer's outputs on the quantized stream (the objective GPTQ has, for a whole layer).
    ``learn_clip``: tune the clip factors too (in ``[clip_min, 1]``).  ``checks``: times
    the loss over all training windows is measured (the best of those and the start is
    kept, so a layer's training loss never ends above its initial quantization's).
    ``threads``: torch's intra-op threads while tuning (0: unchanged; see
    :func:`~lowbit.quantization.algorithms.optimize_rounding`).  ``compute``: the dtype of
    the training steps' matmuls — ``bf16`` (autocast), ``fp32``, or ``auto``: bf16 where the
    device computes it natively (a CPU with AVX-512 BF16 / AMX, a GPU that supports it), else
    fp32.  On SmolLM2 layer 10 (int4 g64, 256 window passes) bf16 steps ran 1.47× faster and
    reached the same fp32 block-output error (0.419 against 0.418 of the start's;
    ``benchmarks/roundopt_step.py``); the checks that choose the result always run in fp32.
    """

    steps: int = 64
    lr: float | None = None
    clip_lr: float | None = None
    windows: int = 16
    batch: int = 1
    learn_clip: bool = True
    clip_min: float = 0.5
    target: str = "float"
    checks: int = 2
    threads: int = 0
    compute: str = "auto"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        for name in ("lr", "clip_lr"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.windows < 1 or self.batch < 1:
            raise ValueError(f"windows and batch must be >= 1, got {self.windows}, {self.batch}")
        if self.batch > self.windows:
            raise ValueError(f"batch ({self.batch}) must not exceed windows ({self.windows})")
        if not 0 < self.clip_min <= 1:
            raise ValueError(f"clip_min must be in (0, 1], got {self.clip_min}")
        if self.target not in ("float", "layer"):
            raise ValueError(f"target must be float or layer, got {self.target!r}")
        if self.checks < 1:
            raise ValueError(f"checks must be >= 1, got {self.checks}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.compute not in ("auto", "bf16", "fp32"):
            raise ValueError(f"compute must be auto, bf16 or fp32, got {self.compute!r}")


@dataclass(frozen=True)
class ScaleTuneConfig:
    """End-to-end scale tuning (:func:`lowbit.quantization.algorithms.tune_scales`): after
    the layer-by-layer pass, every quantized weight's scales (codes and zero points fixed)
    are trained together by Adam (step ``lr`` on the log scale factors) for ``epochs``
    passes over the calibration windows but the last ``holdout``, to minimise the KL from
    the float model's next-token distribution to the quantized model's; the epoch with
    the lowest KL on the ``holdout`` windows is kept (the start when none is lower).
    Costs a float copy of the model in memory and, per window and epoch, one float forward
    and one quantized forward and backward."""

    epochs: int = 2
    lr: float = 1e-3
    holdout: int = 8

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        _positive("lr", self.lr)
        if self.holdout < 1:
            raise ValueError(f"holdout must be >= 1 (the windows that choose the epoch kept), got {self.holdout}")


#: the ``algorithms`` keys that name a method, and its config
METHODS = {"rotation": RotationConfig, "smoothquant": SmoothQuantConfig, "awq": AWQConfig, "gptq": GPTQConfig,
           "outliers": OutlierConfig, "round_opt": RoundOptConfig, "tune_scales": ScaleTuneConfig}
