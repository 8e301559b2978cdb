"""ParameterServerStrategy after a lost shard: skipped ids, restart_shard after a loss,
PER_WORKER put-back, NNX arguments read as of each run, where they meet."""

from __future__ import annotations

import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.remote import ParameterServerError
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.25
SIZES = {"a": 2, "b": 3, "c": 2}  # round robin: with 3 shards one leaf each
BOUND_S = 30.0


def _job(num_ps=2, workers=2):
    s, rep, params, opt, tx = sgd_job(SIZES, lr=LR, num_ps=num_ps, num_workers=workers,
                                      placement="round_robin")

    def step(ctx, p, o):
        g = {k: jnp.ones(n) + 0.0 * p[k] for k, n in SIZES.items()}
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u)

    return s, rep, params, opt, step


def _ledgers(s):
    return [sh.ledger for sh in s._ex()._carrier.shards]


def test_after_a_lost_shard_refused_runs_and_its_step_leave_no_hole_in_the_ledgers():
    """A run refused while a shard was lost took a step id that no shard ever decided,
    and the step that met the lost shard at its pull was left undecided too: after
    restart_shard every ledger's watermark (and the coordinator's) stayed there for the
    rest of the job (one int kept per later step on every shard, and past the
    checkpoint's window of 1024 ids a later restart_shard's report misses lost
    updates)."""
    s, rep, params, opt, step = _job(num_ps=2)
    try:
        for _ in range(3):
            rep.run(step, None, params, opt)
        rep.join()
        saved = s.state()
        jrt.kill_shard(s, 1)
        rep.run(step, None, params, opt)  # meets the lost shard (at its pull)
        with pytest.raises(ParameterServerError):
            rep.join()
        with pytest.raises(ParameterServerError):
            rep.run(step, None, params, opt)  # refused: the loss stops new steps
        report = s.restart_shard(1, saved)
        assert report.lost == ()
        for _ in range(5):
            rep.run(step, None, params, opt)
        rep.join()
        n = s._ex().next_id
        for led in _ledgers(s):
            assert (led.watermark, led._decided) == (n, set())
        assert s._ex().coordinator.completed_ids.watermark == n
        for k in SIZES:
            np.testing.assert_allclose(s.parameters()[k], -LR * 8)
    finally:
        s.shutdown()


def test_restart_shard_refuses_when_the_live_shards_disagree_on_a_step():
    """Three shards; shard 1 is lost while a step pushes: shard 0 applied it, shard 2
    never received it. restart_shard(1) reported only shard 1's loss and training went
    on with shards 0 and 2 silently disagreeing (state() saved them). Now it refuses,
    naming the step and the shards, changes nothing, and restore() is the fix."""
    s, rep, params, opt, step = _job(num_ps=3, workers=1)
    try:
        for _ in range(3):
            rep.run(step, None, params, opt)
        rep.join()
        saved = s.state()
        jrt.set_worker_delay(s, 0, 0.4)
        rep.run(step, None, params, opt)
        time.sleep(0.15)  # computing: pushes after the loss
        jrt.kill_shard(s, 1)
        with pytest.raises(ParameterServerError):
            rep.join()
        assert [led.watermark for led in _ledgers(s)] == [4, 3, 3]  # (as the attack needs)
        with pytest.raises(ValueError, match=r"step 3's push is on shard\(s\) \[0\] and "
                                             r"not on shard\(s\) \[2\].*restore"):
            s.restart_shard(1, saved)
        assert _ledgers(s)[1].watermark == 3  # the lost shard was not replaced
        with pytest.raises(RuntimeError, match="disagree"):
            s.state()
        s.restore(saved)
        jrt.set_worker_delay(s, 0, 0.0)
        for _ in range(2):
            rep.run(step, None, params, opt)
        rep.join()
        for k in SIZES:
            np.testing.assert_allclose(s.parameters()[k], -LR * 5)
    finally:
        s.shutdown()


def _check(v):
    if int(v[1]) == 1:
        raise ValueError("review: a bad record")


