"""Data: documents → token windows, exactly as the evaluation protocol says (:mod:`.windows`):
the test/train split, evaluation windows, seeded calibration windows, cached token streams.

The calibration set is built here and handed to whoever needs it (quantization, workflows).
May import ``util`` and ``models`` (the corpus cache).
"""
