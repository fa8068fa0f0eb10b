"""Small helpers shared by the peer workers (``_llmc_worker.py``, ``_autoround_worker.py``,
``_gptqmodel_worker.py``), which run in the peers' own virtual environments: standard library
only (and torch, which every peer has), nothing from lowbit."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")


def peak_rss_mib() -> float:
    """This process's peak resident set size (VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def copy_tokenizer_files(model_dir: Path, out: Path) -> None:
    """Copy the tokenizer files a peer's save did not write, so that ``out`` loads on its own."""
    for f in Path(model_dir).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES):
            if not (out / f.name).exists():
                shutil.copy(f, out / f.name)


def parse_config(config: str, schemes: dict, variants: dict, tool: str) -> tuple[dict, str, dict]:
    """``SCHEME[:VARIANT]`` → (scheme arguments, variant name, variant arguments); exits naming
    the choices when either part is unknown."""
    scheme, _, variant = config.partition(":")
    variant = variant or "default"
    if scheme not in schemes:
        raise SystemExit(f"unknown scheme {scheme!r}; choose from {', '.join(schemes)}")
    if variant not in variants:
        raise SystemExit(f"unknown {tool} variant {variant!r}; choose from {', '.join(variants)}")
    return dict(schemes[scheme]), variant, dict(variants[variant])


def max_group_levels(w, group_size: int, g_idx=None) -> int:
    """The most distinct values any group of one row of the 2-D weight ``w`` holds: at most ``2**bits``
    for weights that really are on a ``bits``-bit grid, up to ``group_size`` for float weights. Groups are
    ``group_size`` consecutive columns (a ragged last group counts its own columns) or, when ``g_idx`` (one
    group index per input column, as GPTQ checkpoints quantized in activation order store it) is given, the
    columns that share an index."""
    import torch

    if g_idx is None:
        blocks = [w[:, c0:c0 + group_size] for c0 in range(0, w.shape[1], group_size)]
    else:
        g_idx = torch.as_tensor(g_idx).reshape(-1)
        if g_idx.numel() != w.shape[1]:
            raise ValueError(f"g_idx has {g_idx.numel()} entries for {w.shape[1]} columns")
        blocks = [w[:, g_idx == g] for g in torch.unique(g_idx)]
    worst = 0
    for block in blocks:
        g = torch.sort(block.float(), dim=1).values
        levels = 1 + (g[:, 1:] != g[:, :-1]).sum(dim=1)
        worst = max(worst, int(levels.max()))
    return worst
