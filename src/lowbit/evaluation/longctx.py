"""Long contexts: perplexity and KL by position, for KV-cache schemes, on windows far longer
than the 512 tokens of the standard protocol.

"KV error accumulates with context": every query attends over all earlier keys and values,
so a quantized cache's error may grow with the position.  :func:`long_context` builds
windows of ``length`` tokens from the corpus's test stream (consecutive text, documents
joined as the evaluation windows join them), runs the reference and each KV recipe over them,
and reports, per position bucket (0–512, 512–1k, 1–2k, 2–4k, 4–8k, ...), the perplexity, its
Δ% against the reference's on the same tokens, and the mean KL — with 95% bootstrap intervals
over windows.

Logits are formed a chunk of positions at a time from the decoder's last hidden state, so an
8k window of a 262k-vocabulary model never holds its whole logit matrix.  Per-channel key
scales (KIVI's key layout) are computed over the whole window, as one prefill of that length
computes them — or, for recipes with a full-precision window (``KVConfig.residual``, the
``-r128`` presets), over each group of that many tokens, the window then running as a prefill
in chunks of one group (:func:`lowbit.quantization.kv.kv_forward`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..data import windows as data
from ..quantization.kv import kv_forward
from ..quantization.pipeline import quantize
from ..quantization.recipe import Recipe
from ..quantization.runtime import input_device, quantized_activations
from ..util.progress import staged_progress
from .metrics import _ci, window_metrics
from .workbench import Workbench

__all__ = ["BUCKET_EDGES", "Bucket", "LongContextRow", "LongContext", "long_context", "buckets_for"]

#: position bucket edges (a bucket holds predicted positions ``lo <= p < hi``)
BUCKET_EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

_CHUNK = 512  # positions whose logits are formed at once


def buckets_for(length: int) -> list[tuple[int, int]]:
    """The buckets of a window of ``length`` tokens (it predicts positions 0..length−2)."""
    if length < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {length}")
    last = length - 1
    out = [(lo, min(hi, last)) for lo, hi in zip(BUCKET_EDGES, BUCKET_EDGES[1:]) if lo < last]
    if last > BUCKET_EDGES[-1]:
        out.append((BUCKET_EDGES[-1], last))
    return out


@dataclass(frozen=True)
class Bucket:
    lo: int
    hi: int
    tokens: int
    ppl: float
    ppl_ci: tuple[float, float]
    delta_pct: float | None = None  # against the reference's perplexity on the same tokens
    delta_ci: tuple[float, float] | None = None
    kl_mean: float | None = None
    kl_ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class LongContextRow:
    recipe: str
    description: str
    buckets: tuple[Bucket, ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "description": self.description, "seconds": self.seconds,
                "buckets": [asdict(b) for b in self.buckets]}


@dataclass(frozen=True)
class LongContext:
    model: str
    corpus: str
    length: int
    windows: int
    rows: tuple[LongContextRow, ...]

    def to_dict(self) -> dict:
        return {"model": self.model, "corpus": self.corpus, "length": self.length, "windows": self.windows,
                "rows": [r.to_dict() for r in self.rows]}


def _final_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def _window_pass(model, ids: torch.Tensor, kv, topk: int, ref: dict | None) -> dict[str, torch.Tensor]:
    """One window through the decoder (the KV plan at every cache write), then per chunk of
    positions: the NLL, and either the top-``topk`` reference log-probabilities (``ref`` None)
    or the KL against them."""
    body = model.get_decoder()
    dev = input_device(model)
    if dev is not None:
        ids = ids.to(dev)
    hidden = (body(input_ids=ids, use_cache=False).last_hidden_state if kv is None
              else kv_forward(body, ids, kv, model.config, "last_hidden_state"))[0, :-1]
    targets = ids[0, 1:]
    nll, kl, top_ids, top_lp = [], [], [], []
    for s in range(0, hidden.shape[0], _CHUNK):
        logits = _final_logits(model, hidden[s : s + _CHUNK])
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        if ref is None:
            m = window_metrics(logits, targets[s : s + _CHUNK], None, 0, lse)
            top = torch.topk(logits, min(topk, logits.shape[-1]), dim=-1)
            top_ids.append(top.indices.to(torch.int32))
            top_lp.append(top.values - lse)
        else:
            m = window_metrics(logits, targets[s : s + _CHUNK], _RefSlice(ref, s, s + _CHUNK, logits.device), 0, lse)
            kl.append(m["kl"])
        nll.append(m["nll"])
    out = {"nll": torch.cat(nll).cpu()}
    if ref is None:
        out |= {"topk_ids": torch.cat(top_ids).cpu(), "topk_logprobs": torch.cat(top_lp).cpu()}
    else:
        out["kl"] = torch.cat(kl).cpu()
    return out


class _RefSlice:
    """The part of one reference window that :func:`window_metrics` reads (window index 0)."""

    def __init__(self, ref: dict, lo: int, hi: int, device):
        self.topk_ids = ref["topk_ids"][lo:hi][None].to(device)
        self.topk_logprobs = ref["topk_logprobs"][lo:hi][None].to(device)
        self.argmax = ref["topk_ids"][lo:hi, 0].long()[None].to(device)


def _boot(values: np.ndarray, weights: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Bootstrap resamples over windows of a ratio of sums: rows are windows."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n, len(values)))
    return values[idx].sum(1) / weights[idx].sum(1)


def _buckets(nll: np.ndarray, kl: np.ndarray | None, ref_nll: np.ndarray | None, edges, bootstrap: int,
             seed: int) -> tuple[Bucket, ...]:
    """``nll``/``kl``/``ref_nll``: (windows, positions)."""
    out = []
    for lo, hi in edges:
        s = nll[:, lo:hi].sum(1)
        count = np.full(len(s), hi - lo, dtype=np.float64)
        ppl = float(np.exp(s.sum() / count.sum()))
        b = dict(lo=lo, hi=hi, tokens=int(count.sum()), ppl=ppl, ppl_ci=_ci(np.exp(_boot(s, count, bootstrap, seed))))
        if ref_nll is not None:
            r = ref_nll[:, lo:hi].sum(1)
            rng = np.random.default_rng(seed)
            idx = rng.integers(0, len(s), size=(bootstrap, len(s)))
            d = (np.exp((s[idx].sum(1) - r[idx].sum(1)) / count[idx].sum(1)) - 1) * 100
            b |= dict(delta_pct=float((np.exp((s.sum() - r.sum()) / count.sum()) - 1) * 100), delta_ci=_ci(d))
        if kl is not None:
            k = kl[:, lo:hi].sum(1)
            b |= dict(kl_mean=float(k.sum() / count.sum()), kl_ci=_ci(_boot(k, count, bootstrap, seed)))
        out.append(Bucket(**b))
    return tuple(out)


def long_context(bench: Workbench, recipes: list[Recipe], *, length: int = 8192, windows: int = 4,
                 topk: int = 256, bootstrap: int = 1000) -> LongContext:
    """The reference and each recipe on ``windows`` windows of ``length`` tokens of the bench's
    corpus (test split), bucketed by position.

    Raises:
        ValueError: ``length`` exceeds the model's ``max_position_embeddings``, or the test
            split has fewer than ``windows`` windows of that length.
    """
    limit = getattr(bench.model.config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise ValueError(f"--length {length} exceeds {bench.info.name}'s max_position_embeddings ({limit})")
    if windows < 1:
        raise ValueError(f"--windows must be at least 1, got {windows}")
    bos = bench.tokenizer.bos_token_id if bench.info.needs_bos else None
    stream = data.stream_for(bench.tokenizer, bench.corpus, "test", cache=bench.cache)
    wins = data.eval_windows(stream, length, windows, bos)
    edges = buckets_for(length)
    configs = [None, *recipes]
    ref_out: list[dict] = []
    rows = []
    for cfg, stage in staged_progress(configs, "long context", enabled=bench.progress):
        stage("reference" if cfg is None else cfg.name)
        t0 = time.perf_counter()
        model, state = bench.model, None
        if cfg is not None:
            model = copy.deepcopy(bench.model)
            state = quantize(model, cfg, bench.calibration, stats=lambda: bench.stats, progress=False)
        outs = []
        with quantized_activations(model, state.activations if state else {}):
            for w in range(len(wins)):
                outs.append(_window_pass(model, wins[w : w + 1], state.kv if state else None, topk,
                                         None if cfg is None else ref_out[w]))
        if cfg is None:
            ref_out = outs
        nll = np.stack([o["nll"].double().numpy() for o in outs])
        kl = None if cfg is None else np.stack([o["kl"].double().numpy() for o in outs])
        ref_nll = None if cfg is None else np.stack([o["nll"].double().numpy() for o in ref_out])
        rows.append(LongContextRow("reference" if cfg is None else cfg.name,
                                   "unquantized" if cfg is None else cfg.description,
                                   _buckets(nll, kl, ref_nll, edges, bootstrap, bench.seed),
                                   time.perf_counter() - t0))
    return LongContext(bench.info.name, bench.corpus, length, len(wins), tuple(rows))
