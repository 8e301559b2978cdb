"""Bounded staleness in both forms: bounded delay (``max_staleness=tau``) and
stale-synchronous parallel (``max_clock_lead=s``).

The pure SSP policy (:class:`jreplicate.ps.admission.ClockGate`) is checked against a
tiny reference model under random finish orders, losses, returns and ended inputs; the
real threads are checked on every shard (each applied update's staleness within the
form's bound) and against the workers' own finish times (no worker finished its step
j before every other live worker finished j - 1 - s steps).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.admission import ClockGate, StatsRecorder
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    run_with_a_dead_worker,
)
from tests._ps_helpers import linear_job as _linear


# -- the pure policy against a reference model -------------------------------------------
class ClockGateMachine(RuleBasedStateMachine):
    """Workers wait, start, finish (in any order), are lost, come back, and run out of
    input; the gate must admit exactly the reference's first eligible idle worker."""

    def __init__(self):
        super().__init__()
        self.n, self.s = 0, 0

    @rule(n=st.integers(1, 5), s=st.integers(0, 3))
    @precondition(lambda self: self.n == 0)
    def build(self, n, s):
        self.n, self.s = n, s
        self.gate = ClockGate(lead=s, workers=n, stats=StatsRecorder(n))
        self.clock = [0] * n
        self.state = ["idle"] * n  # idle | running | dead
        self.idle: list[int] = []  # arrival order
        self.ended: set[int] = set()  # workers that cannot run the step (input ended)
        self.max_lead = 0
        for w in range(n):
            self._arrive(w)

    def _arrive(self, w):
        self.gate.arrive(w)
        self.idle = [v for v in self.idle if v != w] + [w]

    def _can_run(self, v):
        return v not in self.ended

    def _expected_first(self):
        live = [v for v in range(self.n) if self.state[v] != "dead" and self._can_run(v)]
        low = min((self.clock[v] for v in live), default=None)
        for v in self.idle:
            if self._can_run(v) and (low is None or self.clock[v] - low <= self.s):
                return v, (0 if low is None else self.clock[v] - low)
        return None, None

    @rule()
    @precondition(lambda self: self.n)
    def take(self):
        want, lead = self._expected_first()
        assert self.gate.first(self._can_run) == want
        for v in self.idle:
            assert self.gate.admits(v, self._can_run, {}) == (v == want)
        if want is not None:
            assert lead <= self.s  # never admits beyond the bound
            self.max_lead = max(self.max_lead, lead)
            self.gate.leave(want)
            self.idle.remove(want)
            self.state[want] = "running"

    @rule(data=st.data())
    @precondition(lambda self: self.n and "running" in self.state)
    def finish(self, data):
        w = data.draw(st.sampled_from([v for v in range(self.n)
                                       if self.state[v] == "running"]))
        self.gate.tick(w)
        self.clock[w] += 1
        self.state[w] = "idle"
        self._arrive(w)

    @rule(data=st.data())
    @precondition(lambda self: self.n and self.state.count("dead") < self.n - 1)
    def lose(self, data):
        w = data.draw(st.sampled_from([v for v in range(self.n) if self.state[v] != "dead"]))
        self.gate.lose(w)
        self.state[w] = "dead"
        if w in self.idle:
            self.idle.remove(w)

    @rule(data=st.data())
    @precondition(lambda self: self.n and "dead" in self.state)
    def rejoin(self, data):
        w = data.draw(st.sampled_from([v for v in range(self.n) if self.state[v] == "dead"]))
        live = [self.clock[v] for v in range(self.n) if self.state[v] != "dead"]
        self.gate.rejoin(w)
        self.clock[w] = max(self.clock[w], min(live))
        self.state[w] = "idle"
        self._arrive(w)

    @rule(data=st.data())
    @precondition(lambda self: self.n and len(self.ended) < self.n - 1)
    def end_input(self, data):
        self.ended.add(data.draw(st.integers(0, self.n - 1)))

    @invariant()
    def agrees_and_never_deadlocks(self):
        if not self.n:
            return
        assert self.gate.clocks == self.clock
        eligible_idle = [v for v in self.idle if self._can_run(v)]
        if eligible_idle and not any(s == "running" for s in self.state):
            # nothing running can move a clock: some idle worker must be admitted
            assert self.gate.first(self._can_run) is not None
        assert self.gate._stats.snapshot().max_clock_lead == self.max_lead


ClockGateMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestClockGate = ClockGateMachine.TestCase


def test_a_lost_workers_clock_no_longer_holds_the_others_back():
    g = ClockGate(lead=1, workers=3, stats=StatsRecorder(3))
    for _ in range(2):  # workers 0 and 1 end two steps each; worker 2 none
        g.tick(0)
        g.tick(1)
    g.arrive(0)
    assert not g.admits(0, lambda v: True, {})  # 2 clocks ahead of worker 2
    g.lose(2)
    assert g.admits(0, lambda v: True, {})
    g.rejoin(2)  # back at the slowest live clock (2), not at 0
    assert g.clocks == [2, 2, 2] and g.admits(0, lambda v: True, {})


