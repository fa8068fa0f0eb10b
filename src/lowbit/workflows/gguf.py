"""``lowbit quantize --format gguf``: a model in, one GGUF file out (and its evaluation).

The recipe's rules name GGUF element types (``gguf-q4_k``, ...); they apply to the Linears
as in any recipe and, in addition, to the token embedding (``model.embed_tokens``), which
llama.cpp quantizes too (for a tied model it is also the output matrix).  Where a k-quant's
256-element super-block does not divide a weight's rows, the weight gets the type llama.cpp's
``llama-quantize`` falls back to (:data:`lowbit.numerics.ggml.FALLBACK`), as an extra rule.

The file is read back (:func:`lowbit.checkpoint.gguf.read_gguf_weights`) and must decode to
exactly the weights lowbit quantized; the evaluation runs on those weights.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.gguf import gguf_tensor_name, read_gguf_weights, to_stored, write_gguf
from ..evaluation.compare import Workbench
from ..evaluation.metrics import evaluate as run_eval
from ..numerics import ggml as G
from ..numerics.qtensor import QTensor, compute_qparams, dequantize, quantize as quantize_tensor
from ..numerics.scheme import PRESETS, Scheme
from ..quantization.pipeline import linear_names, needs_data, quantize
from ..quantization.recipe import Recipe, Rule, load_recipe
from ..quantization.runtime import plain_forward

__all__ = ["quantize_to_gguf", "quantize_for_gguf", "GGUFResult", "gguf_recipe", "check_gguf_recipe",
           "load_checked", "EMBEDDING"]

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens"


@dataclass(frozen=True)
class GGUFResult:
    path: Path
    types: dict[str, str]          # module → ggml type written
    file_bytes: int
    eval: dict | None = None


def check_gguf_recipe(r: Recipe) -> None:
    """Refuse what a GGUF file cannot hold: non-GGUF weight schemes, activation or KV quantization."""
    for i, rule in enumerate(r.rules):
        if rule.inputs is not None:
            raise ValueError(f"recipe {r.name!r} rule {i} quantizes inputs: llama.cpp quantizes activations itself; "
                             "a GGUF recipe has weight schemes only")
        if rule.weights is not None and not rule.weights.ggml:
            raise ValueError(f"recipe {r.name!r} rule {i}: weight scheme {rule.weights} is not a GGUF type; "
                             f"use one of {', '.join(n for n in PRESETS if n.startswith('gguf-'))}")
    if r.kv_cache is not None:
        raise ValueError(f"recipe {r.name!r} quantizes the KV cache: for GGUF that is llama.cpp's run-time choice "
                         "(--cache-type-k), not part of the file")
    if r.algorithms.awq is not None or r.algorithms.rotation is not None or r.algorithms.smoothquant is not None \
            or r.algorithms.outliers is not None:
        raise NotImplementedError("GGUF export runs round-to-nearest, the MSE / importance-weighted search and GPTQ; "
                                  "AWQ, rotations, SmoothQuant and outlier channels change the graph llama.cpp runs "
                                  "and are not implemented for GGUF")


def _with_fallbacks(r: Recipe, names: list[str], cols: dict[str, int]) -> Recipe:
    """``r`` with one extra rule per weight whose k-quant super-block does not divide its rows."""
    extra = []
    for name, (w, _) in r.resolve(names).items():
        if w is None:
            continue
        t = w.ggml_type
        fb = G.fallback(t, cols[name])
        if fb is not t:
            extra.append(Rule((name,), PRESETS[f"gguf-{fb.name}"]))
    return dataclasses.replace(r, rules=r.rules + tuple(extra)) if extra else r


def gguf_recipe(recipe: str | Recipe, model) -> tuple[Recipe, Scheme | None]:
    """The recipe as run on ``model`` (fallback rules added, embedding-only rules removed) and
    the embedding's scheme (``None``: written as F32)."""
    r = load_recipe(recipe) if isinstance(recipe, str) else recipe
    check_gguf_recipe(r)
    linears = linear_names(model)
    cols = {n: m.in_features for n, m in model.named_modules() if n in linears}
    cols[EMBEDDING] = model.get_input_embeddings().weight.shape[1]
    dead = [list(rule.targets) for rule in r.rules if not any(rule.matches(n) for n in linears + [EMBEDDING])]
    if dead:
        raise ValueError(f"recipe {r.name!r}: the rule for targets {dead[0]} matches no Linear or the embedding "
                         f"of this model (names like {linears[0]!r}, {EMBEDDING!r})")
    r = _with_fallbacks(r, linears + [EMBEDDING], cols)
    emb = r.resolve([EMBEDDING]).get(EMBEDDING, (None, None))[0]
    for_linears = tuple(rule for rule in r.rules if any(rule.matches(n) for n in linears))
    return dataclasses.replace(r, rules=for_linears), emb


