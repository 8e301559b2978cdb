"""ParameterServerStrategy.create_per_worker_value (TensorFlow's per-worker resources,
PerWorkerValues): a value built once on each worker by a function, never on the driver,
that each step receives as the value of the worker running it; the values are let go
when the PerWorkerValue is collected; fn's error is the step's error."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.5


def _job(num_workers=3, g=1):
    """A linear loss sum(w * v): the gradient is the step's per-worker value v, so the
    trained parameters are -LR * (sum of the values of the workers that ran steps)."""
    s, rep, w, opt, tx = sgd_job(3, lr=LR, num_ps=1, num_workers=num_workers,
                                 num_replicas_in_sync=g)

    def step(ctx, w, opt, v):
        g_ = jax.grad(lambda w: jnp.sum(w * v["x"]))(w)
        u, opt = tx.update(g_, opt, w)
        return optax.apply_updates(w, u), opt, v["x"]

    step.tx = tx
    return s, rep, w, opt, step


def _value_fn(calls):
    def fn(wc):
        calls.append((threading.current_thread().name, wc))
        return {"x": np.array([wc.worker_index, wc.num_workers, 10.0], np.float32)}
    return fn


def _values(s):
    return [w.values for w in s._executor._carrier.workers]


@pytest.mark.parametrize("g", [1, 2])
def test_each_worker_sees_its_own_value_built_once_there(g):
    s, rep, w, opt, step = _job(num_workers=3, g=g)
    calls = []
    v = s.create_per_worker_value(_value_fn(calls))
    assert isinstance(v, jr.ps.PerWorkerValue) and not calls  # never on the driver
    out = [rep.run(step, None, w, opt, v) for _ in range(30)]
    rep.join()
    total = np.zeros(3)
    for r in out:  # the step's value is its worker's own
        got = np.asarray(r.fetch()[2]).reshape(3)
        np.testing.assert_array_equal(got, [r.worker, 3, 10.0])
        total += got
    ran = {r.worker for r in out}
    # fn ran once on each worker that ran a step, on its thread, with its context
    assert sorted(c.worker_index for _, c in calls) == sorted(ran)
    assert all(name.startswith("jreplicate-ps-worker-") for name, _ in calls)
    assert all(c.num_workers == 3 and c.num_replicas_in_sync == g for _, c in calls)
    # (the gradients of a sync group's replicas, the same here, are averaged)
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)


def test_two_values_and_a_per_worker_input_in_one_step():
    s, rep, w, opt, linear = _job(num_workers=2)
    tx = linear.tx
    tx_calls = []
    a = s.create_per_worker_value(lambda wc: {"x": np.full(3, wc.worker_index, np.float32)})
    b = s.create_per_worker_value(lambda wc: (tx_calls.append(1), np.float32(7.0))[1])
    it = rep.prepare_input(lambda ctx: [np.full(3, 100 * ctx.input_pipeline_id + i,
                                                 np.float32) for i in range(50)])

    def step(ctx, x, w, opt, a, b):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * (x + a["x"] + b)))(w), opt, w)
        return optax.apply_updates(w, u), opt, x + a["x"] + b

    out = [rep.run(step, it, w, opt, a, b) for _ in range(10)]
    rep.join()
    for r in out:
        got = np.asarray(r.fetch()[2]).reshape(3)
        x = got - r.worker - 7.0
        assert x[0] // 100 == r.worker  # the element of its own pipeline, and its value
    assert len(tx_calls) == len({r.worker for r in out})


def test_an_error_in_fn_is_the_steps_error_and_the_next_step_builds_again():
    s, rep, w, opt, step = _job(num_workers=1)
    tries = []

    def fn(wc):
        tries.append(wc.worker_index)
        if len(tries) == 1:
            raise RuntimeError("cannot build it yet")
        return {"x": np.ones(3, np.float32)}

    v = s.create_per_worker_value(fn)
    first = rep.run(step, None, w, opt, v)
    with pytest.raises(RuntimeError, match="cannot build it yet"):
        first.fetch()
    with pytest.raises(RuntimeError, match="cannot build it yet"):
        rep.join()
    second = rep.run(step, None, w, opt, v)
    np.testing.assert_array_equal(np.asarray(second.fetch()[2]).reshape(3), np.ones(3))
    rep.join()
    assert tries == [0, 0]
    np.testing.assert_allclose(s.parameters(), -LR * np.ones(3), rtol=1e-6)


def test_values_are_let_go_with_their_per_worker_value():
    s, rep, w, opt, step = _job(num_workers=2)
    out = []
    for _ in range(20):
        v = s.create_per_worker_value(_value_fn([]))
        out.append(rep.run(step, None, w, opt, v))
        del v  # its step holds it until it ended: it runs all the same
    rep.join()
    gc.collect()
    assert [vals.count() for vals in _values(s)] == [0, 0]
    total = sum(np.asarray(r.fetch()[2]).reshape(3) for r in out)
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)
    kept = s.create_per_worker_value(_value_fn([]))
    rep.run(step, None, w, opt, kept).fetch()
    assert sum(vals.count() for vals in _values(s)) == 1


def test_create_per_worker_value_refuses_what_is_not_a_function():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    with pytest.raises(ValueError, match="Replicator first"):
        s.create_per_worker_value(lambda wc: 1)
    jr.Replicator(s)
    with pytest.raises(TypeError, match="fn must be callable"):
        s.create_per_worker_value(3)
