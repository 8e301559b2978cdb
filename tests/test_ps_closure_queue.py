"""The coordinator's units with threads and no processes: the closure queue (order,
put_back, errors, waits that end exactly when their predicate turns, under random
interleavings), the staleness gate, the starvation detector and the statistics snapshot,
and the coordinator's starvation check with fake token waits."""

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.ps.admission import StalenessGate, StarvationDetector, StatsRecorder
from jreplicate.ps.closure import Closure
from jreplicate.ps.closure_queue import ClosureQueue
from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.remote import StepCancelledError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

BOUND = 10.0  # seconds any wait in these tests may take at most


def _c(i: int) -> Closure:
    return Closure(i, None, False, None, (), 0, None)


def _any(c: Closure) -> bool:
    return True


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_get_takes_in_put_order_and_skips_what_the_taker_cannot_run():
    q = ClosureQueue()
    for i in range(4):
        q.put(_c(i))
    assert q.get(0, lambda c: c.step_id % 2 == 1).step_id == 1
    assert [q.get(1, _any).step_id for _ in range(3)] == [0, 2, 3]
    assert q.running() == {1: 0, 0: 1, 2: 1, 3: 1} and q.queued == 0 and q.pending == 4
    assert q.get(0, _any, idle_timeout=0) is None  # nothing queued: no block


def test_put_back_goes_to_the_front_or_the_given_position_and_leaves_flight():
    q = ClosureQueue()
    for i in range(3):
        q.put(_c(i))
    a = q.get(0, _any)
    q.put_back(a)  # in flight -> the front
    assert q.running() == {} and q.queued == 3
    a, b = q.get(0, _any), q.get(1, _any)
    assert (a.step_id, b.step_id) == (0, 1)
    q.put_back(b, position=1)  # behind the head: [2, 1]
    q.put_back(a)  # [0, 2, 1]
    assert [q.get(0, _any).step_id for _ in range(3)] == [0, 2, 1]


def test_hooks_see_every_closure_enter_and_leave_flight_once():
    entered, left = [], []
    q = ClosureQueue(on_start=lambda c: entered.append(c.step_id),
                     on_stop=lambda c: left.append(c.step_id))
    for i in range(3):
        q.put(_c(i))
    cs = [q.get(0, _any) for _ in range(3)]
    q.put_back(cs[0])
    q.mark_finished(cs[1])
    q.mark_finished(cs[1])  # a second finish of the same closure is not a second leave
    assert entered == [0, 1, 2] and left == [0, 1]


def test_mark_failed_ends_wait_drains_the_queue_and_stops_takers_until_cleared():
    q = ClosureQueue()
    for i in range(3):
        q.put(_c(i))
    running = q.get(0, _any)
    waiter, settled = _in_thread(q.wait, BOUND)
    err = RuntimeError("shard lost")
    assert [c.step_id for c in q.mark_failed(err)] == [1, 2]
    waiter.join(BOUND)
    assert settled == [True] and q.error is err
    assert q.mark_failed(ValueError("second")) == [] and q.error is err  # first stays
    q.put(_c(3))
    assert q.get(1, _any, idle_timeout=0) is None  # nothing is taken while failed
    assert q.running() == {running.step_id: 0}  # in flight stays until it ends
    q.clear_error()
    assert q.get(1, _any, idle_timeout=0).step_id == 3


def test_wait_returns_when_the_last_closure_in_flight_finishes():
    q = ClosureQueue()
    for i in range(2):
        q.put(_c(i))
    cs = [q.get(0, _any), q.get(1, _any)]
    assert q.wait(timeout=0.01) is False
    waiter, settled = _in_thread(q.wait, BOUND)
    q.mark_finished(cs[0])
    time.sleep(0.05)
    assert waiter.is_alive()  # one still in flight: no return
    t0 = time.monotonic()
    q.mark_finished(cs[1])
    waiter.join(BOUND)
    assert settled == [True] and time.monotonic() - t0 < 1.0
    assert q.wait_inflight(timeout=0.0)
    q.put(_c(2))
    assert q.wait_for_change(timeout=0.01) is False  # one wait, still unsettled


