"""The pure scheduling core (:mod:`jreplicate.ps.scheduler`), without threads or clocks.

A hypothesis state machine drives one :class:`Scheduler` (no bound, bounded delay tau,
or SSP s) through submits, takes by any idle worker, ``take_next``, finishes, losses,
returns, steps handed back, errors and token waits, against a small reference model of
the queue (FIFO, handed-back steps at the front), the admission rules (first come, first
served; bounded delay: every running step ran alongside at most tau others; SSP: a
worker's clock at most s ahead of the slowest live worker's) and the once-per-spell
relaxation of token-gated training. The SSP reference is the one of
``tests/test_ps_stale_synchronous.py`` (the gate alone); here it is checked through the
scheduler, together with the queue and the bounded-delay rule.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jreplicate.ps.admission import ClockGate, StalenessGate
from jreplicate.ps.scheduler import EMPTY, FAILED, HELD, STOPPED, TAKEN, Scheduler, Step


class Reference:
    """The admission rules, written out plainly."""

    def __init__(self, n: int, form: str, bound: int):
        self.n, self.form, self.bound = n, form, bound
        self.queue: list[int] = []
        self.running: dict[int, int] = {}  # step -> worker
        self.alongside: dict[int, int] = {}  # step -> steps it ran alongside
        self.idle: list[int] = []
        self.clock = [0] * n
        self.alive = [True] * n
        self.error = False

    def admitted(self) -> int | None:
        """The idle worker that may start the front step now (None: none)."""
        if not self.idle or not self.queue or self.error:
            return None
        if self.form == "bounded":
            w = self.idle[0]
            others = [i for i, v in self.running.items() if v != w]
            ok = len(others) <= self.bound and all(self.alongside[i] < self.bound
                                                    for i in others)
            return w if ok else None
        if self.form == "ssp":
            low = min((c for v, c in enumerate(self.clock) if self.alive[v]), default=None)
            return next((v for v in self.idle
                         if low is None or self.clock[v] - low <= self.bound), None)
        return self.idle[0]

    def start(self, w: int) -> int:
        step = self.queue.pop(0)
        for i in self.alongside:
            self.alongside[i] += 1
        self.alongside[step] = len(self.running)
        self.running[step] = w
        self.idle.remove(w)
        return step

    def leave_flight(self, step: int) -> None:
        self.running.pop(step, None)
        self.alongside.pop(step, None)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = None

    @rule(n=st.integers(1, 5), form=st.sampled_from(["none", "bounded", "ssp"]),
          bound=st.integers(0, 3), steps=st.integers(0, 6))
    @precondition(lambda self: self.s is None)
    def build(self, n, form, bound, steps):
        self.s = Scheduler(n, max_staleness=bound if form == "bounded" else None,
                           max_clock_lead=bound if form == "ssp" else None)
        self.ref = Reference(n, form, bound)
        self.next_id = 0
        self.steps: dict[int, Step] = {}
        self.waiting: set[int] = set()  # workers whose running step waits for a token
        self.relaxed = False
        self.max_alongside = 0
        for _ in range(steps):
            self.submit()
        for w in range(n):
            self.arrive(w)

    def arrive(self, w):
        self.s.arrive(w)
        self.ref.idle.append(w)

    # -- rules --------------------------------------------------------------------------
    @rule()
    @precondition(lambda self: self.s is not None)
    def submit(self):
        c = Step(self.next_id)
        self.steps[c.step_id] = c
        self.next_id += 1
        assert self.s.submit(c) == self.relaxed  # new steps undo a relaxation
        self.relaxed = False
        self.ref.queue.append(c.step_id)

    @rule(data=st.data())
    @precondition(lambda self: self.s is not None and self.ref.idle)
    def take(self, data):
        w = data.draw(st.sampled_from(self.ref.idle))
        # Unbounded: any idle worker takes the front step (the first thread to wake).
        want = w if self.ref.form == "none" else self.ref.admitted()
        got = self.s.take(w)
        if self.ref.error:
            assert got == (None, FAILED)
        elif not self.ref.queue:
            assert got == (None, EMPTY)
        elif want != w:
            assert got == (None, HELD)
        else:
            assert got.why == TAKEN and got.closure.step_id == self._start(w)

    @rule()
    @precondition(lambda self: self.s is not None)
    def take_next(self):
        want = self.ref.admitted()
        got = self.s.take_next()
        if want is None:
            assert got is None
        else:
            assert got is not None and got[0] == want
            assert got[1].step_id == self._start(want)

    def _start(self, w):
        step = self.ref.start(w)
        self.max_alongside = max([self.max_alongside, *self.ref.alongside.values()])
        return step

    @rule(data=st.data(), again=st.booleans())
    @precondition(lambda self: self.s is not None and self.ref.running)
    def finish(self, data, again):
        step = data.draw(st.sampled_from(sorted(self.ref.running)))
        w = self.ref.running[step]
        self._end_wait(w)
        self.s.finish(w, self.steps[step])
        self.ref.leave_flight(step)
        self.ref.clock[w] += 1
        self.relaxed |= self.s.maybe_relax()
        if again:
            self.arrive(w)

    @rule(data=st.data(), position=st.integers(0, 2))
    @precondition(lambda self: self.s is not None and self.ref.running)
    def hand_back(self, data, position):
        """A step that never ran on its worker (or ended at its input) goes back."""
        step = data.draw(st.sampled_from(sorted(self.ref.running)))
        w = self.ref.running[step]
        self._end_wait(w)
        self.s.put_back(self.steps[step], position)
        self.ref.leave_flight(step)
        self.ref.queue.insert(min(position, len(self.ref.queue)), step)
        self.arrive(w)

    @rule(data=st.data())
    @precondition(lambda self: self.s is not None and sum(self.ref.alive) > 1)
    def lose(self, data):
        w = data.draw(st.sampled_from([v for v in range(self.ref.n) if self.ref.alive[v]]))
        self._end_wait(w)
        self.s.worker_lost(w)
        self.ref.alive[w] = False
        if w in self.ref.idle:
            self.ref.idle.remove(w)
        for step, v in list(self.ref.running.items()):
            if v == w:  # its step goes back to the front, same id
                self.s.put_back(self.steps[step])
                self.ref.leave_flight(step)
                self.ref.queue.insert(0, step)

    @rule(data=st.data())
    @precondition(lambda self: self.s is not None and not all(self.ref.alive))
    def back(self, data):
        w = data.draw(st.sampled_from([v for v in range(self.ref.n) if not self.ref.alive[v]]))
        low = min(c for v, c in enumerate(self.ref.clock) if self.ref.alive[v])
        self.s.worker_back(w)
        self.ref.alive[w] = True
        if self.ref.form == "ssp":
            self.ref.clock[w] = max(self.ref.clock[w], low)
        self.arrive(w)

    @rule()
    @precondition(lambda self: self.s is not None)
    def fail_and_clear(self):
        err = RuntimeError("a shard was lost")
        drained = [c.step_id for c in self.s.fail(err)]
        assert drained == self.ref.queue and self.s.queued == 0
        assert self.s.fail(ValueError("second")) == [] and self.s.error is err
        self.ref.error = True
        if self.ref.idle:
            assert self.s.take(self.ref.idle[0]) == (None, FAILED)
        self.s.clear_error()
        self.ref.error = False
        self.ref.queue = []

    @rule(data=st.data(), waiting=st.booleans())
    @precondition(lambda self: self.s is not None and self.ref.running)
    def token_wait(self, data, waiting):
        self._wait(self.ref.running[data.draw(st.sampled_from(sorted(self.ref.running)))],
                   waiting)

    def _end_wait(self, w):
        """A step's token wait ends before the step does (the worker's ``finally``)."""
        if w in self.waiting:
            self._wait(w, False)

    def _wait(self, w, waiting):
        (self.waiting.add if waiting else self.waiting.discard)(w)
        stuck = not self.ref.queue and set(self.ref.running.values()) <= self.waiting
        relax = self.s.token_wait(w, waiting)
        assert relax == (stuck and not self.relaxed)  # once per stuck spell
        self.relaxed |= relax

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def agrees_with_the_reference(self):
        if self.s is None:
            return
        assert [c.step_id for c in self.s._queue] == self.ref.queue
        assert self.s.running() == self.ref.running
        assert self.s.pending == len(self.ref.queue) + len(self.ref.running)
        if self.ref.form == "ssp":
            assert self.s.gate.clocks == self.ref.clock
        if self.ref.form == "bounded":
            assert self.max_alongside <= self.ref.bound  # never beyond the bound
            assert self.s.stats.snapshot().max_alongside == self.max_alongside

    @invariant()
    def never_deadlocks(self):
        """Nothing running, a step queued, every live worker idle (none between two
        steps): some worker may start it."""
        if self.s is not None and not self.ref.running and self.ref.queue and \
                not self.ref.error and sorted(self.ref.idle) == [
                    v for v in range(self.ref.n) if self.ref.alive[v]]:
            assert self.ref.admitted() is not None


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), tau=st.integers(0, 3),
       ops=st.lists(st.tuples(st.sampled_from(["next", "finish", "lose", "back"]),
                              st.integers(0, 5)), max_size=60))
def test_bounded_delay_never_lets_a_running_step_run_alongside_more_than_tau(n, tau, ops):
    """Any order of starts, finishes, losses and returns: every running step ran
    alongside at most tau others (recounted here from the starts), and with nothing
    running an idle worker starts a step."""
    s = Scheduler(n, max_staleness=tau)
    for i in range(40):
        s.submit(Step(i))
    alive = set(range(n))
    for w in range(n):
        s.arrive(w)
    alongside: dict[int, int] = {}
    for op, k in ops:
        if op == "next" and (got := s.take_next()) is not None:
            for i in alongside:
                alongside[i] += 1
            alongside[got[1].step_id] = len(alongside)
        elif op == "finish" and alongside:
            step = sorted(alongside)[k % len(alongside)]
            w = s.running()[step]
            s.finish(w, next(c for c in s.in_flight() if c.step_id == step))
            del alongside[step]
            s.arrive(w)
        elif op == "lose" and len(alive) > 1:
            w = sorted(alive)[k % len(alive)]
            alive.discard(w)
            s.worker_lost(w)
            for c in [c for c in s.in_flight() if s.running()[c.step_id] == w]:
                s.put_back(c)
                del alongside[c.step_id]
        elif op == "back" and len(alive) < n:
            w = sorted(set(range(n)) - alive)[k % (n - len(alive))]
            alive.add(w)
            s.worker_back(w)
            s.arrive(w)
        assert all(v <= tau for v in alongside.values()), alongside
    if not alongside:  # nothing running, every live worker idle: one starts
        assert s.take_next() is not None


def test_take_says_why_it_gives_nothing():
    s = Scheduler(2, max_staleness=0)
    s.arrive(0)
    s.arrive(1)
    assert s.take(0) == (None, EMPTY)
    s.submit(Step(0))
    s.submit(Step(1))
    assert s.take(1) == (None, HELD)  # worker 0 came first
    assert s.take(0).closure.step_id == 0
    assert s.take(1) == (None, HELD)  # tau = 0: step 0 runs
    assert s.take(1, can_run=lambda v, c: False) == (None, EMPTY)
    assert [c.step_id for c in s.stop()] == [1] and s.take(1) == (None, STOPPED)


def test_can_run_keeps_a_step_from_workers_that_cannot_run_it():
    """First come, first served among the workers that can run the step: a worker
    that cannot (its input ended) does not hold back one that can."""
    s = Scheduler(3, max_clock_lead=0)
    for w in range(3):
        s.arrive(w)
    s.submit(Step(0))
    can = lambda v, c: v != 0  # noqa: E731
    assert s.take(2, can) == (None, HELD)  # worker 1 can and came first
    assert s.take(1, can).closure.step_id == 0


def test_starvation_is_asked_after_the_grace_without_progress():
    s = Scheduler(2, starved_after=1.0)
    for i in range(2):
        s.submit(Step(i))
    s.arrive(0)
    s.arrive(1)
    a, b = s.take(0).closure, s.take(1).closure
    assert s.starvation_due(now=0.0) is None  # nobody waits for a token
    assert not s.token_wait(0, True)  # one of two waits: not stuck
    assert s.token_wait(1, True)  # both wait, none queued: relax, once
    assert not s.maybe_relax()
    assert s.starvation_due(now=10.0) == 1.0
    assert s.starvation_due(now=10.4) == pytest.approx(0.6)
    progress = s.starvation.progress
    assert s.starvation_due(now=11.0) == 0.0
    assert not s.starved(progress, none_to_give=False)  # shard 0 has a token
    assert s.starvation_due(now=11.0) == 1.0  # a new spell
    progress = s.starvation.progress
    s.finish(0, a)  # progress: nothing to cancel
    assert not s.starved(progress, none_to_give=True)
    assert s.starvation_due(now=20.0) == 1.0  # worker 1 alone waits: stuck again
    assert s.starved(s.starvation.progress, none_to_give=True)
    assert s.submit(Step(2))  # new steps: undo the relaxation
    del b


def test_both_bounds_at_once_are_refused():
    with pytest.raises(ValueError, match="max_staleness.*max_clock_lead"):
        Scheduler(2, max_staleness=1, max_clock_lead=1)
    assert isinstance(Scheduler(2).gate, StalenessGate)
    assert isinstance(Scheduler(2, max_clock_lead=1).gate, ClockGate)
