"""Calibration statistics: what static scales are computed from.

One pass over the calibration windows records, with hooks that are always removed:
the absmax of every input channel of every Linear, the absmax per KV head of the
keys (after RoPE) and values written to the cache, and the keys' per-channel sum, minimum
and maximum (:class:`lowbit.quantization.kv.KeyMoments`).  Statistics are saved with
safetensors so that a model and data pair is calibrated once.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..models.experts import unfuse_experts
from .kv import KeyMoments, KVObserver, cache_kwarg, make_cache
from .runtime import input_device
from ..util.io import load_tensors, save_tensors
from ..util.parallel import map_shards

__all__ = ["CalibStats", "collect_stats", "record_input_absmax", "STATS_FORMAT"]

#: enters the calibration cache key: bump when :class:`CalibStats` gains a statistic, so that
#: files without it are not read back
STATS_FORMAT = 2

log = logging.getLogger(__name__)


@dataclass
class CalibStats:
    """Per-Linear input channel absmax ``(in_features,)``, per-layer K and V absmax
    ``(kv_heads,)``, per-layer key moments, and how many tokens they were taken from."""

    input_absmax: dict[str, torch.Tensor] = field(default_factory=dict)
    k_absmax: dict[int, torch.Tensor] = field(default_factory=dict)
    v_absmax: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    k_moments: dict[int, KeyMoments] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        """Atomically, with a checksum (:func:`lowbit.util.io.save_tensors`)."""
        t = {f"in/{k}": v for k, v in self.input_absmax.items()}
        t |= {f"k/{i}": v for i, v in self.k_absmax.items()}
        t |= {f"v/{i}": v for i, v in self.v_absmax.items()}
        for i, m in self.k_moments.items():
            t |= {f"ksum/{i}": m.sum, f"kmin/{i}": m.min, f"kmax/{i}": m.max,
                  f"kcount/{i}": torch.tensor([m.count], dtype=torch.int64)}
        save_tensors(path, t, metadata={"tokens": str(self.tokens)})

    @classmethod
    def load(cls, path: Path) -> "CalibStats":
        """Raises :class:`lowbit.util.io.CorruptFile` for a truncated or corrupted file."""
        t, metadata = load_tensors(path)
        tokens = int(metadata.get("tokens", 0))
        s = cls(tokens=tokens)
        for k, v in t.items():
            kind, _, name = k.partition("/")
            if kind == "in":
                s.input_absmax[name] = v
            elif kind == "k":
                s.k_absmax[int(name)] = v
            elif kind == "v":
                s.v_absmax[int(name)] = v
        for i in {int(k.partition("/")[2]) for k in t if k.startswith("ksum/")}:
            s.k_moments[i] = KeyMoments(t[f"ksum/{i}"], t[f"kmin/{i}"], t[f"kmax/{i}"], int(t[f"kcount/{i}"][0]))
        return s


@contextmanager
def record_input_absmax(model: nn.Module, names: list[str], into: dict[str, torch.Tensor]) -> Iterator[None]:
    """While the block runs, keep the running absmax of each input channel of the named
    Linears in ``into``."""
    modules = dict(model.named_modules())
    handles = []
    last: list = [None, None]  # (input, its channel absmax): q/k/v and gate/up read one tensor

    def hook_for(name: str):
        def hook(module, args):
            x = args[0]
            if x.numel() == 0:  # an expert no token was routed to
                return
            if last[0] is not x:
                x2 = x.detach().reshape(-1, x.shape[-1])
                last[0], last[1] = x, torch.maximum(x2.amax(0), -x2.amin(0)).float()  # (aminmax is ~10× slower)
            a = last[1]
            # a copy at first: Linears reading one input must not share one tensor (safetensors refuses to save that)
            into[name] = torch.maximum(into[name], a) if name in into else a.clone()

        return hook

    try:
        for n in names:
            handles.append(modules[n].register_forward_pre_hook(hook_for(n)))
        yield
    finally:
        last.clear()
        for h in handles:
            h.remove()


def collect_stats(model: nn.Module, windows: torch.Tensor, *, progress: bool = True,
                  workers: int | None = None, batch: int | None = None) -> CalibStats:
    """Run ``model`` over ``windows`` ``(n, seq)`` and record input and K/V absmax
    (every Linear but ``lm_head``, whose input a static scheme then cannot use).
    ``workers``: processes that share the windows (:func:`lowbit.util.parallel.map_shards`);
    their maxima are merged.  Fused MoE experts are first replaced by per-expert Linears
    (:func:`lowbit.models.experts.unfuse_experts`, the same function), so that each expert's
    input has its own statistics.  ``batch``: windows per forward, in this process (the GPU
    path; maxima do not depend on it).  The statistics are returned on the CPU."""
    unfuse_experts(model)  # outside inference mode: the new Linears' weights are changed in place later
    return _collect(model, windows, progress, workers, batch)


@torch.inference_mode()
def _collect(model: nn.Module, windows: torch.Tensor, progress: bool, workers: int | None,
             batch: int | None = None) -> CalibStats:
    # the decoder alone: statistics need no logits, and lm_head (never quantized by
    # default) is a fifth of a small model's work
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    kw = cache_kwarg(body)
    if batch is not None and int(batch) < 1:
        raise ValueError(f"batch must be >= 1 windows, got {batch}")
    per = 1 if batch is None else int(batch)
    workers = workers if batch is None else 1
    dev = input_device(model)

    def shard(idx, tick) -> CalibStats:
        stats = CalibStats()
        obs = KVObserver()
        idx = list(idx)
        with record_input_absmax(model, names, stats.input_absmax):
            for s in range(0, len(idx), per):
                ids = windows[idx[s] : idx[min(s + per, len(idx)) - 1] + 1]
                body(input_ids=ids if dev is None else ids.to(dev), use_cache=True,
                     **{kw: make_cache(model.config, obs.on_write)})
                stats.tokens += ids.numel()
                for _ in range(len(ids)):
                    tick()
        stats.input_absmax = {k: v.cpu() for k, v in stats.input_absmax.items()}
        stats.k_absmax = {k: v.cpu() for k, v in obs.k_absmax.items()}
        stats.v_absmax = {k: v.cpu() for k, v in obs.v_absmax.items()}
        stats.k_moments = {k: KeyMoments(m.sum.cpu(), m.min.cpu(), m.max.cpu(), m.count)
                           for k, m in obs.k_moments.items()}
        return stats

    parts = map_shards(shard, len(windows), workers=workers, description="calibrating", progress=progress)
    stats = CalibStats(tokens=sum(p.tokens for p in parts))
    for p in parts:
        for mine, theirs in ((stats.input_absmax, p.input_absmax), (stats.k_absmax, p.k_absmax),
                             (stats.v_absmax, p.v_absmax)):
            for key, v in theirs.items():
                mine[key] = torch.maximum(mine[key], v) if key in mine else v
        for key, m in p.k_moments.items():
            stats.k_moments[key] = stats.k_moments[key].merge(m) if key in stats.k_moments else m
    log.info("calibrated on %d tokens", stats.tokens)
    return stats
