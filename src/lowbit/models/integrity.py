"""Checks of a model folder before anything loads it: damaged or unsafe inputs are refused
with one clear ``ValueError`` instead of a loader's traceback.

- A folder whose only weights are pickle checkpoints (``pytorch_model.bin``, ``*.pt``, ...)
  is refused: unpickling can run code, and lowbit never unpickles (transformers would).
- Every ``*.safetensors`` file must be complete: its header parses and covers the file
  (a truncated download or copy fails here).
- The tensor shapes must be those ``config.json`` describes (an edited or mismatched config
  fails here, naming the first tensor that differs).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PICKLE_SUFFIXES", "check_model_folder", "check_gguf"]

#: weight files that are Python pickles
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_model_folder(folder: Path, config) -> None:
    """Raise ``ValueError`` naming the file if ``folder``'s weights are pickles only, a
    safetensors file is truncated or damaged, or a tensor's shape differs from ``config``'s."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(f"{folder}: only pickle checkpoints ({', '.join(pickles)}); lowbit does not unpickle "
                             "files (that can run code). Convert the weights to safetensors first")
        return
    shapes = {}
    for f in files:
        shapes.update(_header_shapes(f))
    _check_shapes(folder, config, shapes)


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a complete safetensors file (truncated or damaged: {e})") from None


def _check_shapes(folder: Path, config, shapes: dict[str, tuple[int, ...]]) -> None:
    """Compare with a model built from ``config`` on the meta device (no memory, no weights)."""
    if getattr(config, "quantization_config", None) is not None:
        return  # packed tensors have their own shapes; the compressed-tensors loader checks them
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder}/config.json: cannot build a model from it ({e})") from None
    for name, t in model.state_dict().items():
        got = shapes.get(name)
        if got is not None and got != tuple(t.shape):
            raise ValueError(f"{folder}: tensor {name} has shape {list(got)} but config.json implies "
                             f"{list(t.shape)}; the config does not describe these weights")


def check_gguf(path: Path) -> None:
    """Raise ``ValueError`` if ``path`` is not a complete GGUF file: its header, metadata and
    tensor table must parse and every tensor's data must lie inside the file."""
    import gguf

    path = Path(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001 — a damaged file fails anywhere inside the reader (numpy, struct)
        raise ValueError(f"{path}: not a complete GGUF file (truncated or damaged: {e})") from None
    if not reader.tensors:
        raise ValueError(f"{path}: a GGUF file without tensors")
    if end > size:
        raise ValueError(f"{path}: truncated GGUF file: its tensors need {end} bytes, the file has {size}")
