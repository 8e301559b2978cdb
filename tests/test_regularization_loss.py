"""scale_regularization_loss: a batch-independent loss term (an L2 penalty) added on every
replica is applied once, not ``num_replicas_in_sync`` times, under every strategy.

Each check runs one replicated step with ``compute_average_loss(...) +
scale_regularization_loss(wd * sum(w ** 2))`` and compares the new parameters with a
NumPy step on the global batch with ``mean loss + wd * sum(w ** 2)``; the same step with
the term unscaled is shown to apply the penalty N times (why the function exists)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr

LR, D = 0.1, 3


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = rng.normal(size=(n,)).astype(np.float32)
    return x, y


def _w0():
    return {"w": np.array([1.0, -2.0, 0.5], np.float32), "b": np.float32(0.3)}


def _reference(w, x, y, wd, times=1.0):
    """One SGD step on the global batch: mean squared error + ``times * wd * |w|^2``,
    gradients written out by hand in float64."""
    ww, b = np.float64(w["w"]), np.float64(w["b"])
    r = x.astype(np.float64) @ ww + b - y
    gw = 2 * x.T @ r / len(y) + times * 2 * wd * ww
    gb = 2 * r.mean()
    return {"w": ww - LR * gw, "b": b - LR * gb}


def _loss(w, x, y, gbs, wd, scaled):
    per_example = (x @ w["w"] + w["b"] - y) ** 2
    reg = wd * jnp.sum(w["w"] ** 2)
    return jr.compute_average_loss(per_example, gbs) + (
        jr.scale_regularization_loss(reg) if scaled else reg)


def _unscaled_warned(scaled):
    """Unscaled, the term is a pmap habit run warns about (it is N-times weight decay):
    these tests show that effect on purpose."""
    if scaled:
        return contextlib.nullcontext()
    return pytest.warns(jr.ReplicationHabitWarning, match="batch_independent_term")


def _close(got, want):
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6)


def _sliced_step(scaled, wd, per):
    """A step whose replica takes its rows of the replicated global batch."""
    def step(ctx, w, x, y):
        i = ctx.replica_id * per
        xs = jax.lax.dynamic_slice_in_dim(x, i, per)
        ys = jax.lax.dynamic_slice_in_dim(y, i, per)
        g = jax.grad(_loss)(w, xs, ys, per * ctx.num_replicas_in_sync, wd, scaled)
        return jax.tree.map(lambda p, d: p - LR * d, w, g)
    return step


_STEPS = {}


def _mirrored_step(n, scaled):
    """One Replicator and step function per (n, scaled): compiled once per shape."""
    key = (n, scaled)
    if key not in _STEPS:
        rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))

        def step(ctx, w, x, y, wd):  # wd is an argument: one compile for every value
            return _sliced_step(scaled, wd, x.shape[0] // ctx.num_replicas)(ctx, w, x, y)

        _STEPS[key] = (rep, step)
    return _STEPS[key]


@pytest.mark.parametrize("scaled", [True, False])
def test_mirrored_8_replicas_equals_one_device(scaled):
    rep, step = _mirrored_step(8, scaled)
    x, y = _data(16)
    wd = 0.5
    with _unscaled_warned(scaled):
        got = rep.run(step, None, _w0(), x, y, jnp.float32(wd))
    if scaled:
        _close(got, _reference(_w0(), x, y, wd))
    else:  # the penalty is applied once per replica: 8-times weight decay
        _close(got, _reference(_w0(), x, y, wd, times=8))
        with pytest.raises(AssertionError):
            _close(got, _reference(_w0(), x, y, wd))


@pytest.mark.parametrize("scaled", [True, False])
def test_tpu_device_loop_equals_one_device_steps(scaled):
    """steps_per_run=3 over 4 replicas: three steps in one device loop equal three
    one-device steps, each on that step's global batch."""
    n, per, k, wd = 4, 2, 3, 0.25
    rep = jr.Replicator(jr.TPUStrategy(devices=jax.devices()[:n], steps_per_run=k))
    xs, ys = _data(k * n * per, seed=1)
    xs, ys = xs.reshape(k, n, per, D), ys.reshape(k, n, per)
    inputs = rep.prepare_input(
        lambda ctx: iter([(xs[s, ctx.input_pipeline_id], ys[s, ctx.input_pipeline_id])
                          for s in range(k)]),
        jr.InputReplicationMode.PER_REPLICA)

    def step(ctx, batch, w):
        x, y = batch
        g = jax.grad(_loss)(w, x, y, per * ctx.num_replicas_in_sync, wd, scaled)
        return jax.tree.map(lambda p, d: p - LR * d, w, g)

    with _unscaled_warned(scaled):
        got = rep.run(step, inputs, _w0())
    want = _w0()
    for s in range(k):
        want = _reference(want, xs[s].reshape(-1, D), ys[s].reshape(-1), wd,
                          times=1 if scaled else n)
    _close(got, want)


