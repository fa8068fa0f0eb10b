"""Writing a quantized model as a compressed-tensors Hugging Face folder.

``export(model, state, out)`` writes ``model.safetensors``, ``config.json`` with its
``quantization_config``, the generation config, the tokenizer and a model card, through a
temporary folder renamed when complete.  The tensors come from
:mod:`lowbit.checkpoint.compressed_tensors`; this module only lays out the folder.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .._version import __version__
from ..util.io import atomic_dir, write_safetensors
from ..models.arch import arch_of, checkpoint_name, decoder_layers
from ..quantization.targets import sibling_groups
from ..quantization.runtime import QuantState
from ..numerics.scheme import Scheme, bits_per_element
from .compressed_tensors import (check_recipe, check_shapes, ct_format, input_tensors, kv_args, scheme_args,
                                 weight_tensors)

__all__ = ["SizeReport", "ExportResult", "quantization_config", "checkpoint_tensors", "export", "plan_of",
           "DEFAULT_DTYPE"]

log = logging.getLogger(__name__)

#: checkpoints are written in the dtype vLLM serves by default
DEFAULT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class SizeReport:
    """Bytes on disk: the whole folder's tensors, the quantized Linears' tensors (codes,
    scales, zero points, global scales) and what ``bits_per_element`` predicted for them."""

    file_bytes: int
    quantized_bytes: int
    predicted_bytes: int
    other_bytes: int

    @property
    def ratio(self) -> float:
        """Measured / predicted bytes of the quantized Linears (1.0 when nothing is quantized)."""
        return self.quantized_bytes / self.predicted_bytes if self.predicted_bytes else 1.0


@dataclass(frozen=True)
class ExportResult:
    path: Path
    recipe: str
    formats: tuple[str, ...]
    sizes: SizeReport
    eval: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def plan_of(state: QuantState) -> dict[str, tuple[Scheme | None, Scheme | None]]:
    """Weight and input scheme of every quantized Linear in ``state``."""
    names = set(state.weight_schemes) | set(state.activations)
    return {n: (state.weight_schemes.get(n), state.activations[n].scheme if n in state.activations else None)
            for n in sorted(names)}


def _linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _routers(model: nn.Module) -> list[str]:
    """The MoE routers of ``model`` (not Linears in transformers 5; always high precision)."""
    arch = arch_of(model)
    if arch.experts is None:
        return []
    modules = dict(model.named_modules())
    names = (f"{arch.layers}.{i}.{arch.experts.router}" for i in range(len(decoder_layers(model))))
    return [n for n in names if n in modules and not isinstance(modules[n], nn.Linear)]


def quantization_config(model: nn.Module, state: QuantState) -> dict:
    """The ``quantization_config`` of ``config.json``: one config group per distinct
    (format, weight args, input args); Linears left in high precision and MoE routers go to
    ``ignore``.  Names are the checkpoint's (:func:`lowbit.models.arch.checkpoint_name`)."""
    arch = arch_of(model)
    plan = plan_of(state)
    groups: dict[str, dict] = {}
    members: dict[str, list[str]] = {}
    for name, (w, i) in plan.items():
        fmt = ct_format(w, i)
        g = {"format": fmt, "weights": scheme_args(w, "weights"),
             "input_activations": scheme_args(i, "inputs") if i is not None else None}
        key = json.dumps(g, sort_keys=True)
        groups.setdefault(key, g)
        members.setdefault(key, []).append(checkpoint_name(arch, name))
    linears = list(_linear_shapes(model))
    ignore = [checkpoint_name(arch, n) for n in linears + _routers(model) if n not in plan]
    config_groups = {}
    for k, (key, g) in enumerate(groups.items()):
        targets = ["Linear"] if len(groups) == 1 else members[key]
        config_groups[f"group_{k}"] = {"targets": targets, **g}
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense"),
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": kv_args(state.kv.config) if state.kv is not None else None,
    }


