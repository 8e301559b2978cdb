"""ParameterServerStrategy with input read on the workers (InputReplicationMode.PER_WORKER,
TensorFlow's create_per_worker_dataset): pipelines built and read on the workers, each
element used once, a dead worker's step rerun on another worker's pipeline, the end of
input, reinitialize."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.5


def _job(num_workers, per_pipeline, g=1, **kw):
    """A linear loss sum(w * x): its gradient is the batch itself, so the trained
    parameters are -LR * (sum of the batches applied), whatever the order or
    staleness. Elements are [pipeline id, index, num_input_pipelines, replica]."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=num_workers,
                                   num_replicas_in_sync=g, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    calls = []

    def input_fn(ctx):
        calls.append((threading.current_thread().name, ctx.input_pipeline_id,
                      ctx.num_input_pipelines, ctx.num_replicas_in_sync))
        return [np.array([ctx.input_pipeline_id, i, ctx.num_input_pipelines, r], np.float32)
                for i in range(per_pipeline) for r in range(g)]

    def step(ctx, x, w, opt):
        g_ = jax.grad(lambda w: jr.compute_average_loss(jnp.sum(w * x)[None], 1))(w)
        u, opt = tx.update(g_, opt, w)
        return optax.apply_updates(w, u), opt, x

    return s, rep, w, opt, step, input_fn, calls


def _used(values):
    """(worker, batch) of every step that ran, in step order; a batch is [4] for one
    replica per worker, [replica, 4] for sync groups."""
    out = []
    for v in values:
        try:
            b = np.asarray(v.fetch()[2]).reshape(-1, 4)
            out.append((v.worker, b[0] if len(b) == 1 else b))
        except StopIteration:
            pass
    return out


def _check_params(s, used):
    total = sum(b.reshape(-1, 4).sum(0) for _, b in used)
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6, atol=1e-5)


def test_each_worker_reads_its_own_pipeline_in_order_each_element_once():
    s, rep, w, opt, step, input_fn, calls = _job(4, 5)
    it = rep.prepare_input(input_fn)
    assert isinstance(it, jr.InputIterator) and it.num_input_pipelines == 4
    values = [rep.run(step, it, w, opt) for _ in range(20)]
    rep.join()
    # input_fn ran once per worker, on the worker's thread, never on the driver.
    assert sorted(c[1:] for c in calls) == [(p, 4, 1) for p in range(4)]
    assert all(c[0].startswith("jreplicate-ps-worker-") for c in calls)
    used = _used(values)
    assert len(used) == 20
    for k in range(4):  # a worker's steps read its own pipeline, in order
        mine = [b for wk, b in used if wk == k]
        assert all(b[0] == k for b in mine)
        assert [int(b[1]) for b in mine] == list(range(len(mine)))
    assert sorted((int(b[0]), int(b[1])) for _, b in used) == \
        [(p, i) for p in range(4) for i in range(5)]  # every element exactly once
    _check_params(s, used)
    assert s.ledger()[0]["applied"] == 20
    s.shutdown()


def test_end_of_input_every_pipeline_then_stop_iteration():
    s, rep, w, opt, step, input_fn, _ = _job(3, 2)
    it = rep.prepare_input(input_fn)
    values = []
    for _ in range(500):  # bounded: the driver learns the end from the workers
        try:
            values.append(rep.run(step, it, w, opt))
        except StopIteration:
            break
        if len(values) > 6:
            rep.join()  # the next run sees every pipeline at its end
    else:
        pytest.fail("run never raised StopIteration")
    rep.join()  # the end of input is no error
    used = _used(values)
    assert sorted((int(b[0]), int(b[1])) for _, b in used) == \
        [(p, i) for p in range(3) for i in range(2)]
    not_run = [v for v in values if v.done() and isinstance(v._error, StopIteration)]
    assert len(used) + len(not_run) == len(values)
    _check_params(s, used)
    with pytest.raises(StopIteration):
        rep.run(step, it, w, opt)
    # reinitialize: every pipeline again from its start.
    it.reinitialize()
    again = [rep.run(step, it, w, opt) for _ in range(6)]
    rep.join()
    assert sorted((int(b[0]), int(b[1])) for _, b in _used(again)) == \
        [(p, i) for p in range(3) for i in range(2)]
    _check_params(s, used + _used(again))
    assert s.ledger()[0]["applied"] == 12
    s.shutdown()