def test_a_blocked_get_wakes_on_put_and_on_stop():
    q = ClosureQueue()
    taker, got = _in_thread(lambda: q.get(0, _any, idle_timeout=BOUND))
    time.sleep(0.05)
    q.put(_c(7))
    taker.join(BOUND)
    assert got[0].step_id == 7
    taker, got = _in_thread(lambda: q.get(0, _any, idle_timeout=BOUND))
    time.sleep(0.05)
    t0 = time.monotonic()
    q.stop()
    taker.join(BOUND)
    assert got == [None] and time.monotonic() - t0 < 1.0
    assert q.get(0, _any) is None  # stopped: never blocks again


def test_get_times_out_when_idle():
    q = ClosureQueue()
    t0 = time.monotonic()
    assert q.get(0, _any, idle_timeout=0.1) is None
    assert 0.09 < time.monotonic() - t0 < BOUND


def test_a_take_held_back_by_the_gate_wakes_when_a_step_leaves_flight():
    """tau = 0: worker 1 waits (no timeout) until worker 0's step ends."""
    stats = StatsRecorder(2)
    gate = StalenessGate(0, stats)
    q = ClosureQueue(on_start=lambda c: gate.start(c.step_id),
                     on_stop=lambda c: gate.stop(c.step_id))

    def take(w):
        with q.lock:
            gate.arrive(w)
            try:
                return q.get(w, _any, idle_timeout=BOUND,
                             admit=lambda c: gate.admits(w, lambda v: True, q.running()))
            finally:
                gate.leave(w)
                q.notify_takers()

    for i in range(2):
        q.put(_c(i))
    first = take(0)
    taker, got = _in_thread(take, 1)
    time.sleep(0.1)
    assert taker.is_alive() and not got  # held back while step 0 runs
    t0 = time.monotonic()
    q.mark_finished(first)
    taker.join(BOUND)
    assert got[0].step_id == 1 and time.monotonic() - t0 < 1.0
    assert stats.snapshot().max_alongside == 0


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), takers=st.integers(1, 4), n=st.integers(1, 30))
def test_random_interleavings_lose_no_wake_up_and_finish_every_closure_once(seed, takers,
                                                                          n):
    """Producers, takers that sometimes put a closure back, and a waiter, with random
    pauses: every wait is bounded, so a lost wake-up shows as a timeout."""
    rng = random.Random(seed)
    pauses = [rng.choice((0.0, 0.0, 0.0005, 0.002)) for _ in range(4 * n + 8)]
    q = ClosureQueue()
    finished: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    last = [0.0]  # when the last closure finished

    def taker(w):
        r = random.Random(seed + w)
        try:
            while True:
                c = q.get(w, _any, idle_timeout=BOUND)
                if c is None:
                    return
                time.sleep(r.choice(pauses))
                if c.attempt == 0 and r.random() < 0.3:
                    c.attempt = 1
                    q.put_back(c, position=r.randint(0, 2))
                    continue
                with lock:
                    finished.append(c.step_id)
                    q.mark_finished(c)
                    last[0] = time.monotonic()
        except BaseException as e:  # pragma: no cover (reported below)
            errors.append(e)

    threads = [threading.Thread(target=taker, args=(w,), daemon=True)
               for w in range(takers)]
    for t in threads:
        t.start()
    for i in range(n):
        q.put(_c(i))
        time.sleep(pauses[i])
    assert q.wait(timeout=BOUND), f"lost wake-up: {q.pending} pending"
    assert time.monotonic() - last[0] < 1.0, "the wait outlived the last finish"
    q.stop()
    for t in threads:
        t.join(BOUND)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(finished) == list(range(n))


