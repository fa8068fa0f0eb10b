"""The workbench: a loaded model with its evaluation and calibration windows, its cached
reference predictions and calibration statistics, and the row of one configuration on it."""


from __future__ import annotations

import copy
import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..data import windows as data
from ..models.assets import cache_dir
from ..models.loading import ModelInfo, load_model
from ..quantization.calibrate import STATS_FORMAT, CalibStats, collect_stats
from .metrics import DEFAULT_TOPK, Eval, Reference, evaluate, reference_predictions, summarize_reference
from ..quantization.pipeline import quantize
from ..quantization.recipe import Recipe
from ..quantization.runtime import QuantState, plain_forward, quantized_execution
from ..numerics.scheme import bits_per_element
from ..util.device import fit_batch, free_bytes, is_default, setting_key
from ..util.io import CorruptFile, discard_corrupt

__all__ = ["Row", "Comparison", "Workbench", "weight_bits", "kv_bits", "model_fingerprint", "HIGH_PRECISION_BITS",
           "LOSS_ON", "window_bytes"]

log = logging.getLogger(__name__)

#: what ``--loss-on`` accepts: every predicted token, or only the assistant's (conversations)
LOSS_ON = ("all", "assistant")

#: storage of an unquantized weight or KV entry in deployment (bf16)
HIGH_PRECISION_BITS = 16.0


@dataclass(frozen=True)
class Row:
    recipe: str
    description: str
    eval: Eval
    weight_bits: float  # storage bits per element over the decoder's Linear weights
    kv_bits: float
    quantize_seconds: float

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eval"] = self.eval.to_dict()
        return d


@dataclass
class Comparison:
    model: str
    corpus: str
    split: str
    windows: int
    seq_len: int
    tokens: int
    seed: int
    calibration_windows: int
    kl_topk: int
    reference_note: str
    rows: list[Row] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    calib_corpus: str = ""  # where the calibration windows came from (train split)
    loss_on: str = "all"  # "assistant": metrics over the assistant's tokens only

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d


