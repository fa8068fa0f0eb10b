"""Writing a compressed-tensors folder while the model is quantized, one decoder layer at a
time: the export of models that do not fit in memory.

:class:`LayerwiseExport` is handed to the pipeline as ``on_layer``: when a decoder layer is
quantized (and before it is released to disk), its tensors — compressed weights, input
scales, KV scales, norms — go into a shard of their own and its QTensors are dropped, so
that neither the float nor the quantized model is ever whole in memory.  ``finish``
writes the rest (embeddings, final norm, lm_head), the shard index, ``config.json`` and the
model card, and renames the temporary folder into place::

    with LayerStore(model, folder) as store, LayerwiseExport(out, model, recipe) as ex:
        state = quantize(model, recipe, calibration=windows, keep_qtensors=True, store=store, on_layer=ex.layer_done)
        ex.finish(state, store=store, tokenizer=tok, source=folder)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from ..util.io import atomic_dir, write_safetensors
from ..models.arch import arch_of, decoder_layers
from ..models.offload import LayerStore
from ..quantization.targets import sibling_groups
from ..quantization.recipe import Recipe
from ..quantization.runtime import QuantState
from .write import (DEFAULT_DTYPE, ExportResult, SizeReport, _card, _linear_shapes, _predicted_bytes, part_tensors,
                         quantization_config, write_metadata)
from .compressed_tensors import check_recipe, check_shapes

__all__ = ["LayerwiseExport"]

log = logging.getLogger(__name__)


class LayerwiseExport:
    """A compressed-tensors folder written layer by layer (see the module docstring).

    Args:
        out: the folder to create; refused if it exists unless ``force``.
        model: the model being quantized (its decoder layers may be on the meta device).
        recipe: the recipe, checked for what compressed-tensors can hold before any work.
        dtype: dtype of unquantized tensors.
        force: replace an existing ``out``.
    """

    def __init__(self, out: Path, model: nn.Module, recipe: Recipe, *, dtype: torch.dtype = DEFAULT_DTYPE,
                 force: bool = False) -> None:
        check_recipe(recipe)
        shapes = _linear_shapes(model)
        check_shapes(shapes, recipe.resolve(list(shapes)), sibling_groups(model))
        self.out, self.model, self.dtype = Path(out), model, dtype
        self._ctx = atomic_dir(self.out, force=force)
        self._tmp: Path | None = None
        self._weight_map: dict[str, str] = {}
        self._seen: set[int] = set()
        self._bytes = self._quantized = 0
        self._n = len(decoder_layers(model)) + 1  # a shard per layer, one for the rest
        self._done = False

    def __enter__(self) -> "LayerwiseExport":
        self._tmp = self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        if exc[0] is None and not self._done:
            exc = (RuntimeError, RuntimeError("LayerwiseExport left without finish(): nothing written"), None)
            self._ctx.__exit__(*exc)
            raise exc[1]
        return self._ctx.__exit__(*exc)

    def _shard_name(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{self._n:05d}.safetensors"

    def _write(self, k: int, tensors: dict[str, torch.Tensor], quantized: int) -> None:
        name = self._shard_name(k)
        write_safetensors(str(self._tmp / name), tensors, metadata={"format": "pt"})
        self._weight_map.update({t: name for t in tensors})
        self._bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self._quantized += quantized

    def layer_done(self, i: int, state: QuantState) -> None:
        """Write decoder layer ``i`` (in memory, quantized) and drop its QTensors from ``state``."""
        if self._tmp is None:
            raise RuntimeError("LayerwiseExport is used as a context manager")
        prefix = f"{arch_of(self.model).layers}.{i}."
        layer = decoder_layers(self.model)[i]
        named = [(prefix + n, t) for n, t in layer.state_dict().items()]
        tensors, quantized = part_tensors(named, self.model, state, self.dtype, self._seen)
        self._write(i + 1, tensors, quantized)
        for n in [n for n in state.weights if n.startswith(prefix)]:
            del state.weights[n]

    def finish(self, state: QuantState, *, store: LayerStore | None = None, tokenizer=None, source: Path | None = None,
               model_name: str = "model") -> ExportResult:
        """Write everything outside the decoder layers, the index, the config and the card.
        Every decoder layer must have been written.  The folder replaces ``out`` when the
        ``with`` block ends."""
        arch = arch_of(self.model)
        written = {int(n[len(arch.layers) + 1:].split(".", 1)[0]) for n in self._weight_map}
        missing = sorted(set(range(self._n - 1)) - written)
        if missing:
            raise RuntimeError(f"decoder layers {missing[:5]} were never written (pass layer_done as on_layer)")
        if store is not None:
            store.load_outside()
        head = arch.layers + "."
        named = [(n, t) for n, t in self.model.state_dict().items() if not n.startswith(head)]
        tensors, quantized = part_tensors(named, self.model, state, self.dtype, self._seen)
        self._write(0, tensors, quantized)
        index = {"metadata": {"total_size": self._bytes}, "weight_map": dict(sorted(self._weight_map.items()))}
        (self._tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        qc = quantization_config(self.model, state)
        write_metadata(self._tmp, self.model, qc, dtype=self.dtype, tokenizer=tokenizer, source=source)
        file_bytes = sum(f.stat().st_size for f in self._tmp.glob("*.safetensors"))
        sizes = SizeReport(file_bytes, self._quantized, _predicted_bytes(self.model, state), self._bytes - self._quantized)
        (self._tmp / "README.md").write_text(_card(model_name, state.recipe.name, state.recipe.summary(), qc, sizes, None))
        self._done = True
        log.info("wrote %s layer by layer (%s, %.2f MiB in %d shards)", self.out, qc["format"], file_bytes / 2**20, self._n)
        return ExportResult(self.out, state.recipe.name, tuple(g["format"] for g in qc["config_groups"].values()), sizes)
