"""Quantization of a model: recipes (:mod:`.recipe`, typed method settings in :mod:`.methods`),
the one entry point :func:`~.pipeline.quantize` that chooses plain rounding (:mod:`.rounding`)
or the layer-by-layer pass (:mod:`.layerwise`, :mod:`.layerpass`, :mod:`.inputstats`), what each
Linear gets (:mod:`.targets`), calibration statistics (:mod:`.calibrate`), activation and KV
quantization at run time (:mod:`.runtime`, :mod:`.kv`), function-preserving transforms
(:mod:`.transforms`) and the calibration algorithms as pure functions (:mod:`.algorithms`).

May import ``util``, ``numerics``, ``models`` and ``data``.
"""
