import gc

import pytest
import torch
from greenlet import greenlet

from lowbit.util.lockstep import LockstepError, run_in_lockstep


def _live_coroutines() -> int:
    gc.collect()
    return sum(type(o) is greenlet and not o.dead and o.parent is not None for o in gc.get_objects())


def test_chunks_take_turns_and_meet_before_anyone_continues():
    log = []
    totals = {}

    def work(c, meet):
        log.append(("a", c))
        totals.setdefault("x", []).append(c)
        meet("x")
        log.append(("b", c, sum(totals["x"])))  # every chunk's contribution is in
        meet("y")
        log.append(("c", c))
        return c * 10

    def on_meet(key):
        log.append(("meet", key))

    out = run_in_lockstep(work, [1, 2, 3], on_meet)
    assert out == [10, 20, 30]
    assert log == [("a", 1), ("a", 2), ("a", 3), ("meet", "x"),
                   ("b", 1, 6), ("b", 2, 6), ("b", 3, 6), ("meet", "y"),
                   ("c", 1), ("c", 2), ("c", 3)]
    assert _live_coroutines() == 0


def test_only_one_chunk_runs_at_a_time():
    running = []
    peak = []

    def work(c, meet):
        for step in range(3):
            running.append(c)
            peak.append(len(running))
            for _ in range(1000):
                pass
            running.remove(c)
            meet(step)
        return c

    assert run_in_lockstep(work, list(range(6)), lambda k: None) == list(range(6))
    assert max(peak) == 1


def test_a_failing_chunk_raises_and_leaves_no_thread():
    class Boom(Exception):
        pass

    def work(c, meet):
        meet("first")
        if c == 1:
            raise Boom(f"chunk {c}")
        meet("second")
        return c

    with pytest.raises(Boom, match="chunk 1"):
        run_in_lockstep(work, [0, 1, 2], lambda k: None)
    assert _live_coroutines() == 0


def test_the_first_chunk_failing_at_once():
    def work(c, meet):
        if c == 0:
            raise ValueError("bad input")
        meet("x")

    with pytest.raises(ValueError, match="bad input"):
        run_in_lockstep(work, [0, 1], lambda k: None)
    assert _live_coroutines() == 0


def test_different_paths_are_an_error():
    def work(c, meet):
        meet("x" if c == 0 else "y")

    with pytest.raises(LockstepError, match="different points"):
        run_in_lockstep(work, [0, 1], lambda k: None)

    def short(c, meet):  # chunk 0 finishes while chunk 1 waits at a point
        if c:
            meet("x")

    with pytest.raises(LockstepError, match="finished"):
        run_in_lockstep(short, [0, 1], lambda k: None)
    assert _live_coroutines() == 0


def test_on_meet_failure_unwinds_the_chunks():
    after, cleaned = [], []

    def work(c, meet):
        try:
            meet("x")
            after.append(c)
        finally:
            cleaned.append(c)

    def on_meet(key):
        raise RuntimeError("quantization failed")

    with pytest.raises(RuntimeError, match="quantization failed"):
        run_in_lockstep(work, [0, 1, 2], on_meet)
    assert after == []
    assert cleaned == [0, 1, 2]
    assert _live_coroutines() == 0


def test_grad_mode_follows_the_caller():
    seen = []

    def work(c, meet):
        seen.append(torch.is_grad_enabled())

    with torch.no_grad():
        run_in_lockstep(work, [0, 1], lambda k: None)
    run_in_lockstep(work, [0], lambda k: None)
    assert seen == [False, False, True]


def test_no_chunks():
    assert run_in_lockstep(lambda c, m: c, [], lambda k: None) == []


def test_meet_outside_a_chunk_is_an_error():
    captured = []
    run_in_lockstep(lambda c, meet: captured.append(meet), [0], lambda k: None)
    with pytest.raises(RuntimeError, match="outside"):
        captured[0]("x")


def test_chunks_run_in_the_calling_thread():
    import threading

    seen = []
    run_in_lockstep(lambda c, meet: seen.append(threading.get_ident()), [0, 1], lambda k: None)
    assert seen == [threading.get_ident()] * 2
