"""Benchmark scoring on tiny models: lm-eval's tokenization of a request, the prefix-sharing scorer
against the plain one and against a direct computation, quantized execution, and the paired
statistics on known outcome vectors."""

import math

import numpy as np
import pytest
import torch

from lowbit.data.tasks import Example
from lowbit.evaluation import paired as P
from lowbit.evaluation.tasks import ExampleScore, encode_example, prefix_exact, score_examples
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import RECIPES, recipe_from_dict

TEXTS = ["Question: Which technology was developed most recently?\nAnswer: cellular telephone",
         "Sarah was a much better surgeon than Maria so Maria always got the easier cases.",
         "Roof shingle removal: A man is sitting on a roof. He starts pulling up roofing on a roof.",
         "The following are multiple choice questions about anatomy. A. B. C. D. Answer: A"] * 5


@pytest.fixture(scope="module")
def tokenizer(byte_bpe_tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(TEXTS), bos_token="<s>", eos_token="</s>")


def _model(kind: str, window: int = 8):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          tie_word_embeddings=True)
        return LlamaForCausalLM(cfg).eval()
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                           sliding_window=window, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           query_pre_attn_scalar=32)
    return Gemma3ForCausalLM(cfg).eval()


EXAMPLES = [
    Example("arc_easy", 0, tuple(("Question: Which technology was developed most recently?\nAnswer:", " " + c)
                                 for c in ["cellular telephone", "television", "refrigerator", "airplane"]),
            0, (18, 10, 12, 8)),
    Example("winogrande", 1, (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                              ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases.")),
            1, (28, 28)),
    Example("mmlu", 2, tuple(("about anatomy. A. B. C. D. Answer:", f" {c}") for c in "ABCD"), 2, (1, 1, 1, 1)),
    Example("lambada", 3, (("A man is sitting on a roof. He starts pulling up", " roofing"),), 0, (8,)),
    Example("hellaswag", 4, (("Roof shingle removal: A man is sitting on a roof. He", " starts pulling up roofing."),
                             ("Roof shingle removal: A man is sitting on a roof. He", " is"),
                             ("Roof shingle removal: A man is sitting on a roof. He", " x")), 2, (26, 2, 1)),
]


def test_encoding_moves_trailing_spaces_and_splits_the_joint_tokenization(tokenizer):
    ex = Example("t", 0, (("Answer: ", "A"), ("Answer:", " B")), 0, (1, 1))
    enc = encode_example(tokenizer, ex)
    ctx = tokenizer.encode("Answer:")
    assert enc.contexts == (tuple(ctx), tuple(ctx))  # "Answer: " + "A" is scored as "Answer:" + " A"
    assert enc.continuations[0] == tuple(tokenizer.encode("Answer: A")[len(ctx):])
    assert enc.continuations[1] == tuple(tokenizer.encode("Answer: B")[len(ctx):])
    bos = encode_example(tokenizer, ex, bos=True)
    assert bos.contexts[0] == (tokenizer.bos_token_id, *ctx) and bos.continuations == enc.continuations


def _direct(model, tokenizer, ex: Example) -> list[float]:
    """The log-likelihood of each choice from one forward over its whole sequence."""
    out = []
    enc = encode_example(tokenizer, ex)
    for ctx, cont in zip(enc.contexts, enc.continuations):
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        out.append(sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont)))
    return out


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_prefix_sharing_equals_plain_and_direct(kind, tokenizer):
    model = _model(kind)  # gemma3: sliding window 8, shorter than these contexts
    shared = score_examples(model, tokenizer, EXAMPLES)
    plain = score_examples(model, tokenizer, EXAMPLES, share_prefix=False)
    assert shared.shared_prefix and not plain.shared_prefix
    assert shared.forward_tokens < plain.forward_tokens
    for a, b, ex in zip(shared.examples, plain.examples, EXAMPLES):
        np.testing.assert_allclose(a.loglik, b.loglik, rtol=0, atol=1e-4)
        np.testing.assert_allclose(b.loglik, _direct(model, tokenizer, ex), rtol=0, atol=1e-4)
        assert a.greedy == b.greedy and a.tokens == b.tokens and a.gold == ex.gold


HEADER = "The following are multiple choice questions (with answers) about anatomy.\n\n"
SUBJECT = [Example("mmlu", 10 + i, tuple((HEADER + q + "\nAnswer:", f" {c}") for c in "ABCD"), i % 4, (1, 1, 1, 1))
           for i, q in enumerate(["Which technology was developed most recently?", "A man is sitting on a roof.",
                                  "Sarah was a much better surgeon than Maria?", "He starts pulling up roofing."])]


