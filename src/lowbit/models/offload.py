"""Models larger than memory: decoder layers on disk, in memory one at a time.

:func:`load_lazy` builds a model whose decoder layers have their parameters on the meta
device (no memory), with everything else — embeddings, final norm, lm_head, buffers —
loaded.  A :class:`LayerStore` then moves one layer at a time between disk and memory:

* ``load(i)`` reads layer ``i``'s tensors: its latest copy in the store's work folder if
  it was released before, else the model's own safetensors files;
* ``release(i)`` writes the layer's current tensors to ``<work>/layer-<i>.safetensors``
  (through a temporary file) and puts its parameters back on the meta device;
* ``layer_tensors(i)`` reads them without building the layer (for a streaming export);
* ``release_outside()`` / ``load_outside()`` do the same for everything outside the
  decoder layers (embeddings, final norm, lm_head), which the pipeline needs only
  before the first layer and after the last;
* ``materialize()`` loads everything, for evaluation once the model fits.

The layer-by-layer pipeline (:func:`lowbit.quantization.layerwise.quantize_layerwise` with
``store=``) quantizes such a model holding one decoder layer, its calibration
activations and the non-layer weights in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .arch import arch_of, decoder_layers

__all__ = ["LayerStore", "load_lazy", "is_lazy", "checkpoint_files", "read_tensors"]


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it (single file or sharded)."""
    folder = Path(folder)
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        weight_map = json.loads(idx.read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json; "
                                "layer-by-layer loading reads safetensors checkpoints only")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors, each file opened once."""
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out = {}
    for path, keys in by_file.items():
        with safe_open(str(path), "pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k)
    return out


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``save_file`` through a temporary file in the same folder, renamed when complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    module, _, leaf = name.rpartition(".")
    mod = root.get_submodule(module) if module else root
    mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def is_lazy(model: nn.Module) -> bool:
    """Whether some of ``model``'s parameters are on the meta device (not loaded)."""
    return any(p.is_meta for p in model.parameters())


