"""benchmarks/calib_mismatch.py --table: runs of one protocol merge into one table, rows ordered
(RTN first, then the evaluation corpora's order, mixtures last); runs of different protocols are refused."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import calib_mismatch  # noqa: E402


def _run(path: Path, cells: list[tuple[str, str, str, float]], windows: int = 32) -> Path:
    ref = {e: {"ppl": p, "tokens": 100} for e, p in (("wiki", 10.0), ("code", 5.0))}
    d = {"model": "m", "windows": windows, "seq_len": 512, "calib_windows": 64, "seed": 0, "reference": ref,
         "cells": [{"recipe": r, "calib": c, "eval": e,
                    "eval_result": {"delta_pct": kl * 100, "kl_mean": kl, "delta_ci": [0, 1], "kl_ci": [kl, kl],
                                    "top1": 0.5}} for r, c, e, kl in cells]}
    path.write_text(json.dumps(d))
    return path


def test_runs_merge_in_calibration_order(tmp_path):
    a = _run(tmp_path / "a.json", [("gptq", "code", "wiki", 0.3), ("gptq", "code", "code", 0.1),
                                  ("gptq", "wiki+code", "wiki", 0.2)])
    b = _run(tmp_path / "b.json", [("rtn", "none", "wiki", 0.5), ("gptq", "wiki", "wiki", 0.15),
                                  ("gptq", "wiki", "code", 0.4)])
    rows = calib_mismatch.table([a, b]).splitlines()[2:]
    assert [r.split(" | ")[:2] for r in rows] == [["| gptq", "wiki"], ["| gptq", "code"], ["| gptq", "wiki+code"],
                                                  ["| rtn", "— (RTN)"]]
    assert rows[0].endswith("+15.0% / 0.1500 | +40.0% / 0.4000 |")
    assert rows[2].endswith("+20.0% / 0.2000 | — |")  # a cell not measured


def test_runs_of_different_protocols_are_refused(tmp_path):
    a = _run(tmp_path / "a.json", [("gptq", "wiki", "wiki", 0.1)])
    b = _run(tmp_path / "b.json", [("gptq", "code", "wiki", 0.2)], windows=64)
    with pytest.raises(SystemExit, match="different protocols"):
        calib_mismatch.table([a, b])


def test_shares_of_the_rtn_kl_removed(tmp_path):
    a = _run(tmp_path / "a.json", [("rtn", "none", "wiki", 0.5), ("rtn", "none", "code", 0.4),
                                  ("gptq", "wiki", "wiki", 0.1), ("gptq", "wiki", "code", 0.3),
                                  ("gptq", "code", "wiki", 0.25), ("gptq", "code", "code", 0.1)])
    rows = calib_mismatch.shares([a], {"gptq": "rtn"}).splitlines()
    assert rows[0] == "| method | eval | wiki | code |"
    assert rows[2] == "| gptq | wiki | **80%** | 50% (2.50×) |"  # 1 − 0.25/0.5; 0.25 / matched 0.1
    assert rows[3] == "|  | code | 25% (3.00×) | **75%** |"
