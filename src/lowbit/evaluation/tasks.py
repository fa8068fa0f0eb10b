"""Benchmark scoring by log-likelihood, as lm-evaluation-harness 0.4.13 scores it, with each
shared context run once.

A request ``(context, continuation)`` is tokenized as lm-eval's ``HFLM._encode_pair`` does:
trailing spaces of the context move to the continuation, ``whole = enc(context + continuation)``,
``ctx = enc(context)``, ``cont = whole[len(ctx):]``; the model reads ``(ctx + cont)[:-1]`` and the
score is ``Σ_j log p(cont_j | ctx, cont_<j)``; ``is_greedy`` is whether every ``cont_j`` is the
argmax. Per example: ``acc`` = [argmax_i ll_i = gold], ``acc_norm`` = [argmax_i ll_i / len(choice_i)
= gold] (characters), as lm-eval's ``process_results`` for ``multiple_choice``.

Prefix sharing. The token sequences of one example's choices, ``s_i = ctx_i + cont_i``, share a
prefix ``P`` (the whole context for ordinary multiple choice; the sentence before the option for
WinoGrande). It runs once with a KV cache — only its last position's logits are formed — and the
choices' remaining tokens run on copies of that cache, logits formed at their real positions only.
Examples run in batches: sorted by prefix length, the prefixes of several examples form one
right-padded batch (what all of them share, such as MMLU's header, runs once before it), then all
their choices' remaining tokens form batches of similar widths. Padding slots are masked out and
positions count real tokens, so no token reads another sequence; short forwards are bound by
reading the weights, which a batch reads once. The log-likelihoods are those of the full
sequences up to float rounding whenever quantization is token-local: weights,
static or per-token (per-group) activation scales, and KV scales that are static or per token.
Scales computed over a whole forward (dynamic per-tensor activations, dynamic per-tensor or
per-channel KV — KIVI keys) depend on which tokens share a forward, so such recipes are scored
one full sequence at a time, as lm-eval's batch size 1 does (:func:`prefix_exact`).
A sliding-window model batches examples only while the padded rows fit in its window (the
window counts cache slots, padding included).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from torch import nn

from ..data.tasks import Example
from ..quantization.kv import cache_kwarg, make_cache
from ..quantization.runtime import QuantState, input_device, quantized_execution
from ..util.progress import progress_bar

__all__ = ["Encoded", "ExampleScore", "TaskResult", "encode_example", "score_examples", "prefix_exact", "outcome"]

_TOKEN_LOCAL = ("token", "channel", "group")
_BATCH_TOKENS = 512  # padded prefix tokens in one batch of examples
_BATCH_ROWS = 64
_FORWARD_COST = 24  # padded tokens one more forward is worth: a forward of few short rows is bound by reading the weights
_LOGIT_FLOATS = 1 << 26  # logits formed for one batch's choices (positions × vocabulary): 256 MiB in fp32
_GENERATED = ("strict-match", "flexible-extract")  # a generative task's two answer filters (lm-eval's names)


def outcome(kind: str, metric: str) -> str:
    """What :meth:`ExampleScore.correct` reads for a task of ``kind`` reporting ``metric``:
    LAMBADA's ``acc`` is whether the word is the greedy continuation."""
    return "greedy" if kind == "last_word" and metric == "acc" else metric  # a (tokens, features) input: one scale per row / row group


