"""GSM8K: lm-eval's answer filters and exact match, and greedy decoding through the quantized
model and cache — equal to transformers' own greedy generation when nothing is quantized, and to
a full recomputation of every step when something is."""

import gzip
import json

import pytest
import torch

from lowbit.data.tasks import TASKS, Example, _gsm8k
from lowbit.evaluation.generate import exact_match, extract_answers, generate_examples, greedy_generate
from lowbit.evaluation.task_compare import headline_metric
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict
from lowbit.quantization.runtime import quantized_execution

TEXTS = ["Question: Olivia has $23. She bought five bagels for $3 each.\nAnswer: 5 x 3 = 15. So the answer is 8.",
         "Question: There are 15 trees. How many were planted?\nAnswer: 21 - 15 = 6. So the answer is 6."] * 10


@pytest.fixture(scope="module")
def tokenizer(byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(TEXTS), bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny Llama with the tokenizer's vocabulary (300)."""
    from tinymodels import tiny_llama

    return tiny_llama(vocab_size=300, max_positions=256)


@pytest.mark.parametrize("text, strict, flexible", [
    ("21 - 15 = 6. So the answer is 6.", "6.", "6."),
    ("It costs $1,200 in all. The answer is 1,200", "1,200", "1,200"),
    ("5 x 3 = 15 and then 23 - 15 = 8", "[invalid]", "8"),
    ("no number at all", "[invalid]", "[invalid]"),
    ("So the answer is -3.5.", "-3.5.", "-3.5."),
])
def test_the_two_filters(text, strict, flexible):
    assert extract_answers(text) == (strict, flexible)


def test_exact_match_ignores_what_lm_eval_ignores():
    assert exact_match("$1,200.", "1200") and exact_match("#### 18", "18") and exact_match("6.", "6")
    assert not exact_match("[invalid]", "6") and not exact_match("16", "6")


def test_rows_load_with_their_answer(tmp_path):
    path = tmp_path / "requests.jsonl.gz"
    rows = [{"doc": {"short_answer": str(i)}, "request": {"context": f"Question: q{i}\nAnswer:"}} for i in range(3)]
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    ex = _gsm8k(TASKS["gsm8k"], path, limit=2)
    assert [e.answer for e in ex] == ["0", "1"] and ex[1].requests == (("Question: q1\nAnswer:", ""),)
    assert headline_metric("gsm8k") == "strict-match" and headline_metric("winogrande") == "acc"


def test_greedy_equals_transformers_generate(tiny_llama, tokenizer):
    prompt = tokenizer(TEXTS[0][:40], add_special_tokens=False)["input_ids"]
    _, ids = greedy_generate(tiny_llama, tokenizer, prompt, max_new=12, stop=())
    with torch.inference_mode():
        ref = tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert ids == ref[:len(ids)] and len(ids) >= 1


def _recomputed(model, state, prompt, n):
    """The greedy chain by a full forward over the whole sequence at every step (no cache reuse)."""
    seq = list(prompt)
    with torch.inference_mode(), quantized_execution(model, state) as fwd:
        for _ in range(n):
            seq.append(int(fwd(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "kv-token-int4"])
def test_decoding_with_the_cache_equals_full_recomputation(tiny_llama, tokenizer, recipe):
    """Token-local quantization (per-token activations; a KV cache quantized per token) gives
    the same tokens whether each step reads the cache or recomputes the whole sequence."""
    import copy

    model = copy.deepcopy(tiny_llama)
    if recipe == "kv-token-int4":
        s = {"format": "uint4", "granularity": "token", "symmetric": False, "dynamic": True, "scale_dtype": "fp16"}
        r = recipe_from_dict({"name": recipe, "kv_cache": {"scheme": s}}, recipe)
    else:
        r = RECIPES[recipe]
    state = quantize(model, r, None, progress=False)
    prompt = tokenizer(TEXTS[1][:30], add_special_tokens=False)["input_ids"]
    _, ids = greedy_generate(model, tokenizer, prompt, state, max_new=10, stop=())
    assert ids == _recomputed(model, state, prompt, len(ids))


def test_a_kv_window_is_refused_for_generation(tiny_llama, tokenizer):
    import copy

    model = copy.deepcopy(tiny_llama)
    state = quantize(model, RECIPES["kv-int4-kivi-r128"], None, progress=False)
    with pytest.raises(NotImplementedError, match="full-precision KV window"):
        greedy_generate(model, tokenizer, [1, 2, 3], state, max_new=2)


def test_examples_are_scored_by_both_filters(tiny_llama, tokenizer, monkeypatch):
    import lowbit.evaluation.generate as G

    outputs = iter([" 5 x 3 = 15. So the answer is 8.", " 21 - 15 = 6. So the answer is 7, not 6"])
    monkeypatch.setattr(G, "greedy_generate", lambda m, t, p, s=None, max_new=0: (next(outputs), [1, 2]))
    ex = [Example("gsm8k", 0, (("Question: a\nAnswer:", ""),), 0, (), answer="8"),
          Example("gsm8k", 1, (("Question: b\nAnswer:", ""),), 0, (), answer="6")]
    res = generate_examples(tiny_llama, tokenizer, ex, name="ref")
    assert [e.greedy for e in res.examples] == [(True, True), (False, True)]
    assert res.metric("strict-match") == 0.5 and res.metric("flexible-extract") == 1.0
    assert res.examples[1].output.endswith("not 6") and res.kind == "generate"
    again = type(res).from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.examples[1].output == res.examples[1].output