def test_a_killed_worker_rerun_reads_another_pipeline_ledger_exact():
    s, rep, w, opt, step, input_fn, _ = _job(3, 50, max_worker_restarts=0)
    for k in range(3):
        jrt.set_worker_delay(s, k, 0.003)
    it = rep.prepare_input(input_fn)
    jrt.kill_worker(s, 1, when="compute")
    values = [rep.run(step, it, w, opt) for _ in range(24)]
    rep.join()
    used = _used(values)
    assert len(used) == 24 and s.stats()["rescheduled"] == 1
    assert s.stats()["alive"] == [True, False, True]
    for k in range(3):  # no element used twice or skipped (the rerun, which has a
        # lower step id, ran after later steps: sorted); worker 1 died in its first
        # step: its element 0 was read and is not applied, the rest never read.
        mine = sorted(int(b[1]) for wk, b in used if wk == k)
        assert mine == list(range(len(mine))) and (k != 1 or not mine)
        assert all(int(b[0]) == k for wk, b in used if wk == k)
    for led in s.ledger():
        assert led["applied"] == 24 and led["duplicate"] == 0
    _check_params(s, used)
    s.shutdown()


def test_sync_group_reads_one_element_per_replica_and_errors_surface():
    s, rep, w, opt, step, input_fn, calls = _job(2, 3, g=2)
    it = rep.prepare_input(input_fn)
    values = [rep.run(step, it, w, opt) for _ in range(6)]
    rep.join()
    used = _used(values)
    assert sorted(c[1:] for c in calls) == [(0, 2, 2), (1, 2, 2)]
    for wk, b in used:  # [replica, 4]: the group's elements of one index, in order
        assert b.shape == (2, 4) and (b[:, 0] == wk).all() and b[:, 3].tolist() == [0, 1]
        assert b[0, 1] == b[1, 1]
    _check_params(s, used)

    def broken(ctx):
        raise OSError(f"no shard for pipeline {ctx.input_pipeline_id}")

    bad = rep.prepare_input(broken)
    v = rep.run(step, bad, w, opt)
    with pytest.raises(OSError, match="no shard for pipeline"):
        rep.join()
    with pytest.raises(OSError):
        v.fetch()
    with pytest.raises(ValueError, match="SINGLE"):
        rep.prepare_input(input_fn, partial_batch="pad")
    s.shutdown()


@pytest.mark.parametrize("when", ["push", "compute"])
def test_token_gated_per_worker_input_with_a_killed_worker_keeps_the_ledger_exact(when):
    s, rep, w, opt, tx = sgd_job(4, inner=jr.sync_replicas(
        optax.sgd(0.1), replicas_to_aggregate=2, total_num_replicas=3), num_ps=2,
        num_workers=3, token_timeout=30)

    def step(ctx, x, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * x))(w), opt, w)
        return optax.apply_updates(w, u), opt, x

    def input_fn(ctx):
        return [np.array([ctx.input_pipeline_id, i, 0, 0], np.float32) for i in range(40)]

    for k in range(3):
        jrt.set_worker_delay(s, k, 0.003)
    it = rep.prepare_input(input_fn)
    jrt.kill_worker(s, 1, when=when)
    values = [rep.run(step, it, w, opt) for _ in range(18)]
    rep.join()
    used = _used(values)
    assert len(used) == 18 and s.stats()["rescheduled"] == 1
    for k in (0, 2):  # no element read twice or skipped on a live worker
        mine = sorted(int(b[1]) for wk, b in used if wk == k)
        assert mine == list(range(len(mine)))
    led = s.ledger()
    for sh in led:
        assert sh["pushes"] == sh["applied"] + sh["stale"] + sh["backup"] + \
            sh["duplicate"], sh
    assert led[0]["duplicate"] == (1 if when == "push" else 0)
    assert s.global_step == s._executor.shard_step(1) >= 5
    s.shutdown()


def test_a_final_partial_batch_is_dropped_on_the_worker_and_ends_its_input():
    s, rep, w, opt, step, _, _ = _job(1, 0)
    it = rep.prepare_input(lambda ctx: [np.ones((2, 4), np.float32), 2 * np.ones(
        (2, 4), np.float32), np.ones((1, 4), np.float32)])
    with pytest.warns(UserWarning, match="worker 0 dropped a final partial batch"):
        values = [rep.run(step, it, w, opt) for _ in range(3)]
        rep.join()
    assert [float(v.fetch()[2].flat[0]) for v in values[:2]] == [1.0, 2.0]
    with pytest.raises(StopIteration, match="not run"):
        values[2].fetch()
    with pytest.raises(StopIteration):
        rep.run(step, it, w, opt)
    np.testing.assert_allclose(s.parameters(), np.full(4, -LR * 6.0))
    s.shutdown()
