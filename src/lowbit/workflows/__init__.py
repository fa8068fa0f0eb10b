"""End-to-end jobs that join stages: load → calibrate → quantize → write → evaluate.

Owns nothing numeric: each job hands data from one stage's entry point to the next
(``models.load_model``, ``data`` windows, ``quantization.quantize``, ``checkpoint.export``,
``evaluation.evaluate``).  May import every stage below it; the CLI and ``lowbit`` import it.
"""

from .ship import ShipOptions, quantize_streaming, quantize_to_folder

__all__ = ["ShipOptions", "quantize_to_folder", "quantize_streaming"]
