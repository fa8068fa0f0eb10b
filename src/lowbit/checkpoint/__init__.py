"""Checkpoints serving engines load: ``export(model, state, out)`` writes a quantized model as a
compressed-tensors Hugging Face folder (vLLM, SGLang) (:mod:`.write`; layer by layer:
:mod:`.stream`); :mod:`.compressed_tensors` holds every convention conversion;
:mod:`.serve` says how to serve a folder and on which GPUs.

Packs what exists: may import ``util``, ``numerics``, ``models`` and ``quantization`` (the
quantized state), never ``evaluation``.
"""

from .write import DEFAULT_DTYPE, ExportResult, SizeReport, export, quantization_config
from .compressed_tensors import UnsupportedScheme, check_recipe, check_shapes

__all__ = ["export", "quantization_config", "ExportResult", "SizeReport", "DEFAULT_DTYPE", "UnsupportedScheme",
           "check_recipe", "check_shapes"]
