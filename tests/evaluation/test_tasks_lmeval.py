"""Slow tier: lowbit's reference scores equal lm-evaluation-harness 0.4.13's, example by example, on
the real SmolLM2-135M and the first rows of several tasks.

lm-eval lives in its own venv (``make lmeval-venv`` builds ``.venv-lmeval``; ``make test-lmeval``
builds it and runs this file); ``benchmarks/tasks_speed.py`` runs both scorers in that venv, on the
same model object, task definitions (lm-eval's own YAMLs, pointed at the fetched rows) and rows.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-lmeval" / "bin" / "python"
TASKS = "arc_easy,hellaswag,winogrande,boolq,mmlu,lambada"


@pytest.mark.slow
def test_reference_scores_equal_lm_eval(tmp_path):
    if not PYTHON.exists():
        pytest.skip("lm-eval's venv is missing: run `make lmeval-venv`")
    from lowbit.data.tasks import fetch_tasks
    from lowbit.models.assets import fetch

    fetch("smollm2-135m")
    fetch_tasks()
    out = tmp_path / "speed.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([str(PYTHON), str(ROOT / "benchmarks" / "tasks_speed.py"), "--limit", "6", "--tasks", TASKS,
                    "--json", str(out)], check=True, env=env, cwd=ROOT, timeout=3000)
    report = json.loads(out.read_text())
    assert set(report["tasks"]) == set(TASKS.split(","))
    for task, r in report["tasks"].items():
        n = r["examples"]
        assert n == (12 if task == "mmlu" else 6), task  # MMLU: 6 rows of each of two subjects
        assert r["max_abs_loglik_diff"] < 1e-4, task
        assert r["same_acc_pred"] == r["same_acc_norm_pred"] == r["same_greedy"] == n, task