def checkpoint_tensors(model: nn.Module, state: QuantState, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of the checkpoint by full name, and the bytes of the quantized Linears'.

    Quantized Linears get their compressed-tensors tensors; everything else is written in
    ``dtype``; a tensor tied to an earlier one (lm_head to the embeddings) is written once.
    MoE experts are written per expert, under the names the architecture's checkpoints use
    (``…mlp.experts.<e>.down_proj.weight_packed``; Mixtral ``…block_sparse_moe.experts.<e>.w2…``),
    the layout vLLM's fused-MoE loader reads.
    """
    return part_tensors(model.state_dict().items(), model, state, dtype, set())


def part_tensors(named, model: nn.Module, state: QuantState, dtype: torch.dtype,
                 seen: set[int]) -> tuple[dict[str, torch.Tensor], int]:
    """:func:`checkpoint_tensors` for the tensors ``named`` (``(full name, tensor)`` pairs,
    e.g. one decoder layer's): the Linears among them that ``state`` quantized, their
    input scales, and the KV scales of the attention modules among them.  ``seen`` holds
    the storage of tensors already written by earlier parts (ties are written once)."""
    named = list(named)
    plan = plan_of(state)
    modules = {name.rpartition(".")[0] for name, _ in named}
    local_plan = {n: v for n, v in plan.items() if n in modules}
    missing = [n for n, (w, _) in local_plan.items() if w is not None and n not in state.weights]
    if missing:
        raise ValueError(f"export needs the QTensor of every quantized weight (quantize with keep_qtensors=True); "
                         f"missing {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name, t in named:
        module, _, leaf = name.rpartition(".")
        if module in local_plan and leaf == "weight":
            continue
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(dtype).contiguous()
    quantized = 0
    for name, (w, i) in local_plan.items():
        local = weight_tensors(state.weights[name], ct_format(w, i), dtype)
        if name in state.activations:
            local.update(input_tensors(state.activations[name]))
        for leaf, t in local.items():
            out[f"{name}.{leaf}"] = t.contiguous()
            if leaf != "weight_shape" and not leaf.startswith("input_"):
                quantized += t.numel() * t.element_size()
    if state.kv is not None:
        arch, kv = arch_of(model), state.kv
        for layer in sorted(kv.k_amax):
            prefix = f"{arch.layers}.{layer}.{arch.attn}"
            if prefix not in modules and not any(m.startswith(prefix + ".") for m in modules):
                continue
            for leaf, amax, s in (("k_scale", kv.k_amax[layer], kv.config.scheme),
                                  ("v_scale", kv.v_amax[layer], kv.config.v_scheme)):
                a = amax.float().reshape(1, 1)
                out[f"{prefix}.{leaf}"] = s.scales_from_range(-a, a)[0].reshape(1).contiguous()
    arch = arch_of(model)
    if arch.experts is not None and arch.experts.checkpoint is not None:
        out = {checkpoint_name(arch, k): v for k, v in out.items()}
    return out, quantized


def write_metadata(folder: Path, model: nn.Module, qc: dict, *, dtype: torch.dtype, tokenizer=None,
                   source: Path | None = None) -> None:
    """``config.json`` with ``qc`` as its ``quantization_config``, the generation config (the
    source folder's, else the model's) and the tokenizer, into ``folder``."""
    cfg = model.config.to_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = qc
    if not cfg.get("architectures"):  # a model built from a config has none; engines pick their class by it
        cfg["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = Path(source) / "generation_config.json" if source else None
    if gen is not None and gen.exists():
        (folder / "generation_config.json").write_text(gen.read_text())
    elif getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _predicted_bytes(model: nn.Module, state: QuantState) -> int:
    shapes = _linear_shapes(model)
    return round(sum(math.prod(shapes[n]) * bits_per_element(s, shapes[n]) / 8
                     for n, s in state.weight_schemes.items()))


def _card(model_name: str, recipe_name: str, recipe_text: str, qc: dict, sizes: SizeReport, ev: dict | None) -> str:
    lines = [
        f"# {model_name} — quantized with lowbit {__version__}",
        "",
        f"Recipe: `{recipe_name}` — `{recipe_text}`",
        "",
        f"Format: compressed-tensors `{qc['format']}` (config groups: {len(qc['config_groups'])}; "
        f"KV-cache scales: {'yes' if qc['kv_cache_scheme'] else 'no'}). Serve with `lowbit serve-command <this folder>`.",
        "",
        f"Size on disk: {sizes.file_bytes / 2**20:.2f} MiB; quantized Linears {sizes.quantized_bytes / 2**20:.2f} MiB "
        f"(bits_per_element predicted {sizes.predicted_bytes / 2**20:.2f} MiB).",
        "",
    ]
    if ev:
        ref = ev.get("reference", {})
        q = ev.get("checkpoint", {})
        lines += [
            "## Evaluation (this checkpoint against the unquantized model)",
            "",
            "Every weight was read back from this folder through compressed-tensors' decompressors; activation "
            "and KV quantization ran in lowbit's runtime with the scales stored here.",
            "",
            f"Corpus {ev.get('corpus')}, {q.get('windows')} windows, {q.get('tokens')} tokens.",
            "",
            "| | perplexity | Δ ppl % | KL mean | top-1 agreement |",
            "|---|---|---|---|---|",
            f"| unquantized | {ref.get('ppl', float('nan')):.4f} | | | |",
            f"| this checkpoint | {q.get('ppl', float('nan')):.4f} | {q.get('delta_pct') or 0:+.2f} | "
            f"{q.get('kl_mean') or 0:.5f} | {q.get('top1') or 0:.4f} |",
            "",
        ]
    return "\n".join(lines)


def export(
    model: nn.Module,
    state: QuantState,
    out: Path,
    *,
    tokenizer=None,
    source: Path | None = None,
    dtype: torch.dtype = DEFAULT_DTYPE,
    force: bool = False,
    model_name: str = "model",
    evaluate: Callable[[Path], dict] | None = None,
) -> ExportResult:
    """Write ``model`` (quantized by ``pipeline.quantize(..., keep_qtensors=True)``) to ``out``.

    Args:
        model: the quantized model (its unquantized tensors are written in ``dtype``).
        state: what quantization did; its QTensors become the compressed tensors.
        out: the folder to create; refused if it exists unless ``force``.
        tokenizer: saved into the folder when given.
        source: the original model folder; its ``generation_config.json`` is copied.
        dtype: dtype of unquantized tensors (and of scales lowbit rounded to it).
        force: replace an existing ``out``.
        model_name: for the model card.
        evaluate: called with the finished temporary folder before it is renamed into
            place; its result (a dict) goes into the model card and the result.

    Returns:
        :class:`ExportResult` with the sizes on disk.

    Raises:
        UnsupportedScheme: the recipe or a shape cannot be represented (before writing).
        FileExistsError: ``out`` exists and ``force`` is false.
    """
    check_recipe(state.recipe)
    plan = plan_of(state)
    shapes = _linear_shapes(model)
    check_shapes(shapes, plan, sibling_groups(model))
    out = Path(out)
    with atomic_dir(out, force=force) as tmp:
        qc = quantization_config(model, state)
        tensors, quantized = checkpoint_tensors(model, state, dtype)
        write_safetensors(str(tmp / "model.safetensors"), tensors, metadata={"format": "pt"})
        write_metadata(tmp, model, qc, dtype=dtype, tokenizer=tokenizer, source=source)
        file_bytes = (tmp / "model.safetensors").stat().st_size
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        sizes = SizeReport(file_bytes, quantized, _predicted_bytes(model, state), total - quantized)
        ev = evaluate(tmp) if evaluate is not None else None
        (tmp / "README.md").write_text(_card(model_name, state.recipe.name, state.recipe.summary(), qc, sizes, ev))
    log.info("wrote %s (%s, %.2f MiB)", out, qc["format"], sizes.file_bytes / 2**20)
    return ExportResult(out, state.recipe.name, tuple(g["format"] for g in qc["config_groups"].values()), sizes, ev)
