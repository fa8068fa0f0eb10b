"""``--device``, ``--dtype`` and ``--batch``: the options of every command that runs a model,
parsed once (:mod:`lowbit.util.device` checks them)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

__all__ = ["add_device_options", "device_settings", "bench_placement"]

log = logging.getLogger(__name__)


def add_device_options(p: argparse.ArgumentParser, *, dtype: bool = True, batch: bool = True) -> None:
    from ..util.device import DTYPES
    from . import _positive_int

    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:N or auto (a GPU when there is one; a model larger than the GPU is "
                        "then spread by accelerate's device map, for evaluation) (default cpu)")
    if dtype:
        p.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                       help="float type the model is loaded and run in (default fp32)")
    if batch:
        p.add_argument("--batch", type=_positive_int, default=None,
                       help="windows per forward, in this process (default: from free memory on a GPU; on the "
                            "CPU one window per forward in forked workers, see --workers)")


def device_settings(args: argparse.Namespace):
    """``(device, dtype)`` from the options, checked (an absent GPU is refused here)."""
    from ..util.device import parse_dtype, resolve_device

    return resolve_device(getattr(args, "device", "cpu")), parse_dtype(getattr(args, "dtype", "fp32") or "fp32")


def bench_placement(args: argparse.Namespace, model: str) -> dict:
    """Keyword arguments of :meth:`lowbit.evaluation.Workbench.load` for the options:
    device, dtype, batch and — with ``--device auto`` on a GPU the model does not fit —
    accelerate's ``device_map="auto"``."""
    from ..util.device import free_bytes

    device, dtype = device_settings(args)
    out = {"device": device, "dtype": dtype, "batch": getattr(args, "batch", None)}
    if str(getattr(args, "device", "cpu")).strip().lower() == "auto" and device.type == "cuda":
        from ..models.loading import needs_device_map

        folder = _folder_of(model, getattr(args, "cache", None))
        if folder is not None and needs_device_map(folder, device, dtype, free_bytes(device)):
            log.info("%s does not fit on %s: spread over the GPUs and CPU memory by accelerate's device map",
                     model, device)
            out["device_map"] = "auto"
    return out


def _folder_of(model: str, cache) -> Path | None:
    from ..models.assets import MODEL_ASSETS, fetch

    if model in MODEL_ASSETS:
        return fetch(model, cache)
    p = Path(model).expanduser()
    return p if (p / "config.json").exists() else None
