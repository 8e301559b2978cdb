"""Steps that end for good without pushing, and steps given up half pushed.

A step that ends without a push (its function raised, a cancelled token wait, the end of
PER_WORKER input, cancelled at shutdown) is skipped on every shard: each ledger decides
its id uncounted, so the watermark moves past it (memory stays bounded, checkpoints keep
every decided id) and ``restart_shard`` reports no lost update of it. A step given up
after a worker was lost in the middle of its push, with the push on some shards only,
fails with ParameterServerError naming the step and the shards (asynchronous mode).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.fate.ledger import KINDS, WINDOW, Ledger
from jreplicate.ps.remote import ParameterServerError, StepCancelledError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

LR = 0.25
SIZES = {"a": 2, "b": 3}


def _job(num_ps=2, workers=2, inner=None, **kw):
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=workers,
                                   placement="round_robin", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        tx = jr.ps.pushable(inner or optax.sgd(LR))
        opt = tx.init(params)

    def step(ctx, *args):  # (ctx, [batch,] params, opt_state)
        p, o = args[-2:]
        g = {k: jnp.ones(n) + 0.0 * p[k] for k, n in SIZES.items()}
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u)

    return s, rep, params, opt, step


def _bad(ctx, *args):
    raise ValueError("this step raises")


def _ledgers(s):
    return [sh.ledger for sh in s._ex()._carrier.shards]


def _all_decided(s, n):
    """Every shard's ledger decided ids 0..n-1 and keeps no id one by one."""
    for led in _ledgers(s):
        assert (led.watermark, led._decided) == (n, set()), (led.watermark, led._decided)


# -- the ledger --------------------------------------------------------------------------

def test_ledger_skip_decides_an_id_without_counting_it():
    led = Ledger()
    led.record(1, "applied", 0)
    led.skip(0)
    assert led.watermark == 2 and not led._decided
    led.skip(1)  # decided already: a no-op
    led.skip(5)
    assert led.seen(5) and not led.seen(3)
    assert led.pushes == 1 == sum(led.counts.values()) and led.counts["applied"] == 1
    arrays = led.to_arrays()  # the checkpoint format is unchanged
    assert set(arrays) == {"counts", "staleness", "watermark", "window"}
    assert arrays["counts"].shape == (len(KINDS),) and arrays["window"].shape == (WINDOW,)
    back = Ledger.from_arrays(arrays)
    assert (back.watermark, back._decided, back.pushes) == (2, {5}, 1)


# -- every kind of unpushed end, embedded ------------------------------------------------

def test_the_watermark_moves_past_a_step_that_raised_and_memory_stays_bounded():
    s, rep, params, opt, step = _job()
    bad = rep.run(_bad, None, params, opt)
    with pytest.raises(ValueError, match="raises"):
        rep.join()
    for _ in range(60):
        rep.run(step, None, params, opt)
    rep.join()
    c = s._ex().coordinator
    try:
        _all_decided(s, 61)
        assert c.skipped == {bad.step_id}
        assert (c.completed_ids.watermark, c.completed_ids._decided) == (61, set())
        for summary in s.ledger():  # the skip is counted nowhere
            assert summary["pushes"] == summary["applied"] == 60
    finally:
        s.shutdown()


def test_the_watermark_moves_past_cancelled_token_waits():
    s, rep, params, opt, step = _job(inner=jr.sync_replicas(
        optax.sgd(LR), replicas_to_aggregate=2, total_num_replicas=2))
    for _ in range(4):
        rep.run(step, None, params, opt)
    rep.join()
    shard0 = s._ex()._carrier.shards[0]
    while shard0.tokens_available():  # the tokens a vanished worker took
        shard0.take_token(time.monotonic() + 1)
    values = [rep.run(step, None, params, opt) for _ in range(2)]
    with pytest.raises(StepCancelledError):
        rep.join()
    try:
        assert all(v.done() for v in values)
        assert s._ex().coordinator.skipped == {v.step_id for v in values}
        _all_decided(s, 6)
        assert not any(sh.book.staged for sh in s._ex()._carrier.shards)
    finally:
        s.shutdown()


def test_the_watermark_moves_past_steps_not_run_at_the_end_of_input():
    s, rep, params, opt, step = _job()
    it = rep.prepare_input(lambda ctx: [np.float32(1.0)] * 2)  # 2 elements per worker
    values = []
    for _ in range(50):
        try:
            values.append(rep.run(step, it, params, opt))
        except StopIteration:
            break
        if len(values) > 4:
            rep.join()
    else:
        pytest.fail("run never raised StopIteration")
    rep.join()
    try:
        not_run = {v.step_id for v in values if isinstance(v._error, StopIteration)}
        assert not_run and s._ex().coordinator.skipped == not_run
        assert len(values) - len(not_run) == 4 == s.ledger()[0]["applied"]
        _all_decided(s, len(values))
    finally:
        s.shutdown()


