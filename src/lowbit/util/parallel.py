"""Window-parallel work in forked worker processes.

Evaluating, calibrating and computing reference predictions are independent per token
window.  On a CPU, ``k`` processes with one torch thread each beat one process with ``k``
threads (measured on SmolLM2-135M, 2 cores: 1.10×): a small model's GEMMs are
already near peak on one core, while every element-wise op, the attention kernel and
the Python between them pay a thread synchronisation.  The workers are *forked*, so they
share the model's memory (pages are copied only when written, and nothing here writes
weights) and inherit its hooks: whatever quantization the parent set up runs in them
unchanged.

Where ``fork`` is unavailable (Windows, or a caller that chose ``spawn``), with one
worker, or with one window, the work runs in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

from .progress import progress_bar

__all__ = ["default_workers", "map_shards", "torch_threads"]

R = TypeVar("R")

#: upper bound of the default: each worker holds one window's activations and logits
MAX_DEFAULT_WORKERS = 8


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` (0: unchanged) while the block runs,
    restored after, also on error."""
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def default_workers() -> int:
    """``$LOWBIT_WORKERS`` if set, else torch's intra-op thread count (capped at
    :data:`MAX_DEFAULT_WORKERS`), or 1 where processes cannot be forked."""
    env = os.environ.get("LOWBIT_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"LOWBIT_WORKERS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"LOWBIT_WORKERS must be a positive integer, got {env!r}")
        return n
    if "fork" not in mp.get_all_start_methods():
        return 1
    return max(1, min(torch.get_num_threads(), MAX_DEFAULT_WORKERS))


def map_shards(
    fn: Callable[[Sequence[int], Callable[[], None]], R],
    n: int,
    *,
    workers: int | None = None,
    description: str = "",
    progress: bool = True,
) -> list[R]:
    """Split ``range(n)`` into contiguous shards and return ``[fn(shard, tick) ...]`` in
    shard order; ``fn`` calls ``tick()`` once per item it finishes (the progress bar).

    With ``workers > 1`` each shard runs in a forked process with one torch thread and
    inference mode on; its result is pickled back.  An exception in a worker is raised
    here (the worker's traceback attached as a note); a worker that dies without a word
    raises :class:`RuntimeError`.  With one worker the single shard runs in this process.
    """
    workers = default_workers() if workers is None else int(workers)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    workers = min(workers, max(n, 1))
    if workers == 1 or "fork" not in mp.get_all_start_methods():
        bar = iter(progress_bar(range(n), description, enabled=progress))

        def tick() -> None:
            next(bar, None)

        result = fn(range(n), tick)
        for _ in bar:  # close the bar
            pass
        return [result]
    shards = [range(int(s[0]), int(s[-1]) + 1) for s in np.array_split(np.arange(n), workers) if len(s)]
    ctx = mp.get_context("fork")
    messages = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(k, shard, fn, messages), daemon=True) for k, shard in enumerate(shards)]
    results: dict[int, R] = {}
    try:
        for p in procs:
            p.start()
        bar = iter(progress_bar(range(n), description, enabled=progress))
        while len(results) < len(shards):
            try:
                kind, k, payload = messages.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"{description or 'parallel work'}: worker {dead[0]} died "
                                       f"(exit code {procs[dead[0]].exitcode}) without reporting; "
                                       "retry with LOWBIT_WORKERS=1") from None
                continue
            if kind == "tick":
                next(bar, None)
            elif kind == "done":
                results[k] = pickle.loads(payload)
            else:  # "error"
                exc, tb = pickle.loads(payload)
                exc.add_note(f"in worker {k} ({description}):\n{tb}")
                raise exc
        for _ in bar:
            pass
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        messages.close()
    return [results[k] for k in range(len(shards))]


def _worker(k: int, shard: range, fn, messages) -> None:
    # results travel as plain pickles: the queue's own pickler would hand tensors over as
    # shared-memory handles, which die with this process before the parent opens them
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            result = fn(shard, lambda: messages.put(("tick", k, None)))
        messages.put(("done", k, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent, which raises it
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps((exc, tb))
        except Exception:  # noqa: BLE001
            payload = pickle.dumps((RuntimeError(f"{type(exc).__name__}: {exc}"), tb))
        messages.put(("error", k, payload))
    finally:
        messages.close()
        messages.join_thread()
