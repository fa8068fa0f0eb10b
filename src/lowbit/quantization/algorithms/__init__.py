"""Calibration algorithms as pure functions over tensors and statistics.

Each function opens with the paper, section and equation it implements.  None of them
touches a model: :mod:`lowbit.quantization.pipeline` gathers the statistics and applies the results.
"""

from .awq import awq_clip, awq_scales
from .gptq import gptq
from .outliers import fake_quantize_with_outliers, outlier_channels
from .roundopt import LearnedRounding, RoundingResult, optimize_rounding, straight_through
from .rotation import hadamard, random_hadamard, rotate_weight_in, rotate_weight_out
from .scaletune import ScaleTuneResult, kl_to_reference, tune_scales
from .rtn import clip_ratios, mse_qparams
from .smoothquant import smooth, smoothquant_scales

__all__ = [
    "mse_qparams", "clip_ratios",                                   # rtn
    "gptq",                                                         # gptq
    "smoothquant_scales", "smooth",                                 # smoothquant
    "awq_scales", "awq_clip",                                       # awq
    "hadamard", "random_hadamard", "rotate_weight_in", "rotate_weight_out",  # rotation
    "outlier_channels", "fake_quantize_with_outliers",              # outliers
    "optimize_rounding", "LearnedRounding", "RoundingResult", "straight_through",  # roundopt
    "tune_scales", "ScaleTuneResult", "kl_to_reference",            # scaletune
]
