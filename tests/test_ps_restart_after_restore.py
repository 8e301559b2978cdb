"""``restart_shard(i, state)`` after ``restore``: the report names exactly the updates the
restarted shard lost, whatever state the job was restored from (issue 28 item 5 and its
class).

The coordinator's record of which steps were skipped (raised: nothing applied) is saved
in ``state()`` and restored with it, and the record knows the *epochs* of the job's
history (a restore starts one), so a state saved on a timeline that a restore went back
from is refused rather than mixed in. A hypothesis state machine runs successful and
failing steps, saves, restores earlier states, kills a shard (before or while a step
meets it) and restarts it from any saved state, against a reference that keeps, per id,
what the step did on each timeline and, per shard, the updates it holds.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.fate import record as step_record
from jreplicate.ps.remote import ParameterServerError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)


def _job():
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, placement="round_robin")
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(()), "b": jnp.zeros(())}
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(params)

    def step(ctx, g, p, o):  # the gradient is the batch: each update adds -g
        u, o = tx.update({"a": g + 0.0 * p["a"], "b": g + 0.0 * p["b"]}, o, p)
        return optax.apply_updates(p, u)

    return s, rep, params, opt, step


def _bad(ctx, g, p, o):
    raise ValueError("this step raises")


def _run(rep, fn, params, opt, n, g=1.0):
    ids = [rep.run(fn, np.float32(g), params, opt).step_id for _ in range(n)]
    try:
        rep.join()
    except ValueError:
        assert fn is _bad
    return ids


# -- regressions -------------------------------------------------------------------------

def test_restart_after_restore_in_a_new_job_reports_no_step_skipped_before_the_state():
    """Issue 28 item 5: steps 0-2 ran, state A; 3-5 raised, state B; a new job restored B
    and ran 6-8; shard 1 restarted from A reported lost=(3, 4, 5, 6, 7, 8): the ids
    skipped before B (nothing applied) were not part of state()."""
    s, rep, params, opt, step = _job()
    _run(rep, step, params, opt, 3)
    a = s.state()
    _run(rep, _bad, params, opt, 3)
    b = s.state()
    s.shutdown()
    s, rep, params, opt, step = _job()
    try:
        s.restore(b)
        ids = _run(rep, step, params, opt, 3)
        assert ids == [6, 7, 8]
        jrt.kill_shard(s, 1)
        report = s.restart_shard(1, a)
        assert report.lost == (6, 7, 8)
        _run(rep, step, params, opt, 1)
        np.testing.assert_array_equal(s.parameters()["a"], -7.0)  # shard 0: all applied
        np.testing.assert_array_equal(s.parameters()["b"], -4.0)  # A's 3, then 1
    finally:
        s.shutdown()


def test_restore_takes_the_skipped_steps_of_the_state_not_of_the_job():
    """restore kept the job's own skipped ids below the state's next id: steps 3-5
    applied in the saved timeline but raised in the one restored from were taken as
    skipped, and a later restart_shard did not name their updates as lost."""
    s, rep, params, opt, step = _job()
    try:
        _run(rep, step, params, opt, 3)
        s0 = s.state()
        _run(rep, step, params, opt, 3)
        s2 = s.state()  # 3-5 applied
        s.restore(s0)
        _run(rep, _bad, params, opt, 3)  # 3-5 raised here
        s.restore(s2)
        assert not s._ex().coordinator.skipped
        _run(rep, step, params, opt, 2)
        jrt.kill_shard(s, 1)
        assert s.restart_shard(1, s0).lost == (3, 4, 5, 6, 7)
    finally:
        s.shutdown()


def test_restart_from_a_state_of_a_timeline_restore_left_is_refused():
    """After restore(S0), steps 3-5 ran again; a state saved before the restore at step
    6 (its steps 3-5 another timeline's) was accepted by restart_shard: the shard came
    back with updates the other shard never had and the report named none of them."""
    s, rep, params, opt, step = _job()
    try:
        _run(rep, step, params, opt, 3)
        s0 = s.state()
        _run(rep, step, params, opt, 3, g=2.0)
        s1 = s.state()
        s.restore(s0)
        _run(rep, step, params, opt, 4)
        jrt.kill_shard(s, 1)
        with pytest.raises(ValueError, match=r"another timeline.*strategy\.restore"):
            s.restart_shard(1, s1)
        assert s.restart_shard(1, s0).lost == (3, 4, 5, 6)  # an ancestor: exact
        np.testing.assert_array_equal(s.parameters()["b"], -3.0)
    finally:
        s.shutdown()


def test_restart_from_a_state_before_the_kept_history_is_refused(monkeypatch):
    monkeypatch.setattr(step_record, "HISTORY", 8)
    s, rep, params, opt, step = _job()
    try:
        old = s.state()
        _run(rep, step, params, opt, 4)
        _run(rep, _bad, params, opt, 1)
        recent = s.state()
        _run(rep, step, params, opt, 20)
        jrt.kill_shard(s, 1)
        with pytest.raises(ValueError, match=r"before the history this job keeps.*restore"):
            s.restart_shard(1, old)
        with pytest.raises(ValueError, match=r"before the history"):  # 20 ids back
            s.restart_shard(1, recent)
        s.restore(recent)
        _run(rep, step, params, opt, 6)
        jrt.kill_shard(s, 1)
        assert s.restart_shard(1, recent).lost == tuple(range(5, 11))
    finally:
        s.shutdown()


def test_a_state_without_a_step_record_restores_but_restarts_no_shard():
    """A state saved before state()['steps'] existed: restore takes it (which of its
    steps were skipped, and on which timeline, is unknown), restart_shard refuses it
    and any state from before it, naming the fix."""
    s, rep, params, opt, step = _job()
    try:
        _run(rep, step, params, opt, 3)
        state = s.state()
        old = {k: v for k, v in state.items() if k != "steps"}
        s.restore(old)
        _run(rep, step, params, opt, 2)
        assert s._ex().coordinator.completed_ids.watermark == 5
        jrt.kill_shard(s, 1)
        with pytest.raises(ValueError, match=r"no record of its steps.*strategy\.restore"):
            s.restart_shard(1, old)
        with pytest.raises(ValueError, match=r"before the history this job keeps"):
            s.restart_shard(1, state)
        s.restore(state)  # the fix: then restarts from it are exact again
        _run(rep, step, params, opt, 2)
        jrt.kill_shard(s, 1)
        assert s.restart_shard(1, state).lost == (3, 4)
    finally:
        s.shutdown()


def _dying(s, i, push):
    """``push`` of shard ``i`` that loses the shard first."""
    def dying(*args, **kw):
        jrt.kill_shard(s, i)
        return push(*args, **kw)
    return dying


def test_after_restart_the_steps_that_met_the_lost_shard_leave_no_hole():
    """A step whose push reached the live shard and then met the lost one ended
    undecided in the coordinator's record; restart_shard named it lost but left the
    record's watermark below it for the rest of the job (one int kept per later step)."""
    s, rep, params, opt, step = _job()
    try:
        _run(rep, step, params, opt, 2)
        saved = s.state()
        shard = s._ex()._carrier.shards[1]  # pushed to after shard 0
        for name in ("push", "push_pull"):  # shard 1 is lost as the push reaches it
            setattr(shard, name, _dying(s, 1, getattr(shard, name)))
        rep.run(step, np.float32(1.0), params, opt)
        with pytest.raises(ParameterServerError):
            rep.join()
        assert s.ledger()[0]["applied"] == 3
        assert s.restart_shard(1, saved).lost == (2,)
        _run(rep, step, params, opt, 5)
        done = s._ex().coordinator.completed_ids
        assert (done.watermark, done._decided) == (8, set())
        got = s.parameters()
        np.testing.assert_array_equal([got["a"], got["b"]], [-8.0, -7.0])
    finally:
        s.shutdown()


# -- the class: any sequence of steps, saves, restores and restarts ----------------------

class RestartMachine(RuleBasedStateMachine):
    """The job against a reference: ``hist[id] = (branch, kind, g)`` for the ids of this
    timeline (``branch`` names the restore it ran after), ``held[i] = {id: g}`` the
    updates shard ``i`` holds (its parameter is ``-sum(g)``)."""

    def __init__(self):
        super().__init__()
        self.s, self.rep, self.params, self.opt, self.step = _job()
        self.shard_of = [self.s.placement.shard_of(f"['{k}']") for k in "ab"]
        self.hist: dict[int, tuple] = {}
        self.held: list[dict[int, float]] = [{}, {}]
        self.branch = 0
        self.saved: list[tuple] = []
        self.rng = np.random.default_rng(0)

    def teardown(self):
        self.s.shutdown()

    @property
    def next_id(self) -> int:
        return len(self.hist)

    @rule(n=st.integers(1, 4), bad=st.booleans())
    def run(self, n, bad):
        gs = [float(self.rng.integers(1, 5)) for _ in range(n)]
        for g in gs:
            rv = self.rep.run(_bad if bad else self.step, np.float32(g), self.params,
                              self.opt)
            assert rv.step_id == self.next_id
            self.hist[rv.step_id] = (self.branch, "skip" if bad else "ok", g)
            if not bad:
                for h in self.held:
                    h[rv.step_id] = g
        if bad:
            with pytest.raises(ValueError, match="raises"):
                self.rep.join()
        else:
            self.rep.join()

    @initialize()
    def save_the_start(self):
        self.save()

    @rule()
    def save(self):
        snap = (dict(self.hist), [dict(h) for h in self.held])
        self.saved.append((self.s.state(), snap))

    @rule(k=st.integers(0, 20))
    def restore(self, k):
        self._restore(*self.saved[k % len(self.saved)])

    @rule(n=st.integers(1, 3), k=st.integers(0, 20), m=st.integers(0, 3))
    def branch(self, n, k, m):
        """Save, run on, go back to an earlier state and run again: the later saves are
        of a timeline the job left."""
        self.save()
        self.run(n, bad=False)
        self.save()
        self._restore(*self.saved[k % (len(self.saved) - 1)])
        if m:
            self.run(m, bad=False)

    def _restore(self, state, snap):
        event("restore")
        self.s.restore(state)
        self.hist, self.held = dict(snap[0]), [dict(h) for h in snap[1]]
        self.branch += 1

    @rule(i=st.integers(0, 1), k=st.integers(0, 20), meet=st.booleans())
    def kill_and_restart(self, i, k, meet):
        state, snap = self.saved[k % len(self.saved)]
        jrt.kill_shard(self.s, i)
        met = None
        if meet:  # a step meets the lost shard at its pull: pushed nowhere
            met = self.rep.run(self.step, np.float32(1.0), self.params, self.opt).step_id
            with pytest.raises(ParameterServerError):
                self.rep.join()
            self.hist[met] = (self.branch, "skip", 1.0)
        past = snap[0]
        ancestor = len(past) <= self.next_id and all(
            self.hist[j] == past[j] for j in range(len(past)))
        event(f"restart from {'an ancestor' if ancestor else 'another timeline'}"
              f"{' after a step met the lost shard' if meet else ''}")
        if not ancestor:
            with pytest.raises(ValueError, match=r"strategy\.restore\(state\)"):
                self.s.restart_shard(i, state)
            self._restore(state, snap)  # the fix the error names
            return
        report = self.s.restart_shard(i, state)
        want = tuple(j for j in range(len(past), self.next_id) if self.hist[j][1] == "ok")
        assert report.lost == want, (report.lost, want)
        self.held[i] = dict(snap[1][i])

    @rule(i=st.integers(0, 1), k=st.integers(0, 20), meet=st.booleans())
    def kill_and_restart_once_more(self, i, k, meet):  # (a rule twice: drawn more often)
        self.kill_and_restart(i, k, meet)

    @invariant()
    def parameters_and_ledgers_are_the_references(self):
        got = self.s.parameters()
        for key, i in zip("ab", self.shard_of):
            assert float(got[key]) == -sum(self.held[i].values()), (key, got, self.held)
        assert [led["applied"] for led in self.s.ledger()] == [len(h) for h in self.held]
        ex = self.s._ex()
        done = ex.coordinator.completed_ids
        assert ex.next_id == self.next_id and (done.watermark, done._decided) == (
            self.next_id, set())


RestartMachine.TestCase.settings = settings(max_examples=6, stateful_step_count=10,
                                            deadline=None)
test_restart_shard_after_any_restore = RestartMachine.TestCase