def _forwards(model):
    """A list that grows by the batch size of each forward of ``model``."""
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True)
    return calls


@pytest.mark.parametrize("kind", ["llama", "gemma3-window-200"])
def test_examples_batched_with_padding_equal_plain_and_direct(kind, tokenizer):
    """Several examples' prefixes of different lengths run as one right-padded batch (their common
    header once), and their choices as a second one; each log-likelihood is its own sequence's.
    Gemma-3's sliding window (200) is longer than every padded row, so batches form there too."""
    model = _model("llama") if kind == "llama" else _model("gemma3", window=200)
    examples = EXAMPLES + SUBJECT
    calls = _forwards(model)
    shared = score_examples(model, tokenizer, examples)
    batched_calls = list(calls)
    plain = score_examples(model, tokenizer, examples, share_prefix=False)
    assert max(batched_calls) > 1 and len(batched_calls) < len(examples)  # examples did share forwards
    assert shared.forward_tokens < plain.forward_tokens
    for a, b, ex in zip(shared.examples, plain.examples, examples):
        assert a.index == ex.index
        np.testing.assert_allclose(a.loglik, b.loglik, rtol=0, atol=1e-4)
        np.testing.assert_allclose(a.loglik, _direct(model, tokenizer, ex), rtol=0, atol=1e-4)
        assert a.greedy == b.greedy and a.tokens == b.tokens


@pytest.mark.parametrize("kind", ["llama", "gemma3-window-200"])
def test_a_common_header_runs_once(kind, tokenizer):
    """Four questions of one subject: their shared header is read once, not four times, and the
    padded rows after it still score as their own sequences (positions continue from it)."""
    model = _model("llama") if kind == "llama" else _model("gemma3", window=200)
    one = [score_examples(model, tokenizer, [ex]).forward_tokens for ex in SUBJECT]
    together = score_examples(model, tokenizer, SUBJECT)
    header = len(tokenizer.encode(HEADER)) - 1  # at least this much of it is one token sequence in all four
    assert together.forward_tokens <= sum(one) - 3 * header
    for a, ex in zip(together.examples, SUBJECT):
        np.testing.assert_allclose(a.loglik, _direct(model, tokenizer, ex), rtol=0, atol=1e-4)


def test_batches_respect_the_sliding_window(tokenizer):
    """Padding takes cache slots that a sliding window counts, so with a window shorter than the
    padded rows every example runs alone (Gemma-3 with window 8; the equality test above covers
    the scores)."""
    model = _model("gemma3", window=8)
    calls = _forwards(model)
    score_examples(model, tokenizer, EXAMPLES + SUBJECT)
    assert max(calls) <= 4  # at most one example's choices in a forward


def test_choice_groups_are_the_cheapest_split():
    """The split of the choices' rows into forwards is the exact minimum of padded tokens plus a
    cost per forward, against every split tried by brute force."""
    import itertools

    from lowbit.evaluation.tasks import _groups

    def cost(widths, runs, fc):
        return sum(fc + (hi - lo) * widths[hi - 1] for lo, hi in runs)

    rng = np.random.default_rng(0)
    for _ in range(30):
        widths = sorted(rng.integers(1, 40, size=int(rng.integers(1, 9))).tolist())
        fc = int(rng.integers(0, 30))
        runs = _groups(widths, fc)
        assert runs[0][0] == 0 and runs[-1][1] == len(widths) and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        n = len(widths)
        brute = min(cost(widths, list(zip((0,) + cuts, cuts + (n,))), fc)
                    for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert cost(widths, runs, fc) == brute


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "w4a16-int4-g128", "kv-int4-token"])
def test_prefix_sharing_is_exact_for_token_local_quantization(recipe, tokenizer):
    model = _model("llama")
    r = RECIPES.get(recipe) or recipe_from_dict({"name": recipe, "kv_cache": {
        "scheme": {"format": "int4", "granularity": "token", "dynamic": True}}})
    state = quantize(model, r, progress=False)
    assert prefix_exact(state)
    shared = score_examples(model, tokenizer, EXAMPLES, state=state)
    plain = score_examples(model, tokenizer, EXAMPLES, state=state, share_prefix=False)
    assert shared.shared_prefix
    for a, b in zip(shared.examples, plain.examples):
        np.testing.assert_allclose(a.loglik, b.loglik, rtol=0, atol=1e-4)


