"""Measuring what quantization cost: perplexity, KL and top-1 against a reference with
bootstrap intervals (:mod:`.metrics`), the workbench that holds a model, its windows and its
cached reference and statistics, and ``lowbit compare`` (:mod:`.compare`), per-module
sensitivity and KV statistics (:mod:`.analysis`).

May import ``util``, ``numerics``, ``models``, ``data`` and ``quantization``.
"""
