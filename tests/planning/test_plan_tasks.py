"""``lowbit plan --max-task-drop``: the budget read off benchmark scores (tiny Llama, a trained
byte-level tokenizer, a few real-format questions), the task column, and the task-row cache
that makes re-planning score nothing twice."""

import json

import pytest
import torch

from lowbit.cli import main
from lowbit.data.tasks import Example
from lowbit.evaluation import task_compare as TC
from lowbit.evaluation.compare import Workbench
from lowbit.models.loading import ModelInfo
from lowbit.planning import Budget, Target, parse_candidate, plan
from lowbit.report.plan import TASK_COLUMN, markdown, plan_table

TEXTS = ["Question: Which technology was developed most recently?\nAnswer: cellular telephone",
         "Sarah was a much better surgeon than Maria so Maria always got the easier cases."] * 5

QUESTIONS = {
    "arc_easy": [Example("arc_easy", i, tuple((f"Question: Which technology came {w}?\nAnswer:", " " + c)
                                              for c in ["cellular telephone", "television", "refrigerator"]),
                         i % 3, (18, 10, 12)) for i, w in enumerate(["first", "last", "next", "later"])],
    "winogrande": [Example("winogrande", i, ((f"Sarah was a much better surgeon than Maria so {a}",
                                              " always got the easier cases."),
                                             (f"Sarah was a much better surgeon than Maria so {b}",
                                              " always got the easier cases.")), i % 2, (28, 28))
                   for i, (a, b) in enumerate([("Sarah", "Maria"), ("Maria", "Sarah"), ("she", "he")])],
}

NAMES = ["bf16", "fp8-dynamic", "w4a16-int4-tensor"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory, byte_bpe_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("plan-tasks")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256, tie_word_embeddings=True)).eval()
    model.config.save_pretrained(tmp / "model")
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_bpe_tokenizer(TEXTS), bos_token="<s>", eos_token="</s>")
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 300, (4, 24), generator=g)
    return Workbench(model, tok, ModelInfo("tiny-llama", tmp / "model", False, ""), windows, windows[:2],
                     "synthetic", 0, tmp / "cache", kl_topk=64, progress=False, workers=1)


@pytest.fixture
def questions(monkeypatch):
    monkeypatch.setattr(TC, "load_task", lambda t, **kw: QUESTIONS[t])


def _plan(bench, load, limit):
    target = Target.of("h100", 1, bench.info.path, "llama-3.1-8b")
    return plan(bench, [parse_candidate(n) for n in NAMES], target, load, Budget("task", limit), progress=False,
                tasks="arc_easy,winogrande")


def test_task_budget_reads_the_headline_drop_and_is_respected(bench, load, questions, monkeypatch):
    free = _plan(bench, load, 1e9)
    assert free.tasks == {"tasks": ["arc_easy", "winogrande"], "limit": None, "examples": {"arc_easy": 4,
                                                                                           "winogrande": 3}}
    for o in free.options:
        assert o.tasks is not None and o.loss == o.tasks.headline_drop()
    assert free.option("bf16").loss == 0.0 and not free.option("bf16").tasks.paired  # the reference itself
    losses = sorted({o.loss for o in free.options})
    for limit in losses:
        r = _plan(bench, load, limit)
        ok = {o.candidate.name for o in r.options if o.capacity.fits and o.loss <= limit}
        assert set(r.recommendation.eligible) == ok and r.option(r.recommendation.pick).loss <= limit
    # the column and the page say what the number is
    assert TASK_COLUMN in [c.header for c in plan_table(free).columns]
    page = markdown(free, {})
    assert TASK_COLUMN in page and "acc_norm where the task has it" in page
    d = json.loads(json.dumps(free.to_dict(), default=float))
    assert d["tasks"]["examples"] == {"arc_easy": 4, "winogrande": 3}
    assert d["options"][1]["tasks"]["headline_drop_points"] == free.options[1].loss
    # planned again (another SLO, another GPU: same accuracy), every score is read from the caches
    monkeypatch.setattr(TC, "score_examples", lambda *a, **k: pytest.fail("a task score was recomputed"))
    again = _plan(bench, load, 1e9)
    assert [o.loss for o in again.options] == [o.loss for o in free.options]


def test_task_budget_needs_tasks(bench, load):
    target = Target.of("h100", 1, bench.info.path, "llama-3.1-8b")
    with pytest.raises(ValueError, match="needs the tasks to score"):
        plan(bench, [parse_candidate("bf16")], target, load, Budget("task", 1.0), progress=False)


@pytest.mark.parametrize("extra, message", [
    (["--max-task-drop", "lots"], "--max-task-drop: expected accuracy points"),
    (["--max-task-drop", "1", "--tasks", "arc_eazy"], "arc_eazy"),
    (["--tasks", "hellaswag", "--limit", "0"], "--limit must be positive"),
])
def test_bad_task_options_fail_before_loading(extra, message, capsys):
    assert main(["plan", "no-such-model-anywhere", "--gpu", "h100", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowbit plan: error: ") and message in err


def test_budget_parsing():
    assert Budget.max_task_drop("1.5") == Budget("task", 1.5) == Budget.max_task_drop("1.5 pts")
    assert Budget("task", 2).fmt(1.25) == "-1.25 pts"
    with pytest.raises(ValueError, match="not a perplexity row"):
        Budget("task", 1).loss(None)
