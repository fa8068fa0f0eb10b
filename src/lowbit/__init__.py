"""lowbit: quantize, measure, plan and ship low-bit LLMs.

The package is laid out by stage of the data flow (``docs/architecture.md``)::

    util → numerics → models → data → quantization → evaluation / checkpoint → planning → report → cli
                        sim (capacity) reads numerics only ─────────────────────────┘

The entry point of each stage is re-exported here; ``lowbit.cli`` only parses arguments and
calls them.
"""

from ._version import __version__
from .numerics.formats import FORMATS, Format
from .numerics.granularity import CHANNEL, HEAD, TENSOR, TOKEN, Granularity, block, group
from .numerics.qtensor import QParams, QTensor, compute_qparams, dequantize, fake_quantize, sqnr
from .numerics.qtensor import quantize as quantize_tensor
from .numerics.scheme import PRESETS, Scheme, bits_per_element, get_scheme
from .quantization.recipe import RECIPES, Recipe, load_recipe
from .quantization.pipeline import quantize
from .evaluation.metrics import evaluate
from .evaluation.compare import Workbench, compare
from .checkpoint.write import export
from . import sim

__all__ = [
    "__version__",
    # numerics
    "FORMATS", "Format",
    "Granularity", "TENSOR", "CHANNEL", "TOKEN", "HEAD", "group", "block",
    "Scheme", "PRESETS", "get_scheme", "bits_per_element",
    "QTensor", "QParams", "quantize_tensor", "dequantize", "fake_quantize", "compute_qparams", "sqnr",
    # stages
    "Recipe", "RECIPES", "load_recipe", "quantize", "evaluate", "Workbench", "compare", "export", "sim",
]
