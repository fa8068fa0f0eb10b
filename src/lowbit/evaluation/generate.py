"""Generative benchmarks (GSM8K): greedy decoding with every part of a recipe applied, and
exact match of the final number, as lm-evaluation-harness 0.4.13 scores ``gsm8k``.

Decoding runs the quantized model with its activation hooks and, for a KV recipe, the cache
that quantizes at every write (:func:`lowbit.quantization.kv.make_cache`): the prompt is one
prefill, then one token per step reads the quantized cache — what a serving engine computes.
Generation stops at the first stop string (the prompt's "Question:" separator, "\\n\\n", "</s>",
"<|im_end|>") or after ``max_new`` tokens.

The answer is read two ways, lm-eval's two filters: ``strict-match``, the number after "the
answer is" (the phrase the prompt's worked examples end with — lm-eval's ``gsm8k_cot`` pattern;
its plain ``gsm8k`` looks for "#### N", which these exemplars never write), and
``flexible-extract``, the last number in the text.  Both are compared with the reference answer
after lm-eval's ``regexes_to_ignore`` (",", "$", "(?s).*#### ", a final ".") and case folding.
"""

from __future__ import annotations

import re
import time
from typing import Sequence

import torch
from torch import nn

from ..data.tasks import Example
from ..quantization.kv import cache_kwarg, make_cache
from ..quantization.runtime import QuantState, input_device, quantized_activations
from ..util.progress import progress_bar
from .tasks import ExampleScore, TaskResult

__all__ = ["STOP", "MAX_NEW_TOKENS", "greedy_generate", "extract_answers", "exact_match", "generate_examples"]

#: the stop strings of the prompt format (the wheel's request and lm-eval's ``until``)
STOP = ("Question:", "</s>", "<|im_end|>", "\n\n")
#: lm-eval's default ``max_gen_toks``
MAX_NEW_TOKENS = 256

_STRICT = re.compile(r"the answer is (\-?[0-9\.\,]+)", re.IGNORECASE)
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _normalize(text: str) -> str:
    for pattern in _IGNORE:
        text = re.sub(pattern, "", text)
    return text.strip().lower()


def extract_answers(text: str) -> tuple[str, str]:
    """``(strict, flexible)``: the number after "the answer is" (first match), and the last
    number of ``text``; ``"[invalid]"`` where there is none (lm-eval's fallback)."""
    strict = _STRICT.search(text)
    flex = _FLEXIBLE.findall(text)
    last = next((g for g in flex[-1] if g), "") if flex else ""
    return (strict.group(1) if strict else "[invalid]"), (last or "[invalid]")


def exact_match(prediction: str, answer: str) -> bool:
    return _normalize(prediction) == _normalize(answer)


@torch.inference_mode()
def greedy_generate(model: nn.Module, tokenizer, prompt: Sequence[int], state: QuantState | None = None, *,
                    max_new: int = MAX_NEW_TOKENS, stop: Sequence[str] = STOP) -> tuple[str, list[int]]:
    """Greedy continuation of the token ids ``prompt``: ``(text up to the first stop string,
    the generated ids)``; ends at the tokenizer's EOS too."""
    kv = state.kv if state is not None else None
    if kv is not None and kv.config.residual:
        raise NotImplementedError("generation with a full-precision KV window (residual) is not modelled: "
                                  "decoding would keep only the newest token exact; use the recipe without it")
    cache = make_cache(model.config, kv.on_write if kv is not None else (lambda layer, k, v: (k, v)))
    kw = {cache_kwarg(model): cache, "use_cache": True}
    dev = input_device(model)
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=dev)  # dev None: the CPU (dispatched models)
    out: list[int] = []
    with quantized_activations(model, state.activations if state is not None else {}):
        logits = model(input_ids=ids, **kw).logits[0, -1]
        for _ in range(max_new):
            tok = int(logits.argmax())
            if tok == tokenizer.eos_token_id:
                break
            out.append(tok)
            text = tokenizer.decode(out)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:
                return text[:cut], out
            step = torch.tensor([[tok]], dtype=torch.long, device=dev)
            logits = model(input_ids=step, **kw).logits[0, -1]
    return tokenizer.decode(out), out


def generate_examples(model: nn.Module, tokenizer, examples: Sequence[Example], *, state: QuantState | None = None,
                      bos: bool = False, name: str = "", max_new: int = MAX_NEW_TOKENS,
                      progress: bool = False) -> TaskResult:
    """Each example's prompt decoded greedily and scored: per example ``greedy`` holds
    (strict-match correct, flexible-extract correct), ``tokens`` the generated count and
    ``output`` the text."""
    t0 = time.perf_counter()
    scores, read = [], 0
    for ex in progress_bar(examples, f"generating {name}".strip(), enabled=progress):
        prompt = tokenizer(ex.requests[0][0], add_special_tokens=False)["input_ids"]
        if bos and tokenizer.bos_token_id is not None:
            prompt = [tokenizer.bos_token_id, *prompt]
        text, new = greedy_generate(model, tokenizer, prompt, state, max_new=max_new)
        strict, flexible = extract_answers(text)
        read += len(prompt) + len(new)
        scores.append(ExampleScore(ex.index, 0, (), (exact_match(strict, ex.answer), exact_match(flexible, ex.answer)),
                                   (len(new),), (), ex.subject, output=text))
    task = examples[0].task if examples else ""
    return TaskResult(task, name, "generate", tuple(scores), time.perf_counter() - t0, read, False)
