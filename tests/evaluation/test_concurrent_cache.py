"""Two ``lowbit compare`` processes started at once on one empty cache (issue 20): both
finish with the numbers of a lone run, and every cache entry verifies.

The processes are forked children of this process calling ``lowbit.cli.main`` (no
interpreter start-up), released together from a pipe so that they compute and write the
same reference, calibration and token-stream entries at the same moment."""

import json
import os
import select
import time
from pathlib import Path

import pytest

from lowbit.util.io import CorruptFile, load_tensors

ROUNDS = int(os.environ.get("LOWBIT_CONCURRENT_ROUNDS", "2"))
RECIPES = "w8a8-int8-static,w4a16-int4-g128,kv-fp8"


def _start(args: list[str], cache: Path, gate: int) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.set_num_threads(1)
            os.environ.update(LOWBIT_CACHE=str(cache), LOWBIT_WORKERS="1", HF_HUB_OFFLINE="1")
            select.select([gate], [], [])  # wait for the start
            from lowbit.cli import main

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            code = main(args)
        finally:
            os._exit(code)
    return pid


def _numbers(path: Path) -> list:
    """The rows of a compare result without timings."""
    d = json.loads(path.read_text())
    drop = {"seconds", "stage_seconds", "elapsed_s", "time_s"}

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop and "second" not in k}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return clean(d["rows"])


def _run_together(n: int, model, corpus, cache: Path, out: Path) -> list[Path]:
    r, w = os.pipe()
    jsons = [out / f"run{i}.json" for i in range(n)]
    pids = [_start(["compare", str(model), "--corpus", str(corpus), "--windows", "2", "--calib-windows", "2",
                    "--seq-len", "128", "--recipes", RECIPES, "--json", str(j), "--workers", "1"], cache, r)
            for j in jsons]
    time.sleep(0.2)
    os.write(w, b"go")  # readable for every child at once
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    os.close(r), os.close(w)
    assert codes == [0] * n, codes
    return jsons


def test_concurrent_compares_share_one_cache(tiny_folder, tmp_path):
    model, corpus = tiny_folder
    (lone,) = _run_together(1, model, corpus, tmp_path / "lone-cache", tmp_path)
    want = _numbers(lone)
    assert want and all("ppl" in json.dumps(r) for r in want)
    entries = 0
    for k in range(ROUNDS):
        cache, out = tmp_path / f"cache{k}", tmp_path / f"round{k}"
        out.mkdir()
        for j in _run_together(2, model, corpus, cache, out):
            assert _numbers(j) == want
        for p in cache.rglob("*.safetensors"):
            if not p.name.startswith("."):
                try:
                    load_tensors(p)
                except CorruptFile as e:
                    pytest.fail(str(e))
                entries += 1
    assert entries >= 3 * ROUNDS  # tokens (train, test), reference, calibration
