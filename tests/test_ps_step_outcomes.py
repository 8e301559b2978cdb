"""How a scheduled step ends, by the outcome value its run returns (jreplicate.ps.outcome).

The table turning a worker's exceptions into outcomes is checked without threads; the
Coordinator's dispatch on outcomes is checked against a small reference model of TF's
``ClusterCoordinator`` semantics, driven by a fake carrier that returns a scripted
outcome for each run of each step (one worker, so the order of the runs is known)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.ps.closure import Closure
from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.input_sweeps import InputSweeps
from jreplicate.ps.outcome import (
    ApplicationError,
    Cancelled,
    Completed,
    EndOfInput,
    Failed,
    ShardLost,
    WorkerLost,
    from_error,
    outcome_of,
)
from jreplicate.ps.remote import (
    ParameterServerError,
    StepCancelledError,
    WorkerLostError,
)
from jreplicate.ps.shard import ShardClosedError
from jreplicate.ps.worker_input import InputEnded
from tests._fake_carrier import FakeCarrier
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

BOUND = 20.0  # seconds any wait here may take at most


# -- the one table: a worker's exceptions as outcomes (no threads) ----------------------

@pytest.mark.parametrize("error, kind", [
    (ApplicationError(ValueError("the step raised")), Failed),
    (StepCancelledError("cancelled"), Cancelled),
    (InputEnded(3, 1, 2), EndOfInput),
    (ShardClosedError("closed"), ShardLost),
    (ParameterServerError("the shards disagree"), ShardLost),
    (WorkerLostError("killed"), WorkerLost),
    (RuntimeError("a device error"), WorkerLost),
    (KeyboardInterrupt(), WorkerLost),
])
def test_every_error_of_a_run_becomes_one_outcome(error, kind):
    def run():
        raise error

    out = outcome_of(run)
    assert type(out) is kind and out == from_error(error)
    if kind is Failed:  # the step's own error, unwrapped
        assert out.error is error.error
    elif kind is EndOfInput:
        assert (out.key, out.generation) == (3, 2)
    elif kind is ShardLost:
        assert out.closed == isinstance(error, ShardClosedError)
    else:
        assert out.error is error
    assert outcome_of(lambda: 7) == Completed(7)


# -- InputSweeps (pure) ---------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["end", "lose", "reset"]), st.integers(0, 2),
                          st.integers(0, 1)), max_size=20))
def test_a_sweep_is_exhausted_once_every_live_worker_ended_it(ops):
    """Against a reference: a sweep is exhausted from the moment every live worker ended
    it until it is reset; a worker runs no step of a sweep it ended."""
    sweeps, alive = InputSweeps(), [True, True, True]
    ended: dict = {}
    exhausted: set = set()
    for op, w, g in ops:
        sweep = (9, g)
        if op == "end":
            sweeps.ended(sweep, w)
            ended.setdefault(sweep, set()).add(w)
        elif op == "lose":
            alive[w] = False
        else:
            sweeps.reset(sweep)
            ended.pop(sweep, None)
            exhausted.discard(sweep)
        new = sweeps.newly_exhausted(alive)
        want = {s for s, e in ended.items()
                if all(v in e for v, a in enumerate(alive) if a)} - exhausted
        assert set(new) == want
        exhausted |= want
        for s in [(9, 0), (9, 1)]:
            assert sweeps.exhausted(s) == (s in exhausted)
            for v in range(3):
                assert sweeps.can_run(v, s) == (v not in ended.get(s, ()))
    assert sweeps.can_run(0, None) and not sweeps.exhausted(None)


# -- the coordinator's dispatch on outcomes, against a reference model ----------------

class _Scripted(FakeCarrier):
    """One worker whose runs return ``script[step][attempt]`` (then Completed); no run
    starts before :attr:`go` is set, so that every step is queued behind the first."""

    def __init__(self, script: dict[int, list]):
        super().__init__(1, replaces_workers=True)
        self.script, self.go = script, threading.Event()
        self.runs: list[tuple[int, int]] = []  # (step id, attempt), in order
        self.replaced = 0

    def start(self, w, c, on_token_wait):
        def wait():
            assert self.go.wait(BOUND)
            self.runs.append((c.step_id, c.attempt))
            kinds = self.script.get(c.step_id, [])
            kind = kinds[c.attempt - 1] if c.attempt <= len(kinds) else "ok"
            return _outcome(kind, c.step_id, c.attempt)
        return wait

    def replace_worker(self, w: int) -> bool:
        self.replaced += 1
        return True

    def decided(self, step_id):
        return [False, False]  # no shard decided a lost run's push


def _outcome(kind: str, step: int, attempt: int):
    why = f"step {step}, run {attempt}"
    return {"ok": lambda: Completed(10 * step),
            "raise": lambda: Failed(ValueError(why)),
            "cancel": lambda: Cancelled(StepCancelledError(why)),
            "lost": lambda: WorkerLost(WorkerLostError(why)),
            "shard": lambda: ShardLost(RuntimeError(why)),
            "bad": lambda: ("not", "an", "outcome")}[kind]()


def _model(n: int, script: dict[int, list], max_attempts: int):
    """Per step (expected value or error type, recorded as completed, skipped), the
    error join raises, and the runs and their kinds, in order: one worker runs the
    steps in order."""
    ends, runs, first, stop = {}, [], None, None
    for i in range(n):
        if stop is not None:  # queued behind: cancelled (a step raised) or failed
            ends[i] = (StepCancelledError if stop == "raise" else ParameterServerError,
                       False, True)
            continue
        attempt = 0
        while True:
            attempt += 1
            kinds = script.get(i, [])
            kind = kinds[attempt - 1] if attempt <= len(kinds) else "ok"
            runs.append((i, attempt, kind))
            if kind == "lost" and attempt < max_attempts:
                continue  # run again (the worker replaced)
            break
        if kind == "ok":
            ends[i] = (10 * i, True, False)
            continue
        err = {"raise": ValueError, "bad": TypeError, "cancel": StepCancelledError,
               "lost": WorkerLostError, "shard": ParameterServerError}[kind]
        ends[i] = (err, False, kind != "shard")  # a lost shard's step: undecided
        first = first or err
        if kind in ("raise", "bad"):
            stop = "raise"
        elif kind == "shard":
            stop, first = "shard", ParameterServerError
            break
    for j in range(n):  # (after a lost shard every pending step fails with it)
        ends.setdefault(j, (ParameterServerError, False, True))
    return ends, first, runs


_kinds = st.sampled_from(["ok", "ok", "raise", "cancel", "lost", "shard", "bad"])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), max_attempts=st.integers(1, 3),
       script=st.dictionaries(st.integers(0, 5), st.lists(_kinds, max_size=3), max_size=4))
def test_each_outcome_ends_its_step_as_the_reference_says(n, max_attempts, script):
    carrier = _Scripted(script)
    co = Coordinator(carrier, max_attempts=max_attempts)
    try:
        values = [co.schedule(Closure(i, None, False, None, (), 0, None)) for i in range(n)]
        carrier.go.set()
        ends, first, runs = _model(n, script, max_attempts)
        if first is None:
            co.join(timeout=BOUND)
        else:
            with pytest.raises(first):
                co.join(timeout=BOUND)
        assert carrier.runs == [(i, a) for i, a, _ in runs]
        for i, rv in enumerate(values):
            want, completed, skipped = ends[i]
            assert rv.done()
            if completed:
                assert rv._error is None and rv._value == want
            else:
                assert isinstance(rv._error, want), (i, rv._error)
            # (the record's ids "seen" ended for good: completed or skipped)
            assert co.record.completed_ids.seen(i) == (completed or skipped), i
            assert (i in co.skipped) == skipped, i
        # a lost worker is replaced (the one worker comes back after each loss)
        assert carrier.replaced == sum(1 for *_, kind in runs if kind == "lost")
    finally:
        co.shutdown(wait=1.0)


def test_a_wait_that_raises_instead_of_returning_an_outcome_ends_its_step():
    """A carrier's wait must return an outcome; one that raises anyway loses its worker
    (the step runs again elsewhere) rather than the coordinator's thread."""

    class Raising(FakeCarrier):
        def start(self, w, c, on_token_wait):
            if c.attempt == 1:
                def boom():
                    raise WorkerLostError("raised, not returned")
                return boom
            return lambda: Completed(c.step_id)

    co = Coordinator(Raising(1, replaces_workers=True), max_attempts=2)
    try:
        rv = co.schedule(Closure(0, None, False, None, (), 0, None))
        co.join(timeout=BOUND)
        assert rv.fetch(timeout=1) == 0 and rv.attempts == 2
    finally:
        co.shutdown(wait=1.0)


