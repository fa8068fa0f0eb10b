"""Numbers: element formats defined by their value tables (:mod:`.formats`), which elements
share a scale (:mod:`.granularity`), how one tensor is quantized (:mod:`.scheme`), the one
numeric path (:mod:`.qtensor`: quantize, dequantize, fake-quantize), bit packing (:mod:`.pack`)
and the format facts behind ``lowbit formats`` (:mod:`.lessons`).

May import ``util`` only.  Knows nothing of models.
"""

from .formats import FORMATS, Format
from .granularity import CHANNEL, HEAD, TENSOR, TOKEN, Granularity, block, group
from .qtensor import QParams, QTensor, compute_qparams, dequantize, fake_quantize, quantize, sqnr
from .scheme import PRESETS, Scheme, bits_per_element, get_scheme

__all__ = ["FORMATS", "Format", "Granularity", "TENSOR", "CHANNEL", "TOKEN", "HEAD", "group", "block",
           "QParams", "QTensor", "compute_qparams", "dequantize", "fake_quantize", "quantize", "sqnr",
           "PRESETS", "Scheme", "bits_per_element", "get_scheme"]