@dataclass(frozen=True)
class Encoded:
    """One example's token ids: ``contexts[i]`` and ``continuations[i]`` for choice ``i``."""

    contexts: tuple[tuple[int, ...], ...]
    continuations: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ExampleScore:
    """One example's outcome: per choice the log-likelihood, whether greedy decoding produces
    it, its token count; the example's gold index, choice lengths in characters, subject."""

    index: int
    gold: int
    loglik: tuple[float, ...]
    greedy: tuple[bool, ...]
    tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    subject: str = ""
    output: str = ""  # a generative task's generated text (``greedy``: strict, flexible answer correct)

    @property
    def pred(self) -> int:
        return max(range(len(self.loglik)), key=lambda i: self.loglik[i])

    @property
    def pred_norm(self) -> int:
        return max(range(len(self.loglik)), key=lambda i: self.loglik[i] / self.lengths[i])

    def correct(self, metric: str = "acc") -> bool:
        """``acc``, ``acc_norm``, or ``greedy`` (LAMBADA's accuracy: the gold choice is the greedy
        continuation)."""
        if metric == "acc":
            return self.pred == self.gold
        if metric == "acc_norm":
            return self.pred_norm == self.gold
        if metric == "greedy":
            return self.greedy[self.gold]
        if metric in _GENERATED:
            return self.greedy[_GENERATED.index(metric)]
        raise ValueError(f"unknown metric {metric!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ExampleScore":
        return cls(d["index"], d["gold"], tuple(d["loglik"]), tuple(d["greedy"]), tuple(d["tokens"]),
                   tuple(d["lengths"]), d.get("subject", ""), d.get("output", ""))


@dataclass(frozen=True)
class TaskResult:
    """One model's scores on one task; ``forward_tokens``: tokens the model read."""

    task: str
    name: str
    kind: str
    examples: tuple[ExampleScore, ...]
    seconds: float
    forward_tokens: int
    shared_prefix: bool

    def metric(self, metric: str) -> float:
        """Accuracy (``acc``, ``acc_norm``; LAMBADA's ``acc`` is greedy last-word accuracy) or
        LAMBADA's ``perplexity`` = exp(−mean over examples of the word's log-likelihood)."""
        if metric == "perplexity":
            return math.exp(-sum(e.loglik[0] for e in self.examples) / len(self.examples))
        return sum(e.correct(outcome(self.kind, metric)) for e in self.examples) / len(self.examples)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["examples"] = [e.to_dict() for e in self.examples]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TaskResult":
        return cls(d["task"], d["name"], d["kind"], tuple(ExampleScore.from_dict(e) for e in d["examples"]),
                   d["seconds"], d["forward_tokens"], d["shared_prefix"])


def _encode(tokenizer, text: str, bos: bool) -> list[int]:
    """``tokenizer.encode(text)`` with the tokenizer's own special tokens, as lm-eval 0.4.13's
    ``tok_encode`` (its ``add_bos_token`` unset); ``bos`` prepends BOS if the tokenizer did not."""
    ids = tokenizer.encode(text)
    if bos and (not ids or ids[0] != tokenizer.bos_token_id):
        ids = [tokenizer.bos_token_id] + ids
    return ids


def encode_example(tokenizer, example: Example, *, bos: bool = False) -> Encoded:
    """Token ids as lm-eval's ``_encode_pair`` makes them (``bos``: a BOS token starts each
    sequence, for models that need one)."""
    ctxs, conts = [], []
    for context, continuation in example.requests:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = _encode(tokenizer, context + continuation, bos)
        ctx = _encode(tokenizer, context, bos)
        if not ctx:  # lm-eval: an empty context is the end-of-text token
            ctx = [tokenizer.eos_token_id]
            whole = ctx + whole
        ctxs.append(tuple(ctx))
        conts.append(tuple(whole[len(ctx):]))
    return Encoded(tuple(ctxs), tuple(conts))


def prefix_exact(state: QuantState | None) -> bool:
    """Whether every quantization in ``state`` is token-local, so that splitting a sequence
    into a cached prefix and its continuation (or batching sequences) leaves each token's
    numbers unchanged."""
    if state is None:
        return True
    for aq in state.activations.values():
        s = aq.scheme
        if s is not None and aq.qparams is None and aq.global_scale is None and s.dynamic \
                and s.granularity.kind not in _TOKEN_LOCAL:
            return False
    kv = state.kv
    if kv is not None:
        for on, s in ((kv.config.keys, kv.config.scheme), (kv.config.values, kv.config.v_scheme)):
            if on and s.dynamic and s.granularity.kind != "token":
                return False
    return True


def _gather(logprobs: torch.Tensor, cont: Sequence[int]) -> tuple[float, bool]:
    """``logprobs`` (len(cont), V) predicting ``cont``: the summed log-likelihood and greediness."""
    target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
    ll = float(logprobs.gather(-1, target[:, None]).sum())
    return ll, bool((logprobs.argmax(-1) == target).all())


def _shared_len(seqs: Sequence[tuple[int, ...]], contexts: Sequence[tuple[int, ...]]) -> int:
    """How many leading tokens every sequence of one example has in common (at most its
    shortest context)."""
    p = min(len(c) for c in contexts)
    for s in seqs[1:]:
        p = next((j for j, (a, b) in enumerate(zip(seqs[0][:p], s[:p])) if a != b), p)
    return p


@dataclass
class _Item:
    """One example to score by prefix sharing: its choices' full sequences and their common prefix."""

    pos: int
    enc: Encoded
    seqs: list[tuple[int, ...]]
    p: int

    @property
    def rest(self) -> list[tuple[int, ...]]:  # what each choice still reads after the prefix
        return [s[self.p:-1] for s in self.seqs]


class _Limits:
    """How many examples one batch takes: padded prefix tokens, the choices' positions whose
    logits are formed (memory: positions × vocabulary floats), and for sliding-window models a
    padded length under the window, since the window counts cache slots and padding takes some."""

    def __init__(self, config, tokens: int = _BATCH_TOKENS, rows: int = _BATCH_ROWS):
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.tokens, self.rows = tokens, rows
        self.logit_positions = max(1, _LOGIT_FLOATS // int(config.vocab_size))
        w = getattr(config, "sliding_window", None)
        self.window = int(w) if isinstance(w, int) and w > 0 else None

    def fits(self, items: list[_Item]) -> bool:
        if len(items) <= 1:
            return True
        p = max(it.p for it in items)
        rests = [len(r) for it in items for r in it.rest]
        return (len(items) <= self.rows and len(items) * p <= self.tokens and sum(rests) <= self.logit_positions
                and (self.window is None or p + max(rests) < self.window))


def _batches(items: list[_Item], limits: _Limits) -> list[list[_Item]]:
    """Consecutive runs of ``items`` sorted by prefix length (longest first, as lm-eval sorts),
    each as large as ``limits`` allow."""
    out: list[list[_Item]] = []
    for it in sorted(items, key=lambda it: (-it.p, it.pos)):
        if out and limits.fits(out[-1] + [it]):
            out[-1].append(it)
        else:
            out.append([it])
    return out


def _groups(widths: Sequence[int], forward_cost: int = _FORWARD_COST) -> list[tuple[int, int]]:
    """Split rows of ascending ``widths`` into consecutive runs ``[lo, hi)``, each one forward
    padded to its widest row, minimising padded tokens plus ``forward_cost`` tokens a forward
    (what reading the weights once costs): an exact dynamic programme over the split points."""
    n = len(widths)
    best, cut = [0] + [None] * n, [0] * (n + 1)
    for hi in range(1, n + 1):
        best[hi], cut[hi] = min((best[lo] + forward_cost + (hi - lo) * widths[hi - 1], lo) for lo in range(hi))
    out, hi = [], n
    while hi:
        out.append((cut[hi], hi))
        hi = cut[hi]
    return out[::-1]


def _gather_head(rows: Sequence[int], cols: Sequence[int]):
    """A forward pre-hook for the output layer that keeps the positions ``(rows[k], cols[k])``
    of the batch as one row, so that logits are formed there only: (1, len(rows), vocab)."""
    def hook(module, args):
        h = args[0]
        r, c = torch.tensor(rows, device=h.device), torch.tensor(cols, device=h.device)
        return (h[r, c][None],) + tuple(args[1:])

    return hook


class _Scorer:
    """Runs one model (with its quantization state active) on encoded examples."""

    def __init__(self, model: nn.Module, state: QuantState | None, forward, share: bool):
        self.model, self.forward, self.share = model, forward, share
        self.kv = state.kv if state is not None else None
        self.kw = cache_kwarg(model)
        self.tokens = 0
        self.device = input_device(model)  # None: accelerate's hooks place the inputs
        self.at = self.device or torch.device("cpu")  # where masks and positions are made
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def _cache(self):
        return make_cache(self.model.config, self.kv.on_write if self.kv else (lambda i, k, v: (k, v)))

    def _ids(self, rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
        """``rows`` right-padded to ``width`` (padding is never read by a real token: it comes
        after them, or is masked out)."""
        self.tokens += sum(len(r) for r in rows)
        return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], device=self.device)

    def plain(self, enc: Encoded) -> list[tuple[float, bool]]:
        """Each choice's full sequence on its own (lm-eval with batch size 1)."""
        out = []
        for ctx, cont in zip(enc.contexts, enc.continuations):
            ids = torch.tensor([(ctx + cont)[:-1]], device=self.device)
            self.tokens += ids.shape[1]
            logits = self.forward(ids)[0, len(ctx) - 1:].float()
            out.append(_gather(torch.log_softmax(logits, -1), cont))
        return out

    def batch(self, items: list[_Item]) -> list[list[tuple[float, bool]]]:
        """Score ``items`` together: the prefix all of them share once; each example's own
        prefix as a row of one right-padded batch, its logits formed at its last token only;
        then every choice's remaining tokens as a row of further batches (rows of similar widths
        together, :func:`_groups`), each on a copy of its example's cache row, logits formed at
        real positions only. Padding slots are masked out and positions count real tokens, so
        each row's numbers are those of its own sequence up to float rounding."""
        n = len(items)
        c = _shared_len([it.seqs[0][:it.p] for it in items], [it.seqs[0][:it.p - 1] for it in items]) if n > 1 else 0
        cache = self._cache()
        kw = {self.kw: cache, "use_cache": True}
        if c:
            self.model(input_ids=self._ids([items[0].seqs[0][:c]], c), logits_to_keep=1, **kw)
            cache.batch_repeat_interleave(n)
        heads = [it.seqs[0][c:it.p] for it in items]
        width = max(len(h) for h in heads)
        ids = self._ids(heads, width)
        padded = any(len(h) < width for h in heads)
        extra = {}
        if padded:
            mask = torch.ones(n, c + width, dtype=torch.long, device=self.at)
            for b, h in enumerate(heads):
                mask[b, c + len(h):] = 0
            extra = {"attention_mask": mask, "position_ids": torch.arange(c, c + width, device=self.at).expand(n, -1)}
        first = self._logits(ids, range(n), [len(h) - 1 for h in heads], kw, extra)  # (n, V)
        tails = sorted(((b, j, r) for b, it in enumerate(items) for j, r in enumerate(it.rest) if r),
                       key=lambda t: len(t[2]))
        more = {}
        groups = _groups([len(r) for _, _, r in tails])
        for g, (lo, hi) in enumerate(groups):
            part = tails[lo:hi]
            rows = [b for b, _, _ in part]
            run = cache if g == len(groups) - 1 else copy.deepcopy(cache)  # the last group may use it up
            run.reorder_cache(torch.tensor(rows, device=self.at))
            w2 = len(part[-1][2])
            if padded:
                extra = {"attention_mask": torch.cat([mask[rows], mask.new_ones(len(rows), w2)], 1),
                         "position_ids": torch.stack([torch.arange(items[b].p, items[b].p + w2, device=self.at)
                                                      for b in rows])}
            at = [(k, t) for k, (_, _, r) in enumerate(part) for t in range(len(r))]  # the real positions only
            logits = self._logits(self._ids([r for _, _, r in part], w2), [k for k, _ in at], [t for _, t in at],
                                  {**kw, self.kw: run}, extra)
            starts = list(itertools.accumulate((len(r) for _, _, r in part), initial=0))
            more.update({(b, j): logits[starts[k]:starts[k + 1]] for k, (b, j, _) in enumerate(part)})
        out = []
        for b, it in enumerate(items):
            res = []
            for j, (ctx, cont) in enumerate(zip(it.enc.contexts, it.enc.continuations)):
                # logits at positions p-1 .. len(s_j)-2; the continuation is predicted from len(ctx)-1 on
                rows_j = first[b:b + 1] if (b, j) not in more else torch.cat([first[b:b + 1], more[(b, j)]])
                res.append(_gather(torch.log_softmax(rows_j[len(ctx) - it.p:], -1), cont))
            out.append(res)
        return out

    def _logits(self, ids: torch.Tensor, rows, cols, kw: dict, extra: dict) -> torch.Tensor:
        """The model's logits at positions ``(rows[k], cols[k])`` of the batch ``ids``: (len(rows), V)."""
        hook = self.head.register_forward_pre_hook(_gather_head(list(rows), list(cols)), prepend=True)
        try:
            return self.model(input_ids=ids, logits_to_keep=0, **kw, **extra).logits[0].float()
        finally:
            hook.remove()


@torch.inference_mode()
def score_examples(model: nn.Module, tokenizer, examples: Sequence[Example], *, state: QuantState | None = None,
                   bos: bool = False, name: str = "", kind: str = "multiple_choice",
                   share_prefix: bool | None = None, progress: bool = False) -> TaskResult:
    """Score ``examples`` with ``model`` run through :func:`quantized_execution` (``state``:
    the activation and KV quantization of its recipe; weights are already quantized in place).

    ``share_prefix``: run each shared prefix once (default: whenever :func:`prefix_exact`);
    ``True`` where it is not exact is refused.
    """
    if share_prefix and not prefix_exact(state):
        raise ValueError("this recipe's scales depend on the whole forward; prefix sharing would change them")
    share = prefix_exact(state) if share_prefix is None else share_prefix
    t0 = time.perf_counter()
    encs = [encode_example(tokenizer, ex, bos=bos) for ex in examples]
    results: list[list[tuple[float, bool]] | None] = [None] * len(examples)
    with quantized_execution(model, state) as forward:
        scorer = _Scorer(model, state, forward, share)
        share = share and scorer.head is not None  # logits are formed through the output layer's input
        items, alone = [], []
        for i, enc in enumerate(encs):
            seqs = [c + t for c, t in zip(enc.contexts, enc.continuations)]
            p = _shared_len(seqs, enc.contexts) if share else 0
            if p:
                items.append(_Item(i, enc, seqs, p))
            else:
                alone.append(i)
        limits = _Limits(model.config)
        work = [[i] for i in alone] + _batches(items, limits)
        for unit in progress_bar(work, f"scoring {name}".strip(), enabled=progress):
            if isinstance(unit[0], int):
                results[unit[0]] = scorer.plain(encs[unit[0]])
                continue
            for it, res in zip(unit, scorer.batch(unit)):
                results[it.pos] = res
    scores = [ExampleScore(ex.index, ex.gold, tuple(r[0] for r in res), tuple(r[1] for r in res),
                           tuple(len(c) for c in enc.continuations), ex.choice_lengths, ex.subject)
              for ex, enc, res in zip(examples, encs, results)]
    task = examples[0].task if examples else ""
    return TaskResult(task, name, kind, tuple(scores), time.perf_counter() - t0, scorer.tokens, share)
