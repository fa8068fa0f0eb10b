"""Calibration algorithms as pure functions over tensors and statistics.

Each function opens with the paper, section and equation it implements.  None of them
touches a model: :mod:`lowbit.pipeline` gathers the statistics and applies the results.
"""

from .gptq import gptq
from .smoothquant import smooth, smoothquant_scales

__all__ = ["gptq", "smooth", "smoothquant_scales"]
