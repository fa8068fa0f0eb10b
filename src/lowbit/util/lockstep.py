"""Run one function over several chunks of data in lockstep, pausing at named points.

The layer-by-layer pipeline quantizes each group of Linears as soon as the statistics of
its input over *all* calibration chunks are known, then lets every chunk continue
through the quantized group — GPTQ's "true sequential" order in one forward pass per
layer.  A decoder layer's forward is ordinary Python, so the generic way to stop it in
the middle, for every chunk, is a coroutine per chunk: :func:`run_in_lockstep` runs each
chunk in a greenlet (all in the calling OS thread, so torch's thread pools, its
thread-local grad mode and fork safety are exactly those of a plain loop), switches
between them in order, and calls ``on_meet`` when the last chunk has reached a meeting
point.

    def work(chunk, meet):
        ...                           # code before the point
        meet("q_proj")                # returns once on_meet("q_proj") has run
        ...

    results = run_in_lockstep(work, chunks, on_meet=lambda key: ...)

Every chunk must reach the same meeting points in the same order; a chunk that takes a
different path, or raises, ends the whole run with an error, after the other chunks
have been unwound (their ``finally`` blocks run).  State that a chunk changes around a
meeting point (a grad-mode context entered before ``meet`` and left after it) is seen
by the other chunks in between: keep such contexts outside ``work``.

:func:`run_by_replay` has the same contract and trades time for memory: the suspended
chunks of a lockstep run hold their intermediate activations all at once, whereas replay
runs one chunk at a time, from its start, to the first meeting point not yet met (where
the chunk is unwound), and repeats that until every chunk finishes.  Each chunk's work up
to a point is thus recomputed once per later point; at most one chunk's intermediates are
alive.  ``work`` must be deterministic and must not change state that its next run would
see (beyond what ``on_meet`` changes), since it runs again from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from greenlet import greenlet, getcurrent

__all__ = ["run_in_lockstep", "run_by_replay", "LockstepError"]


class LockstepError(RuntimeError):
    """The chunks did not meet at the same points (different control flow)."""


_DONE = object()


def run_in_lockstep(
    work: Callable[[Any, Callable[[Hashable], None]], Any],
    chunks: Sequence[Any],
    on_meet: Callable[[Hashable], None],
) -> list[Any]:
    """``[work(c, meet) for c in chunks]`` in lockstep: each chunk runs until it calls
    ``meet(key)``, the next chunk then runs to the same point, and so on; when every chunk
    is there, ``on_meet(key)`` runs and the chunks continue, in the same order.

    Args:
        work: ``work(chunk, meet)``; it calls ``meet(key)`` at each meeting point.
        chunks: the data, one coroutine each.
        on_meet: called with the key once every chunk has reached that meeting point and
            before any of them continues.

    Returns:
        The results of ``work``, in the order of ``chunks``.

    Raises:
        The first exception a chunk raised, an exception of ``on_meet``, or
        :class:`LockstepError` when the chunks' meeting points differ.
    """
    caller = getcurrent()

    def meet(key: Hashable) -> None:
        if getcurrent() is caller:
            raise RuntimeError("meet() called outside a lockstep chunk")
        caller.switch(key)

    results: list[Any] = [None] * len(chunks)

    def body(k: int):
        results[k] = work(chunks[k], meet)
        return _DONE

    coros = [greenlet(lambda k=k: body(k)) for k in range(len(chunks))]
    try:
        while coros:
            reached = [c.switch() for c in coros]  # each runs to its next meeting point, or to its end
            if _check_same_point(reached) is _DONE:
                break
            on_meet(reached[0])
    finally:
        for c in coros:  # after an error: unwind every chunk still suspended at a meeting point
            if not c.dead:
                c.throw()
    return results


def _check_same_point(reached: list) -> Any:
    """The point every chunk reached (``_DONE``: all finished), or a :class:`LockstepError`
    naming where each chunk stopped."""
    if len(set(reached)) == 1:
        return reached[0]
    where = ", ".join(f"chunk {k}: {'finished' if r is _DONE else repr(r)}" for k, r in enumerate(reached))
    raise LockstepError(f"chunks reached different points ({where})")


class _Reached(BaseException):
    """Unwinds a replayed chunk at a meeting point not met yet (a BaseException, so that
    ``except Exception`` in the chunk's code does not catch it)."""

    def __init__(self, key: Hashable) -> None:
        super().__init__(key)
        self.key = key


def run_by_replay(
    work: Callable[[Any, Callable[[Hashable], None]], Any],
    chunks: Sequence[Any],
    on_meet: Callable[[Hashable], None],
    stop_after: Collection[Hashable] = (),
) -> list[Any] | None:
    """What :func:`run_in_lockstep` returns, computed one chunk at a time: each round runs
    every chunk from its start, in order; ``meet(key)`` returns at once for a key already
    met and unwinds the chunk at the first one not met; when all chunks stopped at the same
    key, ``on_meet(key)`` runs and the next round starts.  The round in which every chunk
    finishes gives the results.  A key is met once: a chunk that reaches it again later
    passes through.

    Args:
        work, chunks, on_meet: as for :func:`run_in_lockstep`.
        stop_after: keys after which the results are not needed: once all of them are met,
            no further round runs and ``None`` is returned (saves the last round).

    Raises:
        As :func:`run_in_lockstep`.
    """
    met: set[Hashable] = set()
    wanted = set(stop_after)
    current: list[bool] = [False]  # inside a chunk of this run

    def meet(key: Hashable) -> None:
        if not current[0]:
            raise RuntimeError("meet() called outside a replayed chunk")
        if key not in met:
            raise _Reached(key)

    while True:
        reached: list[Any] = []
        results: list[Any] = []
        for chunk in chunks:
            current[0] = True
            try:
                results.append(work(chunk, meet))
                reached.append(_DONE)
            except _Reached as stop:
                reached.append(stop.key)
            finally:
                current[0] = False
        if _check_same_point(reached) is _DONE:
            return results
        del results
        on_meet(reached[0])
        met.add(reached[0])
        if wanted and wanted <= met:
            return None
