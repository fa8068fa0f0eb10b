"""vLLM V1's scheduler as a discrete-event simulation: one event per engine step.

Each step (REFERENCE §4):

1. running requests first, in admission order: a decode asks for 1 token, a partial
   prefill for the rest of its prompt; each gets ``min(need, budget left)``;
2. KV slots for those tokens, in blocks of ``block_size``; when blocks run out, the newest
   running request is preempted: its blocks are freed, its computed tokens reset
   (recompute), and it goes to the front of the waiting queue;
3. if nothing was preempted, waiting requests are admitted in order while budget, KV blocks
   and ``max_num_seqs`` allow (a prompt longer than the budget is chunked);
4. the step takes :meth:`StepModel.step_time` seconds; every request whose computed tokens
   reach its known tokens (prompt + generated) emits one token.

Requests arriving during a step are seen at the next one.  State lives in numpy arrays
indexed by request, so the per-step cost does not grow with the number of requests.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from .hardware import GPU
from .memory import DEFAULT_RESERVED_GB
from .metrics import SimResult
from .perf import StepModel
from .workload import Requests

__all__ = ["EngineConfig", "StopRule", "simulate"]


@dataclass(frozen=True)
class StopRule:
    """When a run's SLO is certainly lost, so that the run can stop early.

    Attributes:
        ttft, tpot: targets in seconds (``None``: not checked).
        percentile: the percentile form's q (p-q of each metric within target), or ``None``
            for the goodput form (at least ``attainment`` of requests meet every target).
        attainment: the goodput form's fraction.
    """

    ttft: float | None
    tpot: float | None
    percentile: float | None = 99.0
    attainment: float = 0.99

    def limits(self, n: int, n_tpot: int) -> tuple[float, float, float]:
        """Counts of TTFT misses, TPOT misses and bad requests that lose the SLO in a run of ``n``
        requests (``n_tpot`` of them with a TPOT, i.e. more than one output token).

        Percentile form: with ``m − floor((m − 1)·q/100)`` of ``m`` values above the target, the
        order statistic ``np.percentile`` interpolates from is already above it.  Goodput form:
        ``k`` bad requests leave fewer than ``attainment·n`` good ones.
        """
        inf = math.inf
        if self.percentile is None:
            k = max(1, math.floor(n * (1 - self.attainment)))
            while (n - k) / n >= self.attainment:
                k += 1
            while k > 1 and (n - (k - 1)) / n < self.attainment:
                k -= 1
            return inf, inf, float(k)
        q = self.percentile
        k_ttft = n - math.floor((n - 1) * q / 100) if self.ttft is not None else inf
        k_tpot = n_tpot - math.floor((n_tpot - 1) * q / 100) if self.tpot is not None and n_tpot else inf
        return float(k_ttft), float(k_tpot), inf


@dataclass(frozen=True)
class EngineConfig:
    """vLLM engine settings.

    Attributes:
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most sequences running at once.
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of GPU memory vLLM may use.
        tp: tensor-parallel size.
        reserved_gb: GB per GPU kept for activations, CUDA graphs and the runtime.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    tp: int = 1
    reserved_gb: float = DEFAULT_RESERVED_GB

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"engine {name} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.reserved_gb < 0:
            raise ValueError(f"engine reserved_gb must be >= 0, got {self.reserved_gb}")

    @classmethod
    def vllm_defaults(cls, gpu: GPU, tp: int = 1) -> EngineConfig:
        """vLLM's API-server defaults: 8192 tokens / 1024 seqs on large GPUs (not A100), else 2048 / 256."""
        if gpu.vllm_large_defaults:
            return cls(8192, 1024, tp=tp)
        return cls(2048, 256, tp=tp)

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(requests: Requests, step: StepModel, kv_tokens: int, engine: EngineConfig,
             max_steps: int = 50_000_000, fast_forward: bool = True,
             stop: StopRule | None = None) -> SimResult:
    """Run ``requests`` through the scheduler; ``kv_tokens`` is the KV capacity (tokens per replica).

    ``fast_forward`` runs decode-only stretches in one go (same result, fewer Python steps).
    ``stop`` (a :class:`StopRule`) ends the run as soon as enough requests missed their TTFT or
    TPOT target that the SLO is certainly lost (the result is then marked ``stopped_early``,
    with NaN for what did not happen); the max-rate search uses it to abandon hopeless probes.

    Raises ``ValueError`` when a request can never fit in the KV cache.
    """
    bs = engine.block_size
    kv_blocks = kv_tokens // bs
    arrival, prompt, output = requests.arrival, requests.prompt, requests.output
    n = len(arrival)
    if n == 0:
        raise ValueError("simulate: no requests")
    if np.any(output < 1) or np.any(prompt < 1):
        raise ValueError("simulate: prompt and output lengths must be >= 1")
    worst = int(np.max(-(-(prompt + output) // bs)))
    if worst > kv_blocks:
        raise ValueError(
            f"a request of {int(np.max(prompt + output))} tokens needs {worst} KV blocks but the cache holds "
            f"{kv_blocks} ({kv_tokens} tokens): lower the lengths, use a smaller plan or more GPUs"
        )
    order = np.argsort(arrival, kind="stable")
    if np.any(order != np.arange(n)):
        raise ValueError("simulate: requests must be sorted by arrival time")

    known = prompt.astype(np.int64).copy()          # prompt + generated
    computed = np.zeros(n, dtype=np.int64)          # tokens whose KV is computed
    generated = np.zeros(n, dtype=np.int64)
    blocks = np.zeros(n, dtype=np.int64)
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    last_emit = np.zeros(n)
    preempts = np.zeros(n, dtype=np.int64)

    waiting: deque[int] = deque()
    running: list[int] = []
    free = kv_blocks
    now = 0.0
    nxt = 0
    done = 0
    step_end: list[float] = []
    step_tokens: list[int] = []
    itl_chunks: list[np.ndarray] = []
    max_tok, max_seqs = engine.max_num_batched_tokens, engine.max_num_seqs
    empty = np.zeros(0, dtype=np.int64)
    if stop is not None:
        ttft_t = stop.ttft if stop.ttft is not None else math.inf
        tpot_t = stop.tpot if stop.tpot is not None else math.inf
        bad = np.zeros(n, dtype=bool)      # goodput form: requests that missed any target
        late_ttft = late_tpot = 0
        k_ttft, k_tpot, k_bad = stop.limits(n, int(np.count_nonzero(output > 1)))
        goodput = stop.percentile is None
    stopped = False

    def retire(fin: np.ndarray) -> bool:
        """Requests ``fin`` finished at ``now``: record their finish time and, unless the
        early-stop rule now says the SLO is lost (then returns ``True``, the run stops),
        free their KV blocks and drop them from ``running``."""
        nonlocal free, done, running, late_tpot
        finish[fin] = now
        if stop is not None:
            late_tpot += _tpot_misses(fin, now, first, output, tpot_t, bad)
            if late_ttft >= k_ttft or late_tpot >= k_tpot or (goodput and int(bad.sum()) >= k_bad):
                return True
        free += int(blocks[fin].sum())
        blocks[fin] = 0
        done += len(fin)
        gone = set(fin.tolist())
        running = [r for r in running if r not in gone]
        return False

    for _ in range(max_steps):
        if done == n:
            break
        while nxt < n and arrival[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        if not running and not waiting:
            now = float(arrival[nxt])
            continue
        if fast_forward and not waiting and running:
            jumped = _fast_forward(running, nxt, arrival, now, computed, known, generated, output, blocks, free, bs, step)
            if jumped is not None:
                ids, k, step_ends = jumped
                t0 = step_ends[0]
                itl_chunks.append(np.concatenate([t0 - last_emit[ids], np.repeat(np.diff(step_ends), len(ids))]))
                nb = -(-(computed[ids] + k) // bs) - blocks[ids]
                free -= int(nb.sum())
                blocks[ids] += nb
                computed[ids] += k
                known[ids] += k
                generated[ids] += k
                now = float(step_ends[-1])
                last_emit[ids] = now
                step_end.extend(step_ends.tolist())
                step_tokens.extend([len(ids)] * k)
                fin = ids[generated[ids] >= output[ids]]
                if len(fin) and retire(fin):
                    stopped = True
                    break
                continue
        budget = max_tok
        preempted = False
        ids, take = empty, empty
        if running:
            ids = np.fromiter(running, dtype=np.int64, count=len(running))
            c = computed[ids]
            need = known[ids] - c
            take = np.minimum(need, np.maximum(budget - (np.cumsum(need) - need), 0))
            nb = np.maximum(-(-(c + take) // bs) - blocks[ids], 0)
            total = int(nb.sum())
            if total > free:
                # evict the newest k so the rest fit: their blocks come back, their needs go away
                gain = np.cumsum((nb + blocks[ids])[::-1])
                k = int(np.searchsorted(gain, total - free)) + 1
                victims = ids[-k:]
                free += int(blocks[victims].sum())
                blocks[victims] = 0
                computed[victims] = 0
                preempts[victims] += 1
                for r in victims[::-1].tolist():
                    waiting.appendleft(r)
                ids, take, nb = ids[:-k], take[:-k], nb[:-k]
                del running[-k:]
                preempted = True
            free -= int(nb.sum())
            blocks[ids] += nb
            budget -= int(take.sum())
        new_ids: list[int] = []
        new_take: list[int] = []
        if not preempted:
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                t = min(int(known[r] - computed[r]), budget)
                nb1 = -(-(int(computed[r]) + t) // bs) - int(blocks[r])
                if nb1 > free:
                    break
                waiting.popleft()
                running.append(r)
                free -= nb1
                blocks[r] += nb1
                budget -= t
                new_ids.append(r)
                new_take.append(t)
        if new_ids:
            ids = np.concatenate([ids, np.asarray(new_ids, dtype=np.int64)])
            take = np.concatenate([take, np.asarray(new_take, dtype=np.int64)])
        if len(ids) == 0:
            if preempted:  # everything was evicted: the next step admits from the waiting queue
                continue
            raise RuntimeError("scheduler stalled: nothing schedulable")
        c = computed[ids]
        dec = (take == 1) & (c > 0) & (known[ids] - c == 1)
        pre = (take > 0) & ~dec
        tp_, cp = take[pre], c[pre]
        n_dec = int(dec.sum())
        newc = c + take
        emit = newc == known[ids]
        dt = step.step_time(
            int(tp_.sum()), n_dec, float((c[dec] + 1).sum()),
            float((tp_ * (cp + (tp_ + 1) / 2)).sum()), float((cp + tp_).sum()), int(emit.sum()),
        )
        now += dt
        step_end.append(now)
        step_tokens.append(int(take.sum()))
        computed[ids] = newc
        em = ids[emit]
        if len(em):
            generated[em] += 1
            known[em] += 1
            g = generated[em]
            later = em[g > 1]
            if len(later):
                itl_chunks.append(now - last_emit[later])
            firsts = em[g == 1]
            first[firsts] = now
            if stop is not None and len(firsts):
                miss = firsts[now - arrival[firsts] > ttft_t]
                if len(miss):
                    late_ttft += len(miss)
                    bad[miss] = True
                    if late_ttft >= k_ttft or (goodput and int(bad.sum()) >= k_bad):
                        stopped = True
                        break
            last_emit[em] = now
            fin = em[g >= output[em]]
            if len(fin) and retire(fin):
                stopped = True
                break
    else:
        raise RuntimeError(f"simulate: gave up after {max_steps} steps ({done}/{n} requests finished)")

    return SimResult(
        arrival=arrival, first_token=first, finish=finish, prompt=prompt, output=output,
        preemptions=preempts,
        itl=np.concatenate(itl_chunks) if itl_chunks else np.zeros(0),
        step_end=np.asarray(step_end), step_tokens=np.asarray(step_tokens, dtype=np.int64),
        stopped_early=stopped,
    )


def _tpot_misses(fin, now, first, output, target, bad) -> int:
    """Finished requests ``fin`` whose TPOT (as :attr:`SimResult.tpot` computes it) exceeds ``target``."""
    o = output[fin]
    multi = fin[o > 1]
    if not len(multi) or math.isinf(target):
        return 0
    miss = multi[(now - first[multi]) / (output[multi] - 1) > target]
    bad[miss] = True
    return len(miss)


def _fast_forward(running, nxt, arrival, now, computed, known, generated, output, blocks, free, bs, step):
    """Decode-only stretch: when nothing waits and every running request decodes, the next
    steps differ only in context length, so their times form an arithmetic sequence.  Runs
    them in one go up to the next event (an arrival, a finish, a block shortage).

    Returns ``(ids, k, step_end_times)`` or ``None`` when fewer than 2 steps can be skipped.
    """
    ids = np.fromiter(running, dtype=np.int64, count=len(running))
    c = computed[ids]
    if np.any(known[ids] - c != 1) or np.any(c == 0):
        return None
    b = len(ids)
    k_fin = int((output[ids] - generated[ids]).min())
    k_blocks = (free // b - 1) * bs if free >= 2 * b else 0  # each request gains at most k//bs + 1 blocks
    k = min(k_fin, k_blocks)
    if k < 2:
        return None
    ctx0 = float((c + 1).sum())
    t0 = step.step_time(0, b, ctx0, sampled=b)
    slope = step.step_time(0, b, ctx0 + b, sampled=b) - t0  # exact: attention time is linear in context
    ends = now + np.cumsum(t0 + slope * np.arange(k))
    if nxt < len(arrival):
        # step j starts at ends[j-1] (step 0 at now); stop before the first step that would see the arrival
        starts_before = int(np.searchsorted(ends, arrival[nxt], side="left")) + 1
        k = min(k, starts_before)
        if k < 2:
            return None
        ends = ends[:k]
    return ids, k, ends
