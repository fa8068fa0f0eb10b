"""vLLM V1's scheduler as a discrete-event simulation: one event per engine step.

Each step (as vLLM's V1 scheduler does it, ``vllm/v1/core/sched/scheduler.py``):

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
from .memory import DEFAULT_RESERVED_GB, blocks_for
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
    run = _Run(requests, step, kv_tokens, engine, stop)
    for _ in range(max_steps):
        if run.done == run.n:
            break
        run.arrivals()
        if not run.running and not run.waiting:
            run.now = float(run.arrival[run.nxt])
            continue
        if fast_forward and not run.waiting and run.running:
            jumped = run.fast_forward()
            if jumped is None:
                pass
            elif jumped:
                break
            else:
                continue
        ids, take, budget, preempted = run.schedule_running()          # steps 1 and 2
        if not preempted:
            ids, take = run.admit(ids, take, budget)                  # step 3
        if len(ids) == 0:
            if preempted:  # everything was evicted: the next step admits from the waiting queue
                continue
            raise RuntimeError("scheduler stalled: nothing schedulable")
        if run.execute(ids, take):                                   # step 4
            break
    else:
        raise RuntimeError(f"simulate: gave up after {max_steps} steps ({run.done}/{run.n} requests finished)")
    return run.result()


class _Run:
    """The state of one simulation, indexed by request, and the four steps of the scheduler.

    ``known``: prompt + generated tokens; ``computed``: tokens whose KV is computed;
    ``blocks``: KV blocks held; ``free``: free KV blocks.
    """

    def __init__(self, requests: Requests, step: StepModel, kv_tokens: int, engine: EngineConfig,
                 stop: StopRule | None) -> None:
        self.bs = bs = engine.block_size
        self.kv_blocks = kv_tokens // bs
        self.arrival, self.prompt, self.output = requests.arrival, requests.prompt, requests.output
        self.n = n = len(self.arrival)
        if n == 0:
            raise ValueError("simulate: no requests")
        if np.any(self.output < 1) or np.any(self.prompt < 1):
            raise ValueError("simulate: prompt and output lengths must be >= 1")
        worst = int(np.max(blocks_for(self.prompt + self.output, bs)))
        if worst > self.kv_blocks:
            raise ValueError(
                f"a request of {int(np.max(self.prompt + self.output))} tokens needs {worst} KV blocks but the cache "
                f"holds {self.kv_blocks} ({kv_tokens} tokens): lower the lengths, use a smaller plan or more GPUs"
            )
        if np.any(np.argsort(self.arrival, kind="stable") != np.arange(n)):
            raise ValueError("simulate: requests must be sorted by arrival time")
        self.step, self.engine = step, engine
        self.known = self.prompt.astype(np.int64).copy()
        self.computed = np.zeros(n, dtype=np.int64)
        self.generated = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros(n, dtype=np.int64)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.last_emit = np.zeros(n)
        self.preempts = np.zeros(n, dtype=np.int64)
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.free = self.kv_blocks
        self.now = 0.0
        self.nxt = 0
        self.done = 0
        self.step_end: list[float] = []
        self.step_tokens: list[int] = []
        self.itl_chunks: list[np.ndarray] = []
        self.stopped = False
        self.slo = _SLOWatch(stop, n, int(np.count_nonzero(self.output > 1))) if stop is not None else None

    def arrivals(self) -> None:
        while self.nxt < self.n and self.arrival[self.nxt] <= self.now:
            self.waiting.append(self.nxt)
            self.nxt += 1

    def retire(self, fin: np.ndarray) -> bool:
        """Requests ``fin`` finished at ``now``: record their finish time and, unless the
        early-stop rule now says the SLO is lost (then returns ``True``, the run stops),
        free their KV blocks and drop them from ``running``."""
        self.finish[fin] = self.now
        if self.slo is not None and self.slo.finished(fin, self.now, self.first, self.output):
            self.stopped = True
            return True
        self.free += int(self.blocks[fin].sum())
        self.blocks[fin] = 0
        self.done += len(fin)
        gone = set(fin.tolist())
        self.running = [r for r in self.running if r not in gone]
        return False

    def fast_forward(self) -> bool | None:
        """A decode-only stretch in one go: ``None`` if none applies, else whether the run stops."""
        jumped = _fast_forward(self.running, self.nxt, self.arrival, self.now, self.computed, self.known,
                               self.generated, self.output, self.blocks, self.free, self.bs, self.step)
        if jumped is None:
            return None
        ids, k, step_ends = jumped
        self.itl_chunks.append(np.concatenate([step_ends[0] - self.last_emit[ids],
                                               np.repeat(np.diff(step_ends), len(ids))]))
        nb = blocks_for(self.computed[ids] + k, self.bs) - self.blocks[ids]
        self.free -= int(nb.sum())
        self.blocks[ids] += nb
        self.computed[ids] += k
        self.known[ids] += k
        self.generated[ids] += k
        self.now = float(step_ends[-1])
        self.last_emit[ids] = self.now
        self.step_end.extend(step_ends.tolist())
        self.step_tokens.extend([len(ids)] * k)
        fin = ids[self.generated[ids] >= self.output[ids]]
        return bool(len(fin)) and self.retire(fin)

    def schedule_running(self) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """Steps 1 and 2: running requests first, each ``min(need, budget left)`` tokens, with KV
        blocks for them; when blocks run out, the newest are preempted (recompute).  Returns
        the scheduled ids and tokens, the budget left and whether anything was preempted."""
        budget = self.engine.max_num_batched_tokens
        empty = np.zeros(0, dtype=np.int64)
        if not self.running:
            return empty, empty, budget, False
        ids = np.fromiter(self.running, dtype=np.int64, count=len(self.running))
        c = self.computed[ids]
        need = self.known[ids] - c
        take = np.minimum(need, np.maximum(budget - (np.cumsum(need) - need), 0))
        nb = np.maximum(blocks_for(c + take, self.bs) - self.blocks[ids], 0)
        total = int(nb.sum())
        preempted = False
        if total > self.free:
            # evict the newest k so the rest fit: their blocks come back, their needs go away
            gain = np.cumsum((nb + self.blocks[ids])[::-1])
            k = int(np.searchsorted(gain, total - self.free)) + 1
            victims = ids[-k:]
            self.free += int(self.blocks[victims].sum())
            self.blocks[victims] = 0
            self.computed[victims] = 0
            self.preempts[victims] += 1
            for r in victims[::-1].tolist():
                self.waiting.appendleft(r)
            ids, take, nb = ids[:-k], take[:-k], nb[:-k]
            del self.running[-k:]
            preempted = True
        self.free -= int(nb.sum())
        self.blocks[ids] += nb
        return ids, take, budget - int(take.sum()), preempted

    def admit(self, ids: np.ndarray, take: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Step 3: waiting requests in order while budget, KV blocks and ``max_num_seqs`` allow
        (a prompt longer than the budget is chunked)."""
        new_ids: list[int] = []
        new_take: list[int] = []
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs:
            r = self.waiting[0]
            t = min(int(self.known[r] - self.computed[r]), budget)
            nb1 = blocks_for(int(self.computed[r]) + t, self.bs) - int(self.blocks[r])
            if nb1 > self.free:
                break
            self.waiting.popleft()
            self.running.append(r)
            self.free -= nb1
            self.blocks[r] += nb1
            budget -= t
            new_ids.append(r)
            new_take.append(t)
        if new_ids:
            ids = np.concatenate([ids, np.asarray(new_ids, dtype=np.int64)])
            take = np.concatenate([take, np.asarray(new_take, dtype=np.int64)])
        return ids, take

    def execute(self, ids: np.ndarray, take: np.ndarray) -> bool:
        """Step 4: the step's time; every request whose computed tokens reach its known tokens
        emits one.  Returns whether the run stops (the SLO is lost)."""
        c = self.computed[ids]
        dec = (take == 1) & (c > 0) & (self.known[ids] - c == 1)
        pre = (take > 0) & ~dec
        tp_, cp = take[pre], c[pre]
        newc = c + take
        emit = newc == self.known[ids]
        self.now += self.step.step_time(
            int(tp_.sum()), int(dec.sum()), float((c[dec] + 1).sum()),
            float((tp_ * (cp + (tp_ + 1) / 2)).sum()), float((cp + tp_).sum()), int(emit.sum()),
        )
        now = self.now
        self.step_end.append(now)
        self.step_tokens.append(int(take.sum()))
        self.computed[ids] = newc
        em = ids[emit]
        if not len(em):
            return False
        self.generated[em] += 1
        self.known[em] += 1
        g = self.generated[em]
        later = em[g > 1]
        if len(later):
            self.itl_chunks.append(now - self.last_emit[later])
        firsts = em[g == 1]
        self.first[firsts] = now
        if self.slo is not None and len(firsts) and self.slo.first_tokens(firsts, now, self.arrival):
            self.stopped = True
            return True
        self.last_emit[em] = now
        fin = em[g >= self.output[em]]
        return bool(len(fin)) and self.retire(fin)

    def result(self) -> SimResult:
        return SimResult(
            arrival=self.arrival, first_token=self.first, finish=self.finish, prompt=self.prompt, output=self.output,
            preemptions=self.preempts,
            itl=np.concatenate(self.itl_chunks) if self.itl_chunks else np.zeros(0),
            step_end=np.asarray(self.step_end), step_tokens=np.asarray(self.step_tokens, dtype=np.int64),
            stopped_early=self.stopped,
        )


