"""ParameterServerStrategy: TensorFlow ``ClusterCoordinator``'s error semantics.

After a step raises: the next ``rep.run`` (or ``join``) raises that error, once, then it
is cleared; the steps queued behind it end with ``jr.ps.StepCancelledError`` and are not
applied; a step already running has its push refused (embedded carrier); the next run
works. Parameters are checked against a NumPy reference of exactly the applied steps,
and every shard's ledger against the steps that completed.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)

LR = 0.5


def _check_finite(g):
    if np.isnan(np.asarray(g)).any():
        raise FloatingPointError("the gradient is NaN")


def _job(num_workers=1, delay=0.0, tx=None, **kw):
    """w (3 floats) trained by sgd(LR) with the gradient passed to each step: the
    step's gradient ``g`` is checked on the host (a NaN raises FloatingPointError)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=num_workers, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(tx or optax.sgd(LR))
        opt = tx.init(w)

    def step(ctx, w, opt, g):
        jax.debug.callback(_check_finite, g)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    for k in range(num_workers):
        jrt.set_worker_delay(s, k, delay)
    return s, rep, w, opt, step


def _grads(n, bad=()):
    rng = np.random.default_rng(n)
    gs = [rng.normal(size=3).astype(np.float32) for _ in range(n)]
    for i in bad:
        gs[i] = np.full(3, np.nan, np.float32)
    return gs


def _outcomes(values):
    """Per RemoteValue: "ok", "cancelled" or "failed" ("ok" too for a step applied whose
    outputs were lost with its worker: ``StepOutputsLostError``)."""
    out = []
    for v in values:
        try:
            v.fetch()
            out.append("ok")
        except jr.ps.StepOutputsLostError:
            out.append("ok")
        except jr.ps.StepCancelledError:
            out.append("cancelled")
        except Exception:  # noqa: BLE001 - the step's own error
            out.append("failed")
    return out


def _check_exact(s, gs, outcomes, scale=LR):
    """The parameters are exactly the applied (ok) steps' updates; every shard's
    ledger applied exactly those and decided every step."""
    applied = [g for g, o in zip(gs, outcomes) if o == "ok"]
    ref = -scale * np.sum(applied, axis=0) if applied else np.zeros(3)
    np.testing.assert_allclose(np.asarray(s.parameters()), ref, rtol=1e-5, atol=1e-6)
    for led in s.ledger():
        assert led["applied"] == len(applied), (led, outcomes)


def _wait_done(v, timeout=60.0):
    end = time.monotonic() + timeout
    while not v.done():
        assert time.monotonic() < end, "the step did not end"
        time.sleep(0.01)


def test_queued_steps_are_cancelled_and_join_raises_the_first_error_once():
    s, rep, w, opt, step = _job(delay=0.05)
    gs = _grads(10, bad=(3,))
    values = [rep.run(step, None, w, opt, g) for g in gs]
    with pytest.raises(Exception, match="the gradient is NaN"):
        rep.join()
    outcomes = _outcomes(values)
    assert outcomes == ["ok"] * 3 + ["failed"] + ["cancelled"] * 6
    with pytest.raises(jr.ps.StepCancelledError, match="step 3 raised first"):
        values[5].fetch()
    assert s.stats()["completed"] == 3
    _check_exact(s, gs, outcomes)
    rep.join()  # raised once: cleared
    # The next run works as before.
    more = _grads(3)
    after = [rep.run(step, None, w, opt, g) for g in more]
    rep.join()
    assert _outcomes(after) == ["ok"] * 3
    _check_exact(s, gs + more, outcomes + ["ok"] * 3)
    s.shutdown()


def test_the_next_run_raises_the_error_once_then_runs():
    s, rep, w, opt, step = _job()
    gs = _grads(4, bad=(1,))
    first = [rep.run(step, None, w, opt, g) for g in gs[:2]]
    _wait_done(first[1])
    with pytest.raises(Exception, match="the gradient is NaN"):
        rep.run(step, None, w, opt, gs[2])  # raised, not scheduled
    v = rep.run(step, None, w, opt, gs[3])  # cleared: scheduled
    rep.join()  # nothing to raise: run raised it
    outcomes = _outcomes(first) + ["not scheduled", "ok"]
    assert outcomes[:2] == ["ok", "failed"] and v.fetch() is not None
    _check_exact(s, gs, outcomes)
    s.shutdown()


