"""A cache of evaluated rows: one configuration's accuracy on one bench, computed once.

``compare`` and ``plan`` evaluate the same (model, recipe, windows) again and again; a row
costs a quantization and a full evaluation pass, a cached one a file read.  A row is keyed by

    sha256(lowbit version, digest of the source that computes a row, model fingerprint, recipe (its full value),
           evaluation windows, calibration windows, seed, KL top-k[, loss mask])

— the windows' token ids are the data fingerprint (corpus, split, tokenizer and sequence
length all show in them; the calibration windows are those of ``--calib-corpus``'s train
split, so another calibration corpus or mixture is another row).  With ``--loss-on
assistant`` the mask of counted positions enters the key too.  Rows are JSON files under ``<cache>/rows/``, written atomically.
Worker count, batch size and progress do not enter the key: results equal up to float rounding.
A device other than the CPU or a dtype other than fp32 does (:func:`lowbit.util.device.setting_key`;
nothing for the default, so keys computed before devices existed stay valid).
Any change to the code that computes a row — this module, ``compare`` and every lowbit module they
import, transitively (:func:`lowbit._version.source_digest`) — gives new keys, so a row computed by other
code is never read back; a change to the CLI, a report, the planner or the simulator leaves rows valid.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from .._version import __version__, source_digest
from ..quantization.recipe import Recipe
from ..util.device import setting_key
from ..util.io import atomic_write_text
from .workbench import Row, Workbench, _digest, model_fingerprint
from .metrics import Eval

__all__ = ["row_path", "load_row", "cached_row", "is_cached"]

log = logging.getLogger(__name__)

_TUPLES = ("ppl_ci", "delta_ci", "kl_ci", "top1_ci", "window_nll", "window_tokens", "window_kl")


def row_path(bench: Workbench, recipe: Recipe) -> Path:
    """Where the row of ``recipe`` on ``bench`` is (or would be) cached."""
    mask = () if bench.loss_mask is None else (bench.loss_mask.to(torch.uint8),)
    key = _digest(__version__, source_digest(__name__, "lowbit.evaluation.compare"), model_fingerprint(bench.info), repr(recipe), bench.windows, bench.calib_windows,
                  bench.seed, bench.kl_topk, *mask, *setting_key(bench.device, bench.dtype))
    return bench.cache / "rows" / f"{bench.info.name}-{recipe.name}-{key}.json".replace("/", "_")


def is_cached(bench: Workbench, recipe: Recipe) -> bool:
    return row_path(bench, recipe).exists()


def load_row(path: Path) -> Row:
    """A :class:`Row` from the JSON that :func:`cached_row` wrote."""
    d = json.loads(Path(path).read_text())
    ev = dict(d.pop("eval"))
    for k in _TUPLES:
        if ev.get(k) is not None:
            ev[k] = tuple(ev[k])
    return Row(eval=Eval(**ev), **d)


def cached_row(bench: Workbench, recipe: Recipe) -> Row:
    """``bench.run(recipe)``, read from the row cache when it was computed before.

    The time goes to ``bench.stage_seconds`` as ``config NAME`` or ``config NAME (cached)``.
    """
    path = row_path(bench, recipe)
    t0 = time.perf_counter()
    if path.exists():
        row = load_row(path)
        bench.stage_seconds[f"config {recipe.name} (cached)"] = time.perf_counter() - t0
        return row
    row = bench.run(recipe)
    atomic_write_text(path, json.dumps(row.to_dict(), indent=2) + "\n")
    bench.stage_seconds[f"config {recipe.name}"] = time.perf_counter() - t0
    log.info("%s: row cached at %s", recipe.name, path)
    return row