def test_ps_per_worker_an_element_every_step_fails_on_does_not_stop_the_sweep():
    """A failed step's elements go to the next step of the sweep on its worker. An
    element the step fails on every time (a bad record) was put back by every step:
    every later step of the sweep on that worker failed on it, the rest of the sweep was
    never read and it never ended (a loop running until StopIteration ran for ever).
    Now it is retried once, then consumed."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):
        for i in range(5):
            yield np.array([ctx.input_pipeline_id, i], np.float32)

    def step(ctx, x, w, opt):
        jax.debug.callback(_check, x)
        u, opt = tx.update(x, opt, w)
        return optax.apply_updates(w, u), opt, x

    try:
        it = rep.prepare_input(input_fn)
        values, raised = [], 0
        for _ in range(40):
            try:
                values.append(rep.run(step, it, w, opt))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - a step raised: run raises it once
                assert "bad record" in str(e), e
                raised += 1
            time.sleep(0.01)
        else:
            pytest.fail("the sweep never ended: every step failed on the bad element")
        try:
            rep.join()
        except Exception as e:  # noqa: BLE001 - unless run raised it already
            assert "bad record" in str(e), e
            raised += 1
        assert raised >= 1
        seen = []
        for v in values:
            try:
                seen.append(int(np.asarray(v.fetch(timeout=BOUND_S)[2]).reshape(-1)[1]))
            except (StopIteration, jr.ps.StepCancelledError):  # not run
                pass
            except Exception as e:  # noqa: BLE001 - the steps that failed on it
                assert "bad record" in str(e), e
        assert seen == [0, 2, 3, 4]
        assert s.ledger()[0]["applied"] == 4
    finally:
        s.shutdown()


def test_a_fresh_nnx_argument_each_step_is_not_kept_for_the_whole_job():
    """The executor kept every NNX argument it was given (the node, its leaves and a host
    copy of its state) for the whole job: a fresh nnx.Rngs passed to each step was never
    freed (memory grew per step)."""
    nnx = pytest.importorskip("flax.nnx")
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)

    def step(ctx, model, opt, rngs):
        opt.update(model, nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model))
        return jax.random.key_data(rngs.params())

    try:
        refs, keys = [], []
        for i in range(6):
            r = nnx.Rngs(i)
            refs.append(weakref.ref(r))
            keys.append(np.asarray(rep.run(step, None, model, opt, r).fetch(timeout=BOUND_S)))
            del r
        rep.join()
        gc.collect()
        assert sum(x() is not None for x in refs) == 0
        assert len(s._ex()._steps.nnx_cache) <= 2  # the model and the optimizer
        assert len({k.tobytes() for k in keys}) == 6  # each step read its own Rngs
        # The model is still read from the cache while unchanged, and as of each run.
        assert len(s._ex()._steps.nnx_cache) >= 1
    finally:
        s.shutdown()


def test_after_restart_shard_a_step_given_up_half_pushed_no_longer_blocks_state():
    """A worker dies between its pushes to shard 0 and shard 1 (step 3: on shard 0
    only); shard 1 is lost before the step runs again, so it ends half applied and
    training stops. restart_shard(1, saved) names step 3 among the updates shard 1
    lost and training goes on, but state() kept refusing ("the shards disagree") for
    the rest of the job: the record's half-applied entry outlived the restart that
    resolved it."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, placement="round_robin",
                                   max_worker_restarts=0)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(params)

    def step(ctx, p, o):
        u, o = tx.update({k: jnp.ones(n) + 0.0 * p[k] for k, n in SIZES.items()}, o, p)
        return optax.apply_updates(p, u)

    try:
        for _ in range(3):
            rep.run(step, None, params, opt)
        rep.join()
        saved = s.state()
        jrt.set_worker_delay(s, 1, 1.5)
        jrt.kill_worker(s, 0, when="push")
        for _ in range(2):  # worker 0 takes one and dies half pushed; worker 1 is slow
            rep.run(step, None, params, opt)
        deadline = time.monotonic() + 1.2
        while s.stats()["alive"][0] and time.monotonic() < deadline:
            time.sleep(0.01)
        jrt.kill_shard(s, 1)  # before worker 1 pushes or runs the step again
        with pytest.raises(ParameterServerError):
            rep.join()
        assert s._ex().coordinator.half_applied  # (as the attack needs)
        report = s.restart_shard(1, saved)
        assert 3 in report.lost
        jrt.set_worker_delay(s, 1, 0.0)
        rep.run(step, None, params, opt)
        rep.join()
        state = s.state()  # refused before: "the shards disagree (step 3's push ...)"
        assert int(state["next_step_id"]) == 6
    finally:
        s.shutdown()