def test_kv_quantization_reaches_the_scores(tokenizer):
    """The KV cache of the recipe applies: per-token INT2 keys and values change every score."""
    model = _model("llama")
    ref = score_examples(model, tokenizer, EXAMPLES)
    r = recipe_from_dict({"name": "kv-int2", "kv_cache": {"scheme": {"format": "int2", "granularity": "token",
                                                                      "dynamic": True}}})
    state = quantize(model, r, progress=False)
    q = score_examples(model, tokenizer, EXAMPLES, state=state)
    assert all(abs(a - b) > 1e-3 for x, y in zip(ref.examples, q.examples) for a, b in zip(x.loglik, y.loglik))


def test_chunk_dependent_kv_scales_are_scored_whole(tokenizer):
    model = _model("llama")
    state = quantize(model, RECIPES["kv-int4-kivi"], progress=False)  # keys scaled per channel over the tokens
    assert not prefix_exact(state)
    res = score_examples(model, tokenizer, EXAMPLES[:2], state=state)
    assert not res.shared_prefix
    with pytest.raises(ValueError, match="prefix sharing"):
        score_examples(model, tokenizer, EXAMPLES[:2], state=state, share_prefix=True)


def test_acc_and_acc_norm():
    e = ExampleScore(0, 1, (-4.0, -6.0, -9.0), (False, True, False), (2, 3, 4), (2, 6, 3))
    assert e.pred == 0 and not e.correct("acc")
    assert e.pred_norm == 1 and e.correct("acc_norm")  # -6/6 = -1 beats -4/2 = -2 and -9/3 = -3
    assert e.correct("greedy")
    assert ExampleScore.from_dict(e.to_dict()) == e


# ----------------------------------------------------------------------------------------------
# Paired statistics


def test_flips_counts():
    r = [1, 1, 1, 0, 0, 1, 0]
    q = [1, 0, 0, 1, 0, 1, 1]
    f = P.flips(r, q)
    assert (f.right_to_wrong, f.wrong_to_right, f.n) == (2, 2, 7)
    assert f.fraction == pytest.approx(4 / 7)
    with pytest.raises(ValueError):
        P.flips([1, 0], [1])


@pytest.mark.parametrize("b, c, p", [
    (1, 5, 2 * (1 + 6) / 2 ** 6),  # 2·(C(6,0) + C(6,1)) / 2^6 = 0.21875
    (0, 10, 2 / 2 ** 10),
    (3, 3, 1.0),  # 2·P(X ≤ 3) > 1 is capped
    (0, 0, 1.0),
    (2, 7, 2 * (1 + 9 + 36) / 2 ** 9),
])
def test_mcnemar_exact_by_hand(b, c, p):
    assert P.mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    assert P.mcnemar_exact(c, b) == pytest.approx(p, rel=1e-12)