class _SLOWatch:
    """Counts TTFT and TPOT misses as they happen, for :class:`StopRule`'s early stop."""

    def __init__(self, stop: StopRule, n: int, n_tpot: int) -> None:
        self.ttft = stop.ttft if stop.ttft is not None else math.inf
        self.tpot = stop.tpot if stop.tpot is not None else math.inf
        self.bad = np.zeros(n, dtype=bool)      # goodput form: requests that missed any target
        self.late_ttft = self.late_tpot = 0
        self.k_ttft, self.k_tpot, self.k_bad = stop.limits(n, n_tpot)
        self.goodput = stop.percentile is None

    def _lost(self) -> bool:
        return self.late_ttft >= self.k_ttft or self.late_tpot >= self.k_tpot or (
            self.goodput and int(self.bad.sum()) >= self.k_bad)

    def finished(self, fin, now, first, output) -> bool:
        self.late_tpot += _tpot_misses(fin, now, first, output, self.tpot, self.bad)
        return self._lost()

    def first_tokens(self, firsts, now, arrival) -> bool:
        miss = firsts[now - arrival[firsts] > self.ttft]
        if not len(miss):
            return False
        self.late_ttft += len(miss)
        self.bad[miss] = True
        return self.late_ttft >= self.k_ttft or (self.goodput and int(self.bad.sum()) >= self.k_bad)


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