def _ps_step(tx, wd, per, scaled):
    def step(ctx, w, opt, x, y):
        i = ctx.replica_id * per
        xs = jax.lax.dynamic_slice_in_dim(x, i, per)
        ys = jax.lax.dynamic_slice_in_dim(y, i, per)
        g = jax.grad(_loss)(w, xs, ys, per * ctx.num_replicas_in_sync, wd, scaled)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt
    return step


@pytest.mark.parametrize("g, scaled", [(1, True), (4, True), (4, False)])
def test_parameter_server_worker_push_equals_one_device(g, scaled):
    """Embedded parameter servers, one worker whose sync group has ``g`` replicas: the
    applied push equals a one-device step on the group's batch. With ``g == 1`` (no
    sync group) the term is unchanged, as a worker's push is applied on its own."""
    per, wd = 2, 0.5
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=g)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jax.tree.map(jnp.asarray, _w0())
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    x, y = _data(g * per, seed=2)
    with _unscaled_warned(scaled):  # (on the worker)
        rep.run(_ps_step(tx, wd, per, scaled), None, w, opt, x, y)
        rep.join()
    _close(s.parameters(), _reference(_w0(), x, y, wd, times=1 if scaled else g))


def test_terms_are_summed_and_checked():
    w = jnp.array([1.0, 2.0])
    assert float(jr.scale_regularization_loss((jnp.sum(w), 1.0, np.float32(2.0)))) == 6.0
    assert float(jr.scale_regularization_loss(jnp.float32(3.0))) == 3.0
    with pytest.raises(ValueError, match=r"regularization_loss\[1\].*shape \(2,\).*jnp.sum"):
        jr.scale_regularization_loss([1.0, w])
    with pytest.raises(ValueError, match=r"regularization_loss=.*shape \(2,\)"):
        jr.scale_regularization_loss(w)
    with pytest.raises(ValueError, match="no term"):
        jr.scale_regularization_loss([])
    with pytest.raises(TypeError, match=r"regularization_loss\[0\].*str"):
        jr.scale_regularization_loss(["a"])


def test_logical_devices_divide_by_replicas_not_devices():
    """4 replicas x 2 logical devices: the term is divided by 4 replicas in sync."""
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    assert rep.num_replicas_in_sync == 4
    out = rep.run(lambda ctx: ctx.all_sum(jr.scale_regularization_loss(jnp.float32(2.0))))
    assert float(out) == pytest.approx(2.0)


@settings(max_examples=12, deadline=None)
@given(n=st.sampled_from([1, 2, 4, 8]), wd=st.floats(0.0, 2.0, width=32),
       seed=st.integers(0, 2 ** 16))
def test_any_replica_count_equals_one_device(n, wd, seed):
    rep, step = _mirrored_step(n, True)
    x, y = _data(8, seed)
    w0 = {"w": np.random.default_rng(seed).normal(size=D).astype(np.float32),
          "b": np.float32(0.0)}
    got = rep.run(step, None, w0, x, y, jnp.float32(wd))
    _close(got, _reference(w0, x, y, np.float32(wd)))