def test_steps_cancelled_at_shutdown_are_skipped():
    s, rep, params, opt, step = _job(workers=1)
    rep.run(step, None, params, opt).fetch(timeout=60)  # compiled
    jrt.set_worker_delay(s, 0, 0.3)
    values = [rep.run(step, None, params, opt) for _ in range(5)]
    time.sleep(0.1)  # the first is running
    s.shutdown()
    cancelled = [v.step_id for v in values if isinstance(v._error, StepCancelledError)]
    assert len(cancelled) >= 3, [v._error for v in values]
    for led in _ledgers(s):
        assert all(led.seen(i) for i in cancelled)


# -- restart_shard -----------------------------------------------------------------------

def test_restart_shard_reports_no_skipped_step_and_its_watermark_moves_on():
    s, rep, params, opt, step = _job()
    for _ in range(3):
        rep.run(step, None, params, opt)
    rep.join()
    saved = s.state()
    ids = [rep.run(step, None, params, opt).step_id for _ in range(3)]
    bad = rep.run(_bad, None, params, opt)
    with pytest.raises(ValueError):
        rep.join()
    ids += [rep.run(step, None, params, opt).step_id for _ in range(3)]
    rep.join()
    jrt.kill_shard(s, 1)
    try:
        report = s.restart_shard(1, saved)
        assert report.lost == tuple(ids) and bad.step_id not in report.lost
        for _ in range(5):
            rep.run(step, None, params, opt)
        rep.join()
        _all_decided(s, 15)  # the restarted shard's too
        assert s.ledger()[1]["applied"] == 3 + 5
    finally:
        s.shutdown()


def test_restore_keeps_the_skipped_steps_saved_before_for_a_later_restart_shard():
    s, rep, params, opt, step = _job()
    rep.run(step, None, params, opt)
    rep.join()
    older = s.state()
    bad = rep.run(_bad, None, params, opt)
    with pytest.raises(ValueError):
        rep.join()
    ids = [rep.run(step, None, params, opt).step_id for _ in range(2)]
    rep.join()
    newer = s.state()
    rep.run(_bad, None, params, opt)  # skipped after the newer save: its id is reused
    with pytest.raises(ValueError):
        rep.join()
    s.restore(newer)
    try:
        assert s._ex().coordinator.skipped == {bad.step_id}
        ids += [rep.run(step, None, params, opt).step_id for _ in range(2)]
        rep.join()
        jrt.kill_shard(s, 1)
        assert s.restart_shard(1, older).lost == tuple(ids)
    finally:
        s.shutdown()


# -- a step given up half pushed ---------------------------------------------------------

def test_a_step_given_up_half_pushed_names_the_shards_and_state_refuses():
    s, rep, params, opt, step = _job(max_attempts=1)
    rep.run(step, None, params, opt)
    rep.join()
    saved = s.state()
    for w in range(2):
        jrt.kill_worker(s, w, when="push")
    value = rep.run(step, None, params, opt)
    with pytest.raises(ParameterServerError) as e:
        rep.join()
    msg = str(e.value)
    assert f"step {value.step_id}" in msg and "shard(s) [0]" in msg and "[1]" in msg
    assert "strategy.restore(state)" in msg
    assert isinstance(value._error, ParameterServerError)
    with pytest.raises(ParameterServerError):  # training stopped
        rep.run(step, None, params, opt)
    with pytest.raises(RuntimeError, match="disagree"):
        s.state()
    assert not _ledgers(s)[1].seen(value.step_id)  # not hidden by a skip
    s.restore(saved)  # the fix the error names
    try:
        rep.run(step, None, params, opt)
        rep.join()
        got = s.parameters()
        for k in SIZES:
            np.testing.assert_allclose(got[k], -2 * LR)
    finally:
        s.shutdown()


def test_a_step_rerun_after_a_kill_mid_push_is_no_error():
    s, rep, params, opt, step = _job()
    jrt.set_worker_delay(s, 1, 0.2)
    jrt.kill_worker(s, 0, when="push")
    values = [rep.run(step, None, params, opt) for _ in range(4)]
    rep.join()
    try:
        assert s.stats()["rescheduled"] == 1 and all(v._error is None for v in values)
        assert not s._ex().coordinator.half_applied and not s._ex().coordinator.skipped
        _all_decided(s, 4)
        s.state()
    finally:
        s.shutdown()


# -- Ray -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def unpushed_ray():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
    from tests.test_ps_ray import private_ray

    yield from private_ray()


def test_on_ray_a_raised_step_is_skipped_and_a_half_push_is_named(unpushed_ray):
    s, rep, params, opt, step = _job(carrier="ray", max_attempts=1)
    try:
        rep.run(_bad, None, params, opt)
        with pytest.raises(ValueError, match="raises"):
            rep.join()
        for _ in range(3):
            rep.run(step, None, params, opt)
        rep.join()
        carrier, end = s._ex()._carrier, time.monotonic() + 30
        while True:  # the skip is not waited for on Ray
            marks = [int(carrier.shard_state(i)["ledger"]["watermark"]) for i in range(2)]
            if marks == [4, 4] or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert marks == [4, 4]
        for w in range(2):
            jrt.kill_worker(s, w, when="push")
        value = rep.run(step, None, params, opt)
        with pytest.raises(ParameterServerError, match=f"step {value.step_id}"):
            rep.join()
        with pytest.raises(RuntimeError, match="disagree"):
            s.state()
    finally:
        s.shutdown()
