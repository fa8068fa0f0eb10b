"""Models: architecture facts as data (:mod:`.arch`), the packaged models and corpora and
their cache (:mod:`.assets`, :mod:`.corpora`), loading a causal LM from a packaged name, a
folder (plain or compressed-tensors), a GGUF or a hub id (:mod:`.loading`), checks that refuse
damaged or pickle-only inputs before loading (:mod:`.integrity`), and lazily loaded
models whose decoder layers live on disk (:mod:`.offload`).

May import ``util``.
"""

from .arch import arch_of, decoder_layers
from .loading import ModelInfo, load_model

__all__ = ["arch_of", "decoder_layers", "ModelInfo", "load_model"]