def test_a_replacement_that_raises_leaves_the_worker_lost_and_says_why(caplog):
    """The carrier's replace_worker raising: the worker stays lost (its step runs on the
    other worker) and the reason is logged, not swallowed."""

    class Unreplaceable(FakeCarrier):
        lost = threading.Event()  # worker 1 runs nothing before worker 0 died

        def start(self, w, c, on_token_wait):
            if w == 0:
                return lambda: (self.lost.set(), WorkerLost(WorkerLostError("died")))[1]
            return lambda: Completed(c.step_id) if self.lost.wait(BOUND) else None

        def replace_worker(self, w):
            raise RuntimeError("no device left for a new worker")

    co = Coordinator(Unreplaceable(2, replaces_workers=True), max_attempts=3)
    try:
        with caplog.at_level("WARNING", logger="jreplicate"):
            values = [co.schedule(Closure(i, None, False, None, (), 0, None))
                      for i in range(4)]
            co.join(timeout=BOUND)
            deadline = time.monotonic() + BOUND
            while co.alive[0] or 0 in co._ends.replacing:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert [v.fetch(timeout=1) for v in values] == [0, 1, 2, 3]
        assert co.alive == [False, True]
        assert any("could not be replaced" in r.getMessage() and r.exc_info
                   for r in caplog.records)
    finally:
        co.shutdown(wait=1.0)
