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
choices' remaining tokens run as one batch on copies of that cache. The log-likelihoods are those
of the full sequences up to float rounding whenever quantization is token-local: weights,
static or per-token (per-group) activation scales, and KV scales that are static or per token.
Scales computed over a whole forward (dynamic per-tensor activations, dynamic per-tensor or
per-channel KV — KIVI keys) depend on which tokens share a forward, so such recipes are scored
one full sequence at a time, as lm-eval's batch size 1 does (:func:`prefix_exact`).
"""

from __future__ import annotations

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


class _Scorer:
    """Runs one model (with its quantization state active) on encoded examples."""

    def __init__(self, model: nn.Module, state: QuantState | None, forward, share: bool):
        self.model, self.forward, self.share = model, forward, share
        self.kv = state.kv if state is not None else None
        self.kw = cache_kwarg(model)
        self.tokens = 0
        self.device = input_device(model)  # None: accelerate's hooks place the inputs

    def _cache(self):
        return make_cache(self.model.config, self.kv.on_write if self.kv else (lambda i, k, v: (k, v)))

    def plain(self, enc: Encoded) -> list[tuple[float, bool]]:
        """Each choice's full sequence on its own (lm-eval with batch size 1)."""
        out = []
        for ctx, cont in zip(enc.contexts, enc.continuations):
            ids = torch.tensor([(ctx + cont)[:-1]], device=self.device)
            self.tokens += ids.shape[1]
            logits = self.forward(ids)[0, len(ctx) - 1:].float()
            out.append(_gather(torch.log_softmax(logits, -1), cont))
        return out

    def shared(self, enc: Encoded) -> list[tuple[float, bool]]:
        seqs = [c + t for c, t in zip(enc.contexts, enc.continuations)]
        p = min(len(c) for c in enc.contexts)
        for s in seqs[1:]:
            p = next((j for j, (a, b) in enumerate(zip(seqs[0][:p], s[:p])) if a != b), p)
        if p == 0:
            return self.plain(enc)
        cache = self._cache()
        self.tokens += p
        head = self.model(input_ids=torch.tensor([seqs[0][:p]], device=self.device), use_cache=True, logits_to_keep=1,
                          **{self.kw: cache}).logits[0, -1:].float()  # (1, V): predicts token p
        rest = [s[p:-1] for s in seqs]  # what each choice still reads
        width = max(len(r) for r in rest)
        tail = None
        if width:
            cache.batch_repeat_interleave(len(seqs))
            ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rest], device=self.device)  # right padding: causal
            self.tokens += sum(len(r) for r in rest)
            tail = self.model(input_ids=ids, use_cache=True, **{self.kw: cache}).logits.float()
        out = []
        for i, (ctx, cont) in enumerate(zip(enc.contexts, enc.continuations)):
            # logits at positions p-1 .. len(s_i)-2; the continuation is predicted from len(ctx)-1 on
            rows = head if tail is None else torch.cat([head, tail[i, :len(rest[i])]])
            out.append(_gather(torch.log_softmax(rows[len(ctx) - p:], -1), cont))
        return out


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
    scores = []
    with quantized_execution(model, state) as forward:
        scorer = _Scorer(model, state, forward, share)
        for ex in progress_bar(examples, f"scoring {name}".strip(), enabled=progress):
            enc = encode_example(tokenizer, ex, bos=bos)
            res = scorer.shared(enc) if share else scorer.plain(enc)
            scores.append(ExampleScore(ex.index, ex.gold, tuple(r[0] for r in res), tuple(r[1] for r in res),
                                       tuple(len(c) for c in enc.continuations), ex.choice_lengths, ex.subject))
    task = examples[0].task if examples else ""
    return TaskResult(task, name, kind, tuple(scores), time.perf_counter() - t0, scorer.tokens, share)
