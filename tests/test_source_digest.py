"""Cache keys cover the code that computes a result, and only that code (``lowbit._version.source_digest``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit._version import _closure, source_digest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"


def _rel(paths) -> set[str]:
    return {str(p.relative_to(SRC)) for p in paths}


def test_closure_follows_imports_and_stops_at_the_stage():
    rows = _rel(_closure(("lowbit.evaluation.rowcache", "lowbit.evaluation.compare")))
    # what computes a row: the quantizer, its algorithms (imported inside functions), the numerics, the loader
    for must in ("evaluation/workbench.py", "quantization/pipeline.py", "quantization/algorithms/gptq.py",
                 "numerics/qtensor.py", "models/loading.py", "util/parallel.py"):
        assert must in rows, must
    assert not any(p.startswith(("cli/", "report/", "planning/", "sim/", "engines/")) for p in rows), rows
    capacity = _rel(_closure(("lowbit.planning.capacity",)))
    assert "sim/engine.py" in capacity and "sim/gpus.yaml" in capacity  # the GPU table is data the simulator reads
    assert not any(p.startswith(("evaluation/", "quantization/", "cli/")) for p in capacity), capacity


def test_unknown_module_is_an_error():
    with pytest.raises(ValueError, match="no lowbit module 'lowbit.nonesuch'"):
        source_digest("lowbit.nonesuch")


def _digests(root: Path) -> tuple[str, str]:
    code = ("from lowbit._version import source_digest as d; "
            "print(d('lowbit.evaluation.rowcache', 'lowbit.evaluation.compare'), d())")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], out[1]


def test_a_change_outside_the_closure_keeps_the_key_and_one_inside_changes_it(tmp_path):
    shutil.copytree(SRC, tmp_path / "lowbit", ignore=shutil.ignore_patterns("__pycache__"))
    rows0, all0 = _digests(tmp_path)
    with open(tmp_path / "lowbit" / "report" / "tables.py", "a") as f:
        f.write("\nWORDING = 'a report changed'\n")
    rows1, all1 = _digests(tmp_path)
    assert rows1 == rows0 and all1 != all0
    rounding = tmp_path / "lowbit" / "quantization" / "rounding.py"
    text = rounding.read_text()
    first = text.index('"""', text.index('"""') + 3)  # the end of the module docstring
    rounding.write_text(text[:first] + " (reworded)" + text[first:] + "\n# a comment\n")
    rows2, _ = _digests(tmp_path)
    assert rows2 == rows0  # prose is not code
    with open(rounding, "a") as f:
        f.write("\nROUNDING_CHANGED = True\n")
    rows3, _ = _digests(tmp_path)
    assert rows3 != rows0