def _quantize_embedding(model, scheme: Scheme) -> QTensor:
    """Round the token embedding to ``scheme`` in place (round to nearest as llama-quantize does:
    :func:`~lowbit.numerics.qtensor.compute_qparams`); returns its QTensor."""
    emb = model.get_input_embeddings()
    qt = quantize_tensor(emb.weight.data, scheme, compute_qparams(emb.weight.data, scheme))
    emb.weight.data.copy_(dequantize(qt, emb.weight.dtype))
    return qt


def quantize_for_gguf(model, recipe: str | Recipe, calibration: torch.Tensor | None = None, *, stats=None,
                      progress: bool = False) -> tuple[dict[str, QTensor], Recipe]:
    """Quantize ``model`` in place with a GGUF recipe (:func:`gguf_recipe`): the embedding by
    round-to-nearest, the Linears by the recipe's method (:func:`lowbit.quantization.pipeline.quantize`).
    Returns the QTensor of every quantized weight, by module name, and the recipe as run."""
    r, emb_scheme = gguf_recipe(recipe, model)
    qts: dict[str, QTensor] = {}
    if emb_scheme is not None:
        qts[EMBEDDING] = _quantize_embedding(model, emb_scheme)
    state = quantize(model, r, calibration, stats=stats, keep_qtensors=True, progress=progress)
    qts.update(state.weights)
    return qts, r


def quantize_to_gguf(model: str, recipe: str, out: Path, *, force: bool = False, calib_windows: int = 128,
                     corpus: str = "wiki", seed: int = 0, evaluate: bool = True, windows: int = 64,
                     seq_len: int = 512, cache: Path | None = None, progress: bool = True) -> GGUFResult:
    """Load ``model``, quantize it with the GGUF ``recipe``, write ``out`` (``.gguf``), read it
    back (it must decode to exactly the quantized weights) and, if ``evaluate``, evaluate
    the read-back model against the unquantized one.  Bad recipes and an existing ``out``
    are refused before any work."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise ValueError(f"--format gguf writes one file: {out} should end in .gguf")
    r0 = load_recipe(recipe)
    check_gguf_recipe(r0)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    bench = Workbench.load(model, corpus=corpus, windows=windows if evaluate else 1, seq_len=seq_len,
                           calib_windows=calib_windows if needs_data(r0) else 0, seed=seed, cache=cache,
                           progress=progress)
    gguf_recipe(r0, bench.model)  # refuses dead rules before the reference is computed
    if evaluate:
        bench.reference  # from the unquantized model, before it is quantized in place
    qts, r = quantize_for_gguf(bench.model, r0, bench.calibration, stats=lambda: bench.stats, progress=progress)
    write_gguf(bench.model, qts, out, tokenizer_dir=bench.info.path, name=bench.info.name,
               add_bos=bench.info.needs_bos, force=force)
    load_checked(bench.model, out)  # the file holds exactly these weights, so they are what is evaluated
    ev = None
    if evaluate:
        e = run_eval(plain_forward(bench.model), bench.windows, bench.reference, name=r.name, seed=seed, progress=progress)
        ev = {"corpus": corpus, "reference": bench.reference_row().eval.to_dict(), "checkpoint": e.to_dict()}
    types = {m: qt.scheme.ggml for m, qt in qts.items()}
    return GGUFResult(out, types, out.stat().st_size, ev)


@torch.no_grad()
def load_checked(model, path: Path) -> None:
    """Check the file against ``model``: every tensor must hold exactly what the writer stores for
    the model's own (quantized) weights, bit for bit (compared as stored, so Gemma's ``1 + w`` norms
    are compared as the fp32 values both llama.cpp and transformers multiply by)."""
    mt = model.config.model_type
    got = read_gguf_weights(path, model.config, stored=True)
    sd = model.state_dict()
    for name, t in got.items():
        if name not in sd:
            raise ValueError(f"{path}: tensor {name} has no counterpart in the model")
        want = to_stored(gguf_tensor_name(name, mt), sd[name], mt)
        if not torch.equal(want, t):
            diff = float((want - t).abs().max())
            raise AssertionError(f"{path}: {name} decodes to other values than lowbit quantized (max |Δ| {diff:.3g})")