def test_mcnemar_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(12, 30), (100, 131), (7, 0)]:
        assert P.mcnemar_exact(b, c) == pytest.approx(stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


def test_mcnemar_large_counts_by_hand():
    # b = 40, c = 60: the exact binomial tail summed with integers
    tail = sum(math.comb(100, i) for i in range(41)) / 2 ** 100
    assert P.mcnemar_exact(40, 60) == pytest.approx(2 * tail, rel=1e-10)


def test_choice_kl():
    same = [(-1.0, -2.0), (-0.5, -3.0)]
    assert P.choice_kl(same, same) == pytest.approx(0.0, abs=1e-12)
    shifted = [(-1.0 + 5, -2.0 + 5), (-0.5, -3.0)]  # softmax ignores a common shift
    assert P.choice_kl(same, shifted) == pytest.approx(0.0, abs=1e-12)
    ref, other = [(math.log(0.5), math.log(0.5))], [(math.log(0.25), math.log(0.75))]
    assert P.choice_kl(ref, other) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    assert P.choice_kl([(-1.0,)], [(-2.0,)]) is None


def test_paired_accuracy():
    rng = np.random.default_rng(0)
    r = rng.random(400) < 0.6
    q = r.copy()
    q[:40] = ~q[:40]  # 40 flips
    res = P.paired_accuracy("acc", r, q, bootstrap=500, seed=0)
    assert res.n == 400 and res.flips.right_to_wrong + res.flips.wrong_to_right == 40
    assert res.delta == pytest.approx(q.mean() - r.mean())
    assert res.delta_ci[0] <= res.delta <= res.delta_ci[1]
    assert res.accuracy_ci[0] <= res.accuracy <= res.accuracy_ci[1]
    # paired: Δ's interval is far narrower than the difference of two independent accuracies' spreads
    assert res.delta_ci[1] - res.delta_ci[0] < (res.accuracy_ci[1] - res.accuracy_ci[0])
    same = P.paired_accuracy("acc", r, r)
    assert same.delta == 0 and same.delta_ci == (0.0, 0.0) and same.mcnemar_p == 1.0


# ----------------------------------------------------------------------------------------------
# The comparison behind `--tasks`


def test_task_comparison_pairs_each_config_with_a_cached_reference(tokenizer, tmp_path, monkeypatch):
    import json as _json

    from lowbit.evaluation import task_compare as TC
    from lowbit.evaluation.compare import Workbench
    from lowbit.models.loading import ModelInfo
    from lowbit.report.tasks import tasks_table

    by_task = {"arc_easy": [EXAMPLES[0], EXAMPLES[4]], "lambada": [EXAMPLES[3]]}
    monkeypatch.setattr(TC, "load_task", lambda t, **kw: [dataclasses_replace(e, task=t) for e in by_task[t]])
    model = _model("llama")
    w0 = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    bench = Workbench(model, tokenizer, ModelInfo("tiny", tmp_path, False, ""), torch.zeros(0, 8, dtype=torch.long),
                      torch.zeros(0, 8, dtype=torch.long), "none", 0, tmp_path, progress=False)
    configs = [TC.TaskConfig("as-is", None, model), TC.TaskConfig("int2-w", recipe_from_dict(
        {"name": "int2-w", "weights": {"format": "int2", "granularity": "channel"}}))]
    cmp = TC.task_comparison(bench, configs, "arc_easy,lambada", bootstrap=200)
    assert [r.label for r in cmp.rows] == ["reference", "as-is", "int2-w"]
    same = cmp.rows[1].paired["arc_easy"]
    assert [p.metric for p in same] == ["acc", "acc_norm"]
    assert all(p.delta == 0 and p.flips.fraction == 0 and p.choice_kl == pytest.approx(0, abs=1e-8) for p in same)
    assert cmp.rows[2].paired["arc_easy"][0].choice_kl > 1e-4  # 2-bit weights move the choice distribution
    (lam,) = cmp.rows[2].paired["lambada"]
    assert lam.metric == "acc" and lam.choice_kl is None
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, w0)  # a copy was quantized, not the model
    cached = sorted((tmp_path / "task-references").glob("tiny-*.json"))
    assert len(cached) == 2
    monkeypatch.setattr(TC, "score_examples", lambda *a, **k: pytest.fail("the reference was not cached"))
    again = TC.task_comparison(bench, [], "arc_easy,lambada")
    assert again.rows[0].results == cmp.rows[0].results
    d = _json.loads(_json.dumps(cmp.to_dict()))
    assert d["rows"][2]["results"]["arc_easy"]["examples"][0]["loglik"]  # per-example outcomes kept
    assert tasks_table(cmp).row_count == 2 * 3 + 3
    # the headline drop: acc_norm for arc_easy (lm-eval reports it), acc for lambada; 0 for an identical model
    int2 = cmp.rows[2]
    assert [TC.headline_metric(t) for t in ("arc_easy", "lambada")] == ["acc_norm", "acc"]
    assert cmp.rows[1].headline_drop() == 0.0 and cmp.rows[0].headline_drop() == 0.0
    want = -100 * (int2.paired["arc_easy"][1].delta + int2.paired["lambada"][0].delta) / 2
    assert int2.headline_drop() == pytest.approx(want)
    # a recipe's scores are cached per task: scored again, nothing is computed and the results are equal
    assert len(list((tmp_path / "task-rows").glob("tiny-int2-w-*.json"))) == 2
    cached_again = TC.task_comparison(bench, configs[1:], "arc_easy,lambada", bootstrap=200)
    assert cached_again.rows[1].results == int2.results and cached_again.rows[1].paired == int2.paired
    assert cached_again.rows[1].quantize_seconds == 0.0
    # another recipe is a different key: it is scored (and here fails loudly, as patched)
    other = TC.TaskConfig("int3-w", recipe_from_dict({"name": "int3-w", "weights": {"format": "int3",
                                                                                       "granularity": "channel"}}))
    with pytest.raises(pytest.fail.Exception, match="not cached"):
        TC.task_comparison(bench, [other], "arc_easy,lambada")


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)