def test_the_gate_counts_steps_alongside_and_admits_idle_workers_in_order():
    stats = StatsRecorder(3)
    gate = StalenessGate(1, stats)
    for w in (2, 0, 1):
        gate.arrive(w)
    assert not gate.admits(0, lambda v: True, {})  # worker 2 came first
    assert gate.admits(0, lambda v: v != 2, {})  # ...but cannot run this step
    assert gate.admits(2, lambda v: True, {})
    gate.start(10)
    gate.leave(2)
    assert gate.admits(0, lambda v: True, {10: 2})  # one alongside: tau = 1 allows it
    gate.start(11)
    gate.leave(0)
    assert not gate.admits(1, lambda v: True, {10: 2, 11: 0})  # 10 ran alongside one
    gate.stop(10)
    assert not gate.admits(1, lambda v: True, {11: 0})  # 11 ran alongside one too
    gate.stop(11)
    assert gate.admits(1, lambda v: True, {})
    assert stats.snapshot().max_alongside == 1
    assert StalenessGate(None, stats).admits(5, lambda v: False, {1: 1, 2: 2})


def test_the_starvation_detector_waits_the_grace_without_progress():
    d = StarvationDetector(grace=1.0)
    assert not d.stuck(running={0, 1}, queued=0)
    d.token_wait(0, True)
    d.token_wait(1, True)
    assert d.stuck({0, 1}, queued=0) and not d.stuck({0, 1}, queued=1)
    assert not d.stuck({0, 1, 2}, queued=0) and not d.stuck(set(), queued=0)
    assert d.due(True, now=5.0) == 1.0 and d.due(True, now=5.4) == pytest.approx(0.6)
    d.moved()  # progress restarts the grace
    assert d.due(True, now=5.9) == 1.0 and d.due(True, now=6.9) == 0.0
    d.asked()
    assert d.due(True, now=7.0) == 1.0
    assert d.due(False, now=7.5) is None and d.due(True, now=7.6) == 1.0
    assert d.relax(True) and not d.relax(True) and d.unrelax() and not d.unrelax()
    assert not d.relax(False)


def test_stats_snapshot_is_immutable_and_counts_concurrent_updates_exactly():
    s = StatsRecorder(4)

    def work(w):
        for _ in range(500):
            s.completed(w)
            s.count("rescheduled")
            s.saw_alongside(w)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    snap = s.snapshot()
    assert snap.completed == 2000 and snap.completed_by == (500,) * 4
    assert snap.rescheduled == 2000 and snap.max_alongside == 3
    assert all(isinstance(t, tuple) for t in snap.finish_times)
    s.completed(0)
    assert snap.completed == 2000 and len(snap.finish_times[0]) == 500  # a copy
    with pytest.raises(AttributeError):
        snap.completed = 1


def _token_runner(token: threading.Event, interrupted: threading.Event):
    """A step that waits for ``token`` as a token-gated worker does: counted as waiting
    (``on_token_wait``) while it blocks; cancelled by ``interrupted``."""
    def start(c, on_token_wait):
        def wait():
            on_token_wait(True)
            try:
                while not token.wait(0.01):
                    if interrupted.is_set():
                        raise StepCancelledError("interrupted")
            finally:
                on_token_wait(False)
            return c.step_id
        return wait
    return start


@pytest.mark.parametrize("token_there", [False, True])
def test_join_cancels_token_waits_only_when_shard_0_has_no_token(token_there):
    """Every running step waits, none queued: with no token to give, join raises
    StepCancelledError after the grace; with one, it keeps waiting and returns."""
    token, interrupted = threading.Event(), threading.Event()
    co = Coordinator([_token_runner(token, interrupted)] * 2, starved=lambda: not token_there,
                     interrupt=interrupted.set)
    co.STARVED_AFTER = co._starvation.grace = 0.3
    values = [co.schedule(_c(i)) for i in range(2)]
    if token_there:
        threading.Timer(1.0, token.set).start()
        co.join(timeout=BOUND)
        assert [v.fetch(timeout=1) for v in values] == [0, 1]
    else:
        t0 = time.monotonic()
        with pytest.raises(StepCancelledError, match="cannot go on"):
            co.join(timeout=BOUND)
        assert 0.25 < time.monotonic() - t0 < BOUND / 2 and co.pending == 0
        assert all(isinstance(v._error, StepCancelledError) for v in values)
    co.shutdown(wait=1.0)
