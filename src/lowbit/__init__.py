"""lowbit: quantize, measure, plan and ship low-bit LLMs."""

from .formats import FORMATS, Format
from .granularity import CHANNEL, HEAD, TENSOR, TOKEN, Granularity, block, group
from .qtensor import QParams, QTensor, compute_qparams, dequantize, fake_quantize, quantize, sqnr
from .scheme import PRESETS, Scheme, bits_per_element, get_scheme

__version__ = "0.1.0"

__all__ = [
    "FORMATS", "Format",
    "Granularity", "TENSOR", "CHANNEL", "TOKEN", "HEAD", "group", "block",
    "Scheme", "PRESETS", "get_scheme", "bits_per_element",
    "QTensor", "QParams", "quantize", "dequantize", "fake_quantize", "compute_qparams", "sqnr",
    "__version__",
]