def weight_bits(model: nn.Module, state: QuantState | None) -> float:
    """Storage bits per element over the Linear weights of the decoder layers (lm_head
    and embeddings excluded); unquantized weights count as bf16."""
    total = bits = 0.0
    schemes = state.weight_schemes if state else {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head" and ".layers." in f".{name}":
            n = m.weight.numel()
            s = schemes.get(name)
            bits += n * (bits_per_element(s, tuple(m.weight.shape)) if s else HIGH_PRECISION_BITS)
            total += n
    return bits / total if total else HIGH_PRECISION_BITS


def kv_bits(recipe: Recipe | None) -> float:
    """Bits per cached K/V element, averaged over keys and values (scales excluded)."""
    kv = recipe.kv_cache if recipe else None
    if kv is None:
        return HIGH_PRECISION_BITS
    k = kv.scheme.format.bits if kv.keys else HIGH_PRECISION_BITS
    v = kv.v_scheme.format.bits if kv.values else HIGH_PRECISION_BITS
    return (k + v) / 2


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.numpy().tobytes() if isinstance(p, torch.Tensor) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def model_fingerprint(info: ModelInfo) -> str:
    """Identity of a model's weights on disk: folder, config and weight-file sizes and times."""
    p = Path(info.path)
    parts = [str(p.resolve())]
    if (p / "config.json").exists():
        parts.append((p / "config.json").read_text())
    for f in sorted(p.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return _digest(*parts)


def window_bytes(config, seq_len: int, dtype: torch.dtype) -> int:
    """A generous estimate of the memory one window of ``seq_len`` tokens takes in one
    inference forward and the metrics after it: the logits in the model's dtype, their fp32
    copy and a temporary of that size; the widest activations of one layer (hidden states,
    q/k/v, the MLP's gate/up) twice; and fp32 attention scores of every head, in case the
    attention kernel forms them."""
    elt = torch.empty((), dtype=dtype).element_size()
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    logits = seq_len * vocab * (elt + 8)
    acts = 2 * seq_len * (8 * hidden + 3 * inter) * elt
    scores = heads * seq_len * seq_len * 4
    return max(1, logits + acts + scores)


@dataclass
class Workbench:
    """A loaded model with its evaluation windows, calibration windows, cached reference
    and cached calibration statistics: everything configurations are compared on."""

    model: nn.Module
    tokenizer: object
    info: ModelInfo
    windows: torch.Tensor
    calib_windows: torch.Tensor
    corpus: str
    seed: int
    cache: Path
    kl_topk: int = DEFAULT_TOPK
    progress: bool = True
    workers: int | None = None  # processes sharing the windows; None: lowbit.util.parallel.default_workers()
    device: torch.device = torch.device("cpu")  # where the model runs (a device map: its first device)
    dtype: torch.dtype = torch.float32  # the model's float type
    batch: int | None = None  # windows per forward; None: chosen from free memory on a GPU, workers on the CPU
    stage_seconds: dict[str, float] = field(default_factory=dict)
    _reference: Reference | None = None
    _stats: CalibStats | None = None
    calib_corpus: str | None = None  # None: the evaluation corpus
    loss_mask: torch.Tensor | None = None  # (windows, seq - 1) bool: the positions metrics count; None: all

    @classmethod
    def load(
        cls,
        model: str,
        *,
        corpus: str = "wiki",
        calib_corpus: str | None = None,
        loss_on: str = "all",
        windows: int = 64,
        seq_len: int = 512,
        calib_windows: int = 128,
        seed: int = 0,
        cache: Path | None = None,
        kl_topk: int = DEFAULT_TOPK,
        progress: bool = True,
        workers: int | None = None,
        loader: Callable = load_model,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch: int | None = None,
        device_map: str | dict | None = None,
    ) -> "Workbench":
        """Load ``model`` and the windows: ``windows`` evaluation windows from the test split of
        ``corpus``, ``calib_windows`` calibration windows from the train split of ``calib_corpus``
        (default ``corpus``; ``a+b+c`` mixes corpora in equal parts). ``loss_on="assistant"``
        counts only the assistant's tokens of a corpus of conversations.  ``device`` / ``dtype``:
        where the model runs and its float type (:mod:`lowbit.util.device`; the CPU in fp32 by
        default, with cache keys unchanged); ``batch``: windows per forward (see
        :attr:`eval_batch`); ``device_map``: accelerate's placement over several devices
        (evaluation only)."""
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        cache = cache_dir(cache)
        if batch is not None and int(batch) < 1:
            raise ValueError(f"batch must be >= 1 windows, got {batch}")
        device = torch.device(device)
        t0 = time.perf_counter()
        placed = {} if is_default(device, dtype) else {"device": device, "dtype": dtype}
        if device_map is not None:
            placed["device_map"] = device_map
        m, tok, info = loader(model, cache=cache, **placed)
        t1 = time.perf_counter()
        bos = tok.bos_token_id if info.needs_bos else None
        win = data.windows_for(tok, corpus, "test", seq_len=seq_len, n_windows=windows, bos_token_id=bos, cache=cache)
        calib_from = calib_corpus or corpus
        cal = (data.calibration_for(tok, calib_from, calib_windows, seq_len, seed, bos, cache=cache) if calib_windows
               else win[:0])
        mask = (data.assistant_mask_for(tok, corpus, seq_len=seq_len, n_windows=windows, bos_token_id=bos, cache=cache)
                if loss_on == "assistant" else None)
        t2 = time.perf_counter()
        wb = cls(m, tok, info, win, cal, corpus, seed, cache, kl_topk, progress, workers, device, dtype, batch,
                 calib_corpus=calib_from, loss_mask=mask)
        wb.stage_seconds = {"load model": t1 - t0, "load data": t2 - t1}
        return wb

    def _key(self, *extra) -> str:
        return _digest(model_fingerprint(self.info), *extra, *setting_key(self.device, self.dtype))

    @property
    def eval_batch(self) -> int | None:
        """Windows per forward: ``batch`` if set; on a GPU as many as half its free memory
        holds (:func:`window_bytes`); ``None`` on the CPU (one window per forward, shared
        among forked workers)."""
        if self.batch is not None:
            return self.batch
        free = free_bytes(self.device)
        if free is None:
            return None
        return fit_batch(free, window_bytes(self.model.config, self.windows.shape[1], self.dtype), len(self.windows))

    def _cached(self, stage: str, path: Path, load, compute):
        """``load(path)`` if the file exists and is intact, else ``compute()`` and save it
        (atomically: concurrent runs each write a whole file); the time goes to ``stage``
        (or ``stage (cached)``)."""
        t0 = time.perf_counter()
        if path.exists():
            try:
                value = load(path)
            except CorruptFile as e:  # truncated or corrupted: never used, recomputed
                discard_corrupt(e, path)
            else:
                self.stage_seconds[f"{stage} (cached)"] = time.perf_counter() - t0
                return value
        value = compute()
        value.save(path)
        self.stage_seconds[stage] = time.perf_counter() - t0
        log.info("%s: done in %.0f s (cached at %s)", stage, self.stage_seconds[stage], path)
        return value

    @property
    def reference(self) -> Reference:
        if self._reference is None:
            path = self.cache / "references" / f"{self.info.name}-{self._key(self.windows, self.kl_topk)}.safetensors"
            self._reference = self._cached("reference", path, Reference.load, self._reference_pass)
        return self._reference

    def _reference_pass(self) -> Reference:
        ref = reference_predictions(plain_forward(self.model), self.windows, self.kl_topk, progress=self.progress,
                                    workers=self.workers, batch=self.eval_batch)
        bad = int((~torch.isfinite(ref.nll)).any(-1).sum())
        if bad and self.dtype != torch.float32:  # (fp32 non-finite weights are named when quantized)
            raise ValueError(f"the reference's log-probabilities are NaN or inf on {bad} of {len(self.windows)} "
                             f"windows in {str(self.dtype).replace('torch.', '')}: the model's activations overflow "
                             "it; use --dtype bf16 or fp32")
        return ref

    @property
    def stats(self) -> CalibStats:
        if self._stats is None:
            if len(self.calib_windows) == 0:
                raise ValueError("this configuration needs calibration data; use --calib-windows > 0")
            key = self._key(self.calib_windows, STATS_FORMAT)
            path = self.cache / "calibration" / f"{self.info.name}-{key}.safetensors"
            self._stats = self._cached(
                "calibration", path, CalibStats.load,
                lambda: collect_stats(self.model, self.calib_windows, progress=self.progress, workers=self.workers,
                                      batch=self.eval_batch),
            )
        return self._stats

    @property
    def calibration(self) -> torch.Tensor | None:
        """The calibration windows, or ``None`` when the bench was loaded without any."""
        return self.calib_windows if len(self.calib_windows) else None

    def reference_row(self) -> Row:
        ref = self.reference
        ev = summarize_reference(ref, name="reference", seed=self.seed, mask=self.loss_mask)
        return Row("reference", f"unquantized ({next(self.model.parameters()).dtype})".replace("torch.", ""),
                   ev, HIGH_PRECISION_BITS, HIGH_PRECISION_BITS, 0.0)

    def run(self, recipe: Recipe | None, *, only: str | None = None, model: nn.Module | None = None,
            name: str | None = None) -> Row:
        """Evaluate ``model`` (default: the bench's model) against the reference, after
        quantizing a copy of it with ``recipe`` (restricted to modules matching ``only``)."""
        ref = self.reference
        model = self.model if model is None else model
        label = name or (recipe.name if recipe else self.info.name)
        if recipe is None:
            ev = evaluate(plain_forward(model), self.windows, ref, name=label, seed=self.seed, progress=self.progress,
                          workers=self.workers, mask=self.loss_mask, batch=self.eval_batch)
            return Row(label, "as loaded", ev, weight_bits(model, None), HIGH_PRECISION_BITS, 0.0)
        if getattr(model, "hf_device_map", None):
            raise ValueError("a model spread over devices by a device map is evaluated as loaded only; quantize it "
                             "with `lowbit quantize --low-memory --device cuda` (one decoder layer on the GPU at a "
                             "time) and evaluate the written folder")
        model = copy.deepcopy(model)
        t0 = time.perf_counter()
        state = quantize(model, recipe, self.calibration, stats=lambda: self.stats, only=only, progress=self.progress)
        tq = time.perf_counter() - t0
        with quantized_execution(model, state) as fwd:
            ev = evaluate(fwd, self.windows, ref, name=label, seed=self.seed, progress=self.progress,
                          workers=self.workers, mask=self.loss_mask, batch=self.eval_batch)
        return Row(label, recipe.description, ev, weight_bits(model, state), kv_bits(recipe), tq)

    def describe(self) -> Comparison:
        return Comparison(
            model=self.info.name, corpus=self.corpus, split="test", windows=len(self.windows),
            seq_len=self.windows.shape[1], tokens=len(self.windows) * (self.windows.shape[1] - 1), seed=self.seed,
            calibration_windows=len(self.calib_windows), kl_topk=self.kl_topk, reference_note=self.info.reference_note,
            stage_seconds=self.stage_seconds, calib_corpus=self.calib_corpus or self.corpus,
            loss_on="all" if self.loss_mask is None else "assistant",
        )


