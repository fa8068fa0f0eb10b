"""Export: lowbit's quantized models as checkpoints serving engines load.

``export(model, state, out)`` writes a compressed-tensors Hugging Face folder (vLLM,
SGLang); :mod:`lowbit.export.compressed_tensors` holds every convention conversion;
:mod:`lowbit.export.serve` says how to serve a folder and on which GPUs.
"""

from .write import DEFAULT_DTYPE, ExportResult, SizeReport, export, quantization_config
from .compressed_tensors import UnsupportedScheme, check_recipe, check_shapes

__all__ = ["export", "quantization_config", "ExportResult", "SizeReport", "DEFAULT_DTYPE", "UnsupportedScheme",
           "check_recipe", "check_shapes"]
