"""``lowbit quantize``: a model in, a compressed-tensors folder out (and its evaluation).

Two jobs, one per memory regime:

- :func:`quantize_to_folder`: the whole model in memory; the written folder is read back
  through compressed-tensors' decompressors and evaluated against the unquantized model.
- :func:`quantize_streaming`: one decoder layer in memory at a time (models larger than
  memory); the folder is written layer by layer and nothing is evaluated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from ..checkpoint.compressed_tensors import check_recipe, check_shapes
from ..checkpoint.stream import LayerwiseExport
from ..checkpoint.write import DEFAULT_DTYPE, ExportResult, _linear_shapes, export
from ..data import windows as data
from ..evaluation.compare import Workbench
from ..evaluation.metrics import evaluate as run_eval
from ..models.loading import load_model, read_into
from ..models.offload import LayerStore
from ..quantization.pipeline import linear_names, needs_data, quantize
from ..quantization.recipe import Recipe, load_recipe
from ..quantization.runtime import quantized_execution
from ..quantization.targets import sibling_groups

__all__ = ["ShipOptions", "quantize_to_folder", "quantize_streaming"]


def _checked_recipe(recipe: str, out: Path, force: bool) -> Recipe:
    """The recipe, refused before any work if it does not export or ``out`` exists."""
    r = load_recipe(recipe)
    check_recipe(r)
    if Path(out).exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    return r


def _refuse_dead_rules(model, recipe: Recipe) -> None:
    """A checkpoint is not written from a recipe with a rule that matches no Linear."""
    msg = recipe.unmatched(linear_names(model))
    if msg:
        raise ValueError(msg)


@dataclass(frozen=True)
class ShipOptions:
    """What both jobs take besides the model, the recipe and the output folder.

    ``calib_windows`` windows of ``seq_len`` tokens from the train split of ``calib_corpus``
    (default ``corpus``; a mixture ``a+b`` takes equal parts), drawn with ``seed``;
    ``dtype``: the checkpoint's float type; ``device`` / ``run_dtype``: where and in which
    float type the model is calibrated and quantized (``None``: the job's default);
    ``force``: overwrite an existing output folder.
    """

    force: bool = False
    calib_windows: int = 128
    corpus: str = "wiki"
    calib_corpus: str | None = None
    seed: int = 0
    seq_len: int = 512
    cache: Path | None = None
    dtype: torch.dtype = DEFAULT_DTYPE
    progress: bool = True
    device: torch.device | str | None = None
    run_dtype: torch.dtype = torch.float32

    @property
    def calibration_corpus(self) -> str:
        return self.calib_corpus or self.corpus


def _options(options: ShipOptions | None, overrides: dict) -> ShipOptions:
    unknown = sorted(set(overrides) - {f.name for f in fields(ShipOptions)})
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; ShipOptions has "
                        f"{', '.join(f.name for f in fields(ShipOptions))}")
    return replace(options or ShipOptions(), **overrides)


def quantize_to_folder(model: str, recipe: str, out: Path, options: ShipOptions | None = None, *,
                       evaluate: bool = True, windows: int = 64, loss_on: str = "all", batch: int | None = None,
                       **overrides) -> ExportResult:
    """Load ``model``, quantize it with ``recipe`` (calibrating when the recipe needs data),
    write the compressed-tensors folder ``out`` and, if ``evaluate``, evaluate the written
    checkpoint against the unquantized model on ``windows`` windows of ``options.corpus``
    (``loss_on``: see :meth:`Workbench.load`; ``batch``: windows per forward).

    ``options`` (or its fields as keywords, which override it): :class:`ShipOptions`; the
    model runs on ``options.device`` (default the CPU).  The evaluation reads every weight
    back from the written files through compressed-tensors' decompressors; activation and KV
    quantization run in lowbit's runtime with the scales that were written.  Bad recipes and
    an existing ``out`` are refused before any work.
    """
    o = _options(options, overrides)
    out = Path(out)
    r = _checked_recipe(recipe, out, o.force)
    bench = Workbench.load(model, corpus=o.corpus, calib_corpus=o.calib_corpus, loss_on=loss_on if evaluate else "all",
                           windows=windows if evaluate else 1, seq_len=o.seq_len,
                           calib_windows=o.calib_windows if needs_data(r) else 0, seed=o.seed, cache=o.cache,
                           progress=o.progress, device=o.device or "cpu", dtype=o.run_dtype, batch=batch)
    _refuse_dead_rules(bench.model, r)
    shapes = _linear_shapes(bench.model)
    check_shapes(shapes, r.resolve(list(shapes)), sibling_groups(bench.model))
    if evaluate:
        bench.reference  # from the unquantized model, before it is quantized in place
    state = quantize(bench.model, r, bench.calibration, stats=lambda: bench.stats, keep_qtensors=True,
                     progress=o.progress)

    def _evaluate(folder: Path) -> dict:
        written = read_into(copy.deepcopy(bench.model), folder)
        with quantized_execution(written, state) as fwd:
            ev = run_eval(fwd, bench.windows, bench.reference, name=r.name, seed=o.seed, progress=o.progress,
                          mask=bench.loss_mask, batch=bench.eval_batch)
        ref = bench.reference_row().eval
        return {"corpus": o.corpus, "calib_corpus": bench.calib_corpus, "loss_on": loss_on, "reference": ref.to_dict(),
                "checkpoint": ev.to_dict()}

    return export(bench.model, state, out, tokenizer=bench.tokenizer, source=bench.info.path, dtype=o.dtype,
                  force=o.force, model_name=bench.info.name, evaluate=_evaluate if evaluate else None)


def quantize_streaming(model: str, recipe: str, out: Path, options: ShipOptions | None = None,
                       **overrides) -> ExportResult:
    """``lowbit quantize --low-memory``: quantize ``model`` holding one decoder layer in
    memory at a time and write the compressed-tensors folder ``out`` layer by layer.

    The model is read lazily from its safetensors checkpoint (:mod:`lowbit.models.offload`).
    Recipes that need data — layer-by-layer methods, and static activation or KV scales —
    run in the layer-by-layer pipeline (so static scales come from each layer's inputs as
    the quantized layers before it produce them), replaying one calibration chunk at a time
    (``algorithms.recompute``); plain rounding needs no data.  Nothing is
    evaluated (that needs the whole model: ``lowbit eval OUT --reference MODEL``).
    ``options`` (or its fields as keywords): :class:`ShipOptions`; ``options.device``: each
    decoder layer is moved there for its pass (a GPU, while the model stays on disk and in CPU
    memory); ``options.run_dtype``: the float type the model is read in.
    """
    o = _options(options, overrides)
    out = Path(out)
    r = _checked_recipe(recipe, out, o.force)
    r = replace(r, algorithms=replace(r.algorithms, recompute=True))  # one calibration chunk's activations at a time
    m, tok, info = load_model(model, cache=o.cache, lazy=True, dtype=o.run_dtype)
    _refuse_dead_rules(m, r)
    calib = None
    if needs_data(r):
        bos = tok.bos_token_id if info.needs_bos else None
        calib = data.calibration_for(tok, o.calibration_corpus, o.calib_windows, o.seq_len, o.seed, bos, cache=o.cache)
    with LayerStore(m, info.path) as store, LayerwiseExport(out, m, r, dtype=o.dtype, force=o.force) as ex:
        state = quantize(m, r, calib, keep_qtensors=True, progress=o.progress, store=store, on_layer=ex.layer_done,
                         device=o.device)
        return ex.finish(state, store=store, tokenizer=tok, source=info.path, model_name=info.name)