# -- real threads --------------------------------------------------------------------------
def _finish_order_ok(finish_times, s):
    """No worker finished its step j before every other worker finished j - 1 - s:
    a worker starts step j (clock j - 1) only when the slowest clock is >= j - 1 - s."""
    for w, times in enumerate(finish_times):
        for j, t in enumerate(times, 1):
            for v, other in enumerate(finish_times):
                if v != w and sum(u < t for u in other) < j - 1 - s:
                    return f"worker {w} ended step {j} while worker {v} had ended fewer"
    return None


@pytest.mark.parametrize("form,bound", [("max_staleness", 1), ("max_clock_lead", 0),
                                        ("max_clock_lead", 1)])
def test_each_form_bounds_the_staleness_on_every_shard(form, bound):
    """4 workers, one a 10x straggler: every shard applies every update within the
    form's bound (delay: tau updates; SSP: (workers - 1)(2s + 1) updates), and under SSP
    no worker ran more than s clocks ahead of the straggler (its own finish times)."""
    n = 4
    s, rep, w, opt, step = _linear(num_workers=n, **{form: bound})
    for k in range(n):
        jrt.set_worker_delay(s, k, 0.005)
    jrt.set_worker_delay(s, 3, 0.05)
    for _ in range(24):
        rep.run(step, None, w, opt)
    rep.join()
    st_ = s.stats()
    limit = bound if form == "max_staleness" else (n - 1) * (2 * bound + 1)
    assert st_["completed"] == 24
    for led in s.ledger():
        assert led["applied"] == 24 and led["stale"] == 0, led
        assert max(led["staleness"]) <= limit, led["staleness"]
    if form == "max_clock_lead":
        assert st_["max_clock_lead"] == bound  # the straggler held the others back
        assert _finish_order_ok(st_["finish_times"], bound) is None
        assert min(st_["completed_by"]) >= 24 // n - bound - 1
    else:
        assert st_["max_alongside"] <= bound
    np.testing.assert_allclose(s.parameters()["b"], np.full(3, -12.0))
    s.shutdown()


def test_ssp_runs_more_steps_at_once_than_bounded_delay():
    """The point of SSP: with s = 0 every worker runs a step at once (4 here), where
    bounded delay with tau = 0 runs one."""
    seen = {}
    for form in ("max_staleness", "max_clock_lead"):
        s, rep, w, opt, step = _linear(num_workers=4, **{form: 0})
        for k in range(4):
            jrt.set_worker_delay(s, k, 0.02)
        for _ in range(16):
            rep.run(step, None, w, opt)
        rep.join()
        seen[form] = max(s.staleness_histogram())
        s.shutdown()
    assert seen["max_staleness"] == 0 and seen["max_clock_lead"] >= 1, seen


@pytest.mark.parametrize("restarts", [0, None])
def test_a_dead_worker_leaves_the_clock_minimum(restarts):
    """max_clock_lead=0 with a worker killed mid-training: the others do not wait for
    its clock, and every step completes (in seconds, not at a timeout). Replaced (the
    default), it rejoins at the slowest live clock and the bound holds."""
    s, rep, w, opt, step = job = _linear(num_workers=3, max_clock_lead=0,
                                         max_worker_restarts=restarts)
    st_ = run_with_a_dead_worker(job)
    assert st_["alive"] == ([True, True, False] if restarts == 0 else [True] * 3)
    assert st_["replaced"] == (0 if restarts == 0 else 1) and st_["completed"] == 20
    assert s.ledger()[0]["applied"] == 20 and st_["max_clock_lead"] == 0
    s.shutdown()


def test_restore_starts_the_clocks_level():
    """A restored job's workers start at clock 0 together: training goes on at once
    under SSP, with the restored parameters and ledgers."""
    s, rep, w, opt, step = _linear(num_workers=3, max_clock_lead=0)
    jrt.set_worker_delay(s, 2, 0.03)
    for _ in range(9):
        rep.run(step, None, w, opt)
    rep.join()
    saved = s.state()
    s.restore(saved)
    assert s._executor.coordinator._gate.clocks == [0, 0, 0]
    for _ in range(6):
        rep.run(step, None, w, opt)
    rep.join()
    assert s.ledger()[0]["applied"] == 15
    np.testing.assert_allclose(s.parameters()["b"], np.full(3, -7.5))
    s.shutdown()


@pytest.mark.parametrize("kw,match", [
    ({"max_clock_lead": -1}, r"max_clock_lead=-1\) must be an int >= 0"),
    ({"max_clock_lead": True}, r"max_clock_lead=True\)"),
    ({"max_clock_lead": 1.5}, r"max_clock_lead=1.5\)"),
    ({"max_clock_lead": 1, "max_staleness": 2}, r"choose one form"),
])
def test_bad_max_clock_lead_is_refused_naming_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        jr.ParameterServerStrategy(**kw)


def test_max_clock_lead_is_refused_for_token_gated_training():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, max_clock_lead=1)
    rep = jr.Replicator(s)
    with pytest.raises(ValueError, match=r"max_clock_lead=1\).*Drop max_clock_lead"):
        with rep.scope():
            tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(0.1), 2, 2))
            tx.init(jnp.zeros(2))
