"""``lowbit quantize`` killed with SIGKILL at seeded random points of each stage (issue 20):
afterwards there is no output folder or a complete one that loads — never a partial one —
every cache entry under its final name verifies, and a rerun succeeds.

Each run is a forked child of this process calling ``lowbit.cli.main`` (so no interpreter
start-up per kill); the child reports each stage it enters on a pipe, and the parent kills it
a seeded random delay after the chosen stage begins.  ``LOWBIT_KILLS`` sets how many kills
(default 12, spread over the stages in turn).
"""

import json
import os
import random
import select
import signal
import time
from pathlib import Path

import pytest

from lowbit.util.io import CorruptFile, load_tensors

STAGES = ("loading", "calibration", "quantizing", "writing")
KILLS = int(os.environ.get("LOWBIT_KILLS", "12"))
RESULTS = os.environ.get("LOWBIT_KILL_RESULTS")  # a JSON file to record the kills in (benchmarks)


def _instrument(report) -> None:
    """In the child: announce each stage on entry."""
    from lowbit.evaluation import workbench
    from lowbit.workflows import ship

    def wrap(mod, name, stage):
        fn = getattr(mod, name)

        def announced(*a, **k):
            report(stage)
            return fn(*a, **k)

        setattr(mod, name, announced)

    load = ship.Workbench.load.__func__
    ship.Workbench.load = classmethod(lambda cls, *a, **k: (report("loading"), load(cls, *a, **k))[1])
    wrap(workbench, "collect_stats", "calibration")
    wrap(ship, "quantize", "quantizing")
    wrap(ship, "export", "writing")


def _run(args: list[str], cache: Path, stage: str | None, delay: float, timeout: float = 120) -> tuple[list[str], int | None]:
    """Fork a child running ``lowbit ARGS``; SIGKILL it ``delay`` s after it enters ``stage``
    (never, for ``None``).  Returns (the stages it entered, its exit code or None if killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            import torch

            torch.set_num_threads(1)
            os.environ.update(LOWBIT_CACHE=str(cache), LOWBIT_WORKERS="1", HF_HUB_OFFLINE="1")
            _instrument(lambda s: os.write(w, (s + "\n").encode()))
            from lowbit.cli import main

            code = main(args)
        finally:
            os._exit(code)
    os.close(w)
    seen, buf, deadline, kill_at = [], b"", time.monotonic() + timeout, None
    try:
        while True:
            wait = deadline - time.monotonic() if kill_at is None else kill_at - time.monotonic()
            if wait <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return seen, None
            ready, _, _ = select.select([r], [], [], wait)
            if not ready:
                continue
            chunk = os.read(r, 1024)
            if not chunk:  # the child exited before the kill
                _, status = os.waitpid(pid, 0)
                return seen, os.waitstatus_to_exitcode(status)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                seen.append(line.decode())
                if seen[-1] == stage and kill_at is None:
                    kill_at = time.monotonic() + delay
    finally:
        os.close(r)


def _check_output(out: Path) -> str:
    """``absent`` or ``complete`` (every file of a written folder there, and it loads)."""
    if not out.exists():
        return "absent"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= names, names
    from lowbit.models.loading import load_model

    load_model(str(out))
    return "complete"


def _check_cache(cache: Path) -> int:
    """Every cache entry under its final name verifies; returns how many there are."""
    n = 0
    for p in cache.rglob("*.safetensors"):
        if p.name.startswith("."):
            continue  # a writer's temporary file, left by the kill: never read
        try:
            load_tensors(p)
        except CorruptFile as e:
            pytest.fail(f"a corrupt cache entry under its final name: {e}")
        n += 1
    return n


def test_sigkill_at_random_points_leaves_no_partial_output(tiny_folder, tmp_path):
    model, corpus = tiny_folder
    rng = random.Random(20)
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["quantize", str(model), "--recipe", "w8a8-int8-static", "--out", str(out), "--corpus", str(corpus),
            "--calib-windows", "2", "--windows", "2"]
    t0 = time.monotonic()
    seen, code = _run(args, tmp_path / "cache-lone", None, 0)
    assert code == 0, "the lone run failed"
    lone = time.monotonic() - t0
    import shutil

    shutil.rmtree(out)
    log = []
    for i in range(KILLS):
        stage = STAGES[i % len(STAGES)]
        if i % 3 == 2:  # now and then start from a clean cache, so the cache writers are hit too
            shutil.rmtree(cache, ignore_errors=True)
        delay = rng.uniform(0, 0.2 if stage == "writing" else 0.03)  # writing: some runs finish first (short: a fast machine ends a stage within 0.1 s)
        force = ["--force"] if out.exists() else []
        seen, code = _run(args + force, cache, stage, delay)
        outcome = _check_output(out)
        entries = _check_cache(cache) if cache.exists() else 0
        log.append({"stage": stage, "delay_s": round(delay, 3), "stages_seen": seen, "killed": code is None,
                    "exit": code, "output": outcome, "cache_entries": entries})
    seen, code = _run(args + (["--force"] if out.exists() else []), cache, None, 0)
    assert code == 0, "the rerun after the kills failed"
    assert _check_output(out) == "complete"
    _check_cache(cache)
    killed = [e for e in log if e["killed"]]
    assert len(killed) >= KILLS // 2, log  # most runs were really interrupted
    if RESULTS:
        Path(RESULTS).write_text(json.dumps({"lone_run_s": round(lone, 2), "kills": log}, indent=1))