def test_a_running_step_has_its_push_refused():
    # Both workers spend 1 s after computing, before the push; the NaN step raises while
    # computing, before its delay: whichever worker runs the good step, the other's
    # error arrives meanwhile, and the good step is refused at its push, not applied.
    # (Which idle worker takes which step is the scheduler's choice: the test must not
    # depend on it.)
    s, rep, w, opt, step = _job(num_workers=2)
    gs, outcomes = [np.zeros(3, np.float32)], []
    outcomes += _outcomes([rep.run(step, None, w, opt, gs[0])])  # compiled
    for k in range(2):
        jrt.set_worker_delay(s, k, 1.0)
    refused = False
    for _ in range(5):  # (a retry only if the good step ended before the error came)
        pair = _grads(2, bad=(1,))
        good = rep.run(step, None, w, opt, pair[0])
        bad = rep.run(step, None, w, opt, pair[1])
        with pytest.raises(Exception, match="the gradient is NaN"):
            rep.join()
        gs += pair
        outcomes += _outcomes([good, bad])
        try:
            good.fetch()
        except jr.ps.StepCancelledError as e:
            assert "while it ran, before it pushed" in str(e)
            refused = True
            break
    assert refused, "the good step was never refused at its push"
    assert outcomes[-2:] == ["cancelled", "failed"]
    _check_exact(s, gs, outcomes)
    s.shutdown()


def test_a_nan_check_stops_token_gated_training():
    s, rep, w, opt, step = _job(
        num_workers=2, delay=0.02,
        tx=jr.sync_replicas(optax.sgd(LR), replicas_to_aggregate=1, total_num_replicas=2))
    gs = _grads(12, bad=(5,))
    values = [rep.run(step, None, w, opt, g) for g in gs]
    with pytest.raises(Exception, match="the gradient is NaN"):
        rep.join()
    outcomes = _outcomes(values)
    assert outcomes[5] == "failed" and outcomes[-1] == "cancelled", outcomes
    assert "ok" not in outcomes[8:], outcomes  # at most 2 workers ran past it
    # Token-gated with one gradient per global step: each applied step is one update
    # (a stale one is dropped: counted, not applied).
    led = s.ledger()
    assert led[0]["applied"] == led[1]["applied"] <= outcomes.count("ok")
    after = rep.run(step, None, w, opt, np.zeros(3, np.float32))
    rep.join()
    after.fetch()
    s.shutdown()


@pytest.mark.usefixtures("local_ray")
def test_on_ray_queued_steps_are_cancelled_and_the_error_raised_once():
    """Ray: the steps queued behind the failing one are cancelled (those already sent
    to a worker actor run and push: the carrier's bound); the parameters are exactly
    the completed steps'; the error is raised once; training goes on."""
    s, rep, w, opt, step = _job(num_workers=1, delay=0.05, carrier="ray")
    gs = _grads(10, bad=(2,))
    values = [rep.run(step, None, w, opt, g) for g in gs]
    with pytest.raises(Exception, match="the gradient is NaN"):
        rep.join()
    outcomes = _outcomes(values)
    assert outcomes[:3] == ["ok", "ok", "failed"] and outcomes[-1] == "cancelled", outcomes
    _check_exact(s, gs, outcomes)
    more = _grads(2)
    after = [rep.run(step, None, w, opt, g) for g in more]
    rep.join()
    _check_exact(s, gs + more, outcomes + _outcomes(after))
    assert _outcomes(after) == ["ok", "ok"]
    s.shutdown()


def test_a_step_applied_before_its_worker_died_is_not_called_cancelled():
    """A step whose worker died right after its push was applied, put back in the
    queue, then drained because another step raised: its update is in, so its
    RemoteValue says so (StepOutputsLostError, a WorkerLostError), never "cancelled
    before it ran"; ``applied = scheduled - failed - cancelled`` holds."""
    import threading

    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, max_worker_restarts=0)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    started = threading.Event()

    def hold_then_raise(g):
        if np.isnan(np.asarray(g)).any():
            started.set()  # the NaN step runs: its worker is busy
            deadline = time.monotonic() + 30
            while s.stats()["rescheduled"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # until the other step's worker died after its push
            raise FloatingPointError("the gradient is NaN")

    def step(ctx, w, opt, g):
        jax.debug.callback(hold_then_raise, g)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    try:
        for _ in range(4):  # both workers compile
            rep.run(step, None, w, opt, np.zeros(3, np.float32))
        rep.join()
        bad = rep.run(step, None, w, opt, np.full(3, np.nan, np.float32))
        assert started.wait(30)
        for k in range(2):  # (the NaN step never pushes: only the other worker dies)
            jrt.kill_worker(s, k, when="push")
        g = np.array([1.0, 2.0, 3.0], np.float32)
        lost = rep.run(step, None, w, opt, g)
        with pytest.raises(Exception, match="gradient is NaN"):
            rep.join()
        with pytest.raises(jr.ps.WorkerLostError, match="applied on every shard") as e:
            lost.fetch()
        assert isinstance(e.value, jr.ps.StepOutputsLostError)
        with pytest.raises(Exception, match="gradient is NaN"):
            bad.fetch()
        np.testing.assert_allclose(np.asarray(s.parameters()), -LR * g, rtol=1e-6)
        (led,) = s.ledger()
        assert led["applied"] == 5 and s.stats()["rescheduled"] == 1, (led, s.stats())
    finally:
        s.shutdown()
