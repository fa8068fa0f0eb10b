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
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from greenlet import greenlet, getcurrent

__all__ = ["run_in_lockstep", "LockstepError"]


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
            if all(r is _DONE for r in reached):
                break
            if any(r is _DONE for r in reached) or len(set(reached)) != 1:
                where = ", ".join(f"chunk {k}: {'finished' if r is _DONE else repr(r)}" for k, r in enumerate(reached))
                raise LockstepError(f"chunks reached different points ({where})")
            on_meet(reached[0])
    finally:
        for c in coros:  # after an error: unwind every chunk still suspended at a meeting point
            if not c.dead:
                c.throw()
    return results