def load_lazy(folder: Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM from the safetensors folder ``folder`` with its decoder
    layers on the meta device and every other parameter loaded in ``dtype``.

    Raises:
        FileNotFoundError: the folder has no safetensors checkpoint.
        ValueError: a non-layer parameter is not in the checkpoint (named).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    files = checkpoint_files(folder)
    prefix = arch_of(model).layers + "."
    tied = getattr(model.config, "tie_word_embeddings", False)
    wanted = [n for n, _ in model.named_parameters(remove_duplicate=False) if not n.startswith(prefix)]
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    missing = [n for n in wanted if n not in files and not (tied and n == f"{head_name}.weight")]
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {missing[:3]} (names must equal the model's parameter names)")
    for name, t in read_tensors(files, [n for n in wanted if n in files]).items():
        _set_param(model, name, t.to(dtype))
    if tied:
        model.tie_weights()
    return model


class LayerStore:
    """Decoder layers of a lazily loaded model (:func:`load_lazy`) moved between disk and
    memory one at a time.

    Args:
        model: the model; its decoder layers may be on the meta device.
        source: the folder of the model's safetensors checkpoint (read, never written).
        work: where released layers are written; default a new temporary folder, removed
            by :meth:`close` (and on leaving a ``with`` block).

    Attributes:
        peak_loaded: the most decoder layers that were in memory at once.
    """

    def __init__(self, model: nn.Module, source: Path, work: Path | None = None) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        self.prefix = arch_of(model).layers
        self.source = Path(source)
        self._files = checkpoint_files(self.source)
        self._own_work = work is None
        self.work = Path(tempfile.mkdtemp(prefix="lowbit-layers-")) if work is None else Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self._released: set[int] = set()
        self._outside_released = False
        self._aliases: dict[str, str] = {}
        self._closed = False
        self.loaded = {i for i, layer in enumerate(self.layers) if not _on_meta(layer)}
        self.peak_loaded = len(self.loaded)

    def __enter__(self) -> "LayerStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _outside(self) -> tuple[dict[str, nn.Parameter], dict[str, str]]:
        """Parameters outside the decoder layers by name, each shared one once, and the
        other names of shared ones (a tied lm_head) → the name kept."""
        head = self.prefix + "."
        unique: dict[str, nn.Parameter] = {}
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if n.startswith(head):
                continue
            if id(p) in first:
                aliases[n] = first[id(p)]
            else:
                first[id(p)] = n
                unique[n] = p
        return unique, aliases

    def release_outside(self) -> None:
        """Write every parameter outside the decoder layers to the work folder and free it."""
        if self._outside_released:
            return
        unique, self._aliases = self._outside()
        _write(self.work / "outside.safetensors", {n: p.detach().contiguous() for n, p in unique.items()})
        for name, p in unique.items():
            _set_param(self.model, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        self._share_aliases()
        self._outside_released = True

    def load_outside(self) -> None:
        """Bring back what :meth:`release_outside` freed (a no-op if nothing was)."""
        if not self._outside_released:
            return
        if self._closed:
            raise RuntimeError(f"the non-layer weights were released to {self.work}, which this store removed")
        path = self.work / "outside.safetensors"
        unique, _ = self._outside()
        for name, t in read_tensors({n: path for n in unique}, list(unique)).items():
            _set_param(self.model, name, t.to(unique[name].dtype))
        self._share_aliases()
        self._outside_released = False

    def _share_aliases(self) -> None:
        for alias, name in self._aliases.items():
            module, _, leaf = alias.rpartition(".")
            self.model.get_submodule(module)._parameters[leaf] = self.model.get_parameter(name)

    def _names(self, i: int) -> list[str]:
        return [f"{self.prefix}.{i}.{n}" for n, _ in self.layers[i].named_parameters()]

    def _path(self, i: int) -> Path:
        return self.work / f"layer-{i:05d}.safetensors"

    def layer_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors by full name: from memory if loaded, else from disk."""
        if i in self.loaded:
            return {f"{self.prefix}.{i}.{n}": p.detach() for n, p in self.layers[i].named_parameters()}
        names = self._names(i)
        if i in self._released:
            if self._closed:
                raise RuntimeError(f"layer {i} was released to {self.work}, which this store removed when it closed")
            return read_tensors({n: self._path(i) for n in names}, names)
        missing = [n for n in names if n not in self._files]
        if missing:
            raise ValueError(f"{self.source}: the checkpoint lacks {missing[:3]} "
                           "(names must equal the model's parameter names)")
        return read_tensors(self._files, names)

    def load(self, i: int) -> nn.Module:
        """Bring decoder layer ``i`` into memory (a no-op if it is there)."""
        if i not in self.loaded:
            layer = self.layers[i]
            params = dict(layer.named_parameters())
            for name, t in self.layer_tensors(i).items():
                local = name[len(f"{self.prefix}.{i}."):]
                _set_param(layer, local, t.to(params[local].dtype))
            self.loaded.add(i)
            self.peak_loaded = max(self.peak_loaded, len(self.loaded))
        return self.layers[i]

    def release(self, i: int) -> None:
        """Write decoder layer ``i``'s current tensors to the work folder and free them."""
        if i not in self.loaded:
            return
        layer = self.layers[i]
        _write(self._path(i), {f"{self.prefix}.{i}.{n}": p.detach().contiguous() for n, p in layer.named_parameters()})
        for name, p in list(layer.named_parameters()):
            _set_param(layer, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        self._released.add(i)
        self.loaded.discard(i)

    def materialize(self) -> nn.Module:
        """Load everything; the model is then an ordinary in-memory model."""
        self.load_outside()
        for i in range(len(self.layers)):
            self.load(i)
        return self.model

    def close(self) -> None:
        """Remove the work folder if this store created it.  Loaded layers stay loaded;
        released ones are gone (materialize or export before closing)."""
        self._closed = True
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)
