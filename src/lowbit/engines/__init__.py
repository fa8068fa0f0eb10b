"""Engines: running real serving engines on lowbit's checkpoints and comparing what they
compute with lowbit's prediction of the same checkpoint.

- :mod:`.support` — which compressed-tensors schemes an engine build runs, read from a
  folder's ``config.json`` before anything is launched (the CPU table is data);
- :mod:`.folder` — the recipe a lowbit folder records, and the :class:`QuantState` that
  re-creates its activation and KV quantization around the stored weights;
- :mod:`.venv` — locating (or telling how to create) the vLLM environment;
- :mod:`.vllm_worker` — a script the vLLM environment's python runs (vLLM, stdlib and
  numpy only: that environment has no lowbit);
- :mod:`.scoring` — PPL, KL and top-1 agreement from top-k log-probabilities;
- :mod:`.bf16` — lowbit's bf16 Linears as fp32 products of bf16 operands (fast on AVX2);
- :mod:`.verify` — ``lowbit verify``: the engine's scores beside lowbit's.

May import evaluation, checkpoint, quantization, models, data, numerics and util; never
report or cli.
"""

from .support import EngineUnsupported, FolderSchemes, folder_schemes, check_supported
from .venv import VllmMissing, find_vllm_python

__all__ = ["EngineUnsupported", "FolderSchemes", "folder_schemes", "check_supported", "VllmMissing",
           "find_vllm_python"]
