import gc

import pytest
import torch
from greenlet import greenlet

from lowbit.util.lockstep import LockstepError, run_by_replay, run_in_lockstep


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


# run_by_replay: the same contract, one chunk at a time


def _stats_work(totals, log):
    """A chunk adds to a per-point total before each point (only while the point is not
    met, as the layer pass does) and reads the total after it."""
    met_seen = set()

    def work(c, meet):
        acc = c
        for key in ("x", "y", "z"):
            if key not in met_seen:
                totals.setdefault(key, []).append(acc)
                meet(key)
            acc = acc * 2 + sum(totals[key])  # depends on every chunk's contribution
            log.append((key, c))
        return acc

    def on_meet(key):
        met_seen.add(key)
        log.append(("meet", key))

    return work, on_meet


def test_replay_gives_the_lockstep_results_and_statistics():
    t_lock, t_replay, log_lock, log_replay = {}, {}, [], []
    work, on_meet = _stats_work(t_lock, log_lock)
    lock = run_in_lockstep(work, [1, 2, 3], on_meet)
    work, on_meet = _stats_work(t_replay, log_replay)
    replay = run_by_replay(work, [1, 2, 3], on_meet)
    assert replay == lock
    assert t_replay == t_lock == {"x": [1, 2, 3], "y": [8, 10, 12], "z": [46, 50, 54]}
    meets = lambda log: [e for e in log if e[0] == "meet"]  # noqa: E731
    assert meets(log_replay) == meets(log_lock) == [("meet", "x"), ("meet", "y"), ("meet", "z")]
    # each round reruns every chunk from its start: after x's meeting, the chunks pass x again
    assert log_replay.count(("x", 1)) == 3 and log_replay.count(("z", 1)) == 1


def test_replay_runs_one_chunk_to_completion_or_stop_at_a_time():
    order = []

    def work(c, meet):
        order.append(("start", c))
        meet("p")
        order.append(("end", c))
        return c

    assert run_by_replay(work, [0, 1], lambda k: order.append(("meet", k))) == [0, 1]
    assert order == [("start", 0), ("start", 1), ("meet", "p"), ("start", 0), ("end", 0), ("start", 1), ("end", 1)]


def test_replay_unwinds_chunks_through_their_finally_blocks():
    exits = []

    def work(c, meet):
        try:
            try:
                meet("p")
            except Exception:  # the unwinding is not an Exception: user code cannot swallow it
                exits.append("swallowed")
            return c
        finally:
            exits.append(c)

    assert run_by_replay(work, [0, 1], lambda k: None) == [0, 1]
    assert exits == [0, 1, 0, 1]


def test_replay_stop_after_skips_the_last_round():
    rounds = []

    def work(c, meet):
        if c == 0:
            rounds.append(1)
        meet("a")
        meet("b")
        return c

    assert run_by_replay(work, [0, 1], lambda k: None, stop_after={"a", "b"}) is None
    assert len(rounds) == 2  # stopped at a, then at b; no third round
    rounds.clear()
    assert run_by_replay(work, [0, 1], lambda k: None, stop_after={"a"}) is None
    assert len(rounds) == 1
    rounds.clear()
    assert run_by_replay(work, [0, 1], lambda k: None) == [0, 1]
    assert len(rounds) == 3


@pytest.mark.parametrize("second", [["x", "z"], ["x"], ["y"]])
def test_replay_refuses_chunks_that_reach_different_points(second):
    def work(c, meet):
        for key in (["x", "y"] if c == 0 else second):
            meet(key)
        return c

    with pytest.raises(LockstepError, match="different points"):
        run_by_replay(work, [0, 1], lambda k: None)


def test_replay_passes_errors_through_and_meet_outside_a_chunk_is_refused():
    class Boom(Exception):
        pass

    def work(c, meet):
        meet("p")
        if c == 1:
            raise Boom("chunk 1")
        return c

    with pytest.raises(Boom, match="chunk 1"):
        run_by_replay(work, [0, 1, 2], lambda k: None)
    with pytest.raises(Boom, match="on_meet"):
        run_by_replay(work, [0], lambda k: (_ for _ in ()).throw(Boom("on_meet")))
    kept = []
    run_by_replay(lambda c, meet: kept.append(meet), [0], lambda k: None)
    with pytest.raises(RuntimeError, match="outside"):
        kept[0]("p")
