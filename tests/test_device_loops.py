"""Device loops: ``run(fn, inputs, *args, steps=K)`` is one compiled ``lax.scan``."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._models import init_mlp, mlp, per_example_loss
from tests._optional import needs_devices

PER = 4
TX = optax.adam(1e-2)


def _data(rep, steps):
    gb = rep.num_replicas * PER
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, gb, 16)).astype(np.float32)
    ys = rng.integers(0, 10, size=(steps, gb)).astype(np.int32)
    return xs, ys


def _inputs(rep, xs, ys, **kw):
    def input_fn(ctx):
        r = ctx.input_pipeline_id
        return ((xs[s, r * PER:(r + 1) * PER], ys[s, r * PER:(r + 1) * PER])
                for s in range(len(xs)))
    return rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA, **kw)


def _step(gb):
    def step(ctx, batch, p, o):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jr.compute_average_loss(
            per_example_loss(mlp(p, x), y), gb))(p)
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss), loss
    return step


def _state(rep):
    with rep.scope():
        p = init_mlp(jax.random.key(1))
        return p, TX.init(p)


def _exactly_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("prefetch", [False, True])
def test_k_steps_equal_k_separate_runs_exactly(strategy, prefetch):
    if isinstance(strategy, jr.ParameterServerStrategy):
        pytest.skip("device loops are compiled SPMD programs; a parameter server runs one "
                    "step per push")
    rep = jr.Replicator(strategy)
    n, steps, k = rep.num_replicas, 7, 3
    xs, ys = _data(rep, steps)
    step = _step(n * PER)
    p, o = _state(rep)
    ref_losses, ref_per = [], []
    inputs = _inputs(rep, xs, ys, prefetch_on_device=prefetch)
    for _ in range(steps):
        p, o, loss, per = rep.run(step, inputs, p, o)
        ref_losses.append(loss)
        ref_per.append(per)

    q, r = _state(rep)
    inputs = _inputs(rep, xs, ys, prefetch_on_device=prefetch)
    losses, pers = [], []
    for want in (3, 3, 1):  # 7 steps = 3 + 3 + a tail of 1
        q, r, loss, per = rep.run(step, inputs, q, r, steps=k)
        assert loss.shape == (want,)
        assert isinstance(per, jr.PerReplica) and per.array.shape == (n, want)
        losses.extend(loss)
        pers.append(per)
    with pytest.raises(StopIteration):
        rep.run(step, inputs, q, r, steps=k)
    _exactly_equal((q, r), (p, o))
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(ref_losses))
    per_steps = np.concatenate([np.asarray(x.array) for x in pers], axis=1)
    np.testing.assert_array_equal(per_steps, np.stack([np.asarray(x.array) for x in ref_per], 1))
    # Replica r's stacked value is its per-step losses.
    np.testing.assert_array_equal(np.asarray(pers[0][n - 1]),
                                  [float(x[n - 1]) for x in ref_per[:3]])


def test_nnx_model_and_optimizer_are_carried_in_place():
    from flax import nnx

    rep = jr.Replicator(jr.MirroredStrategy())
    xs, ys = _data(rep, 6)
    gb = rep.num_replicas * PER

    def make():
        with rep.scope():
            model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu,
                                   nnx.Linear(32, 10, rngs=nnx.Rngs(1)))
            return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def step(ctx, batch, model, opt):
        x, y = batch
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            per_example_loss(m(x), y), gb))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    m1, o1 = make()
    inputs = _inputs(rep, xs, ys)
    ref = [rep.run(step, inputs, m1, o1) for _ in range(6)]
    m2, o2 = make()
    inputs = _inputs(rep, xs, ys)
    losses = np.concatenate([np.asarray(rep.run(step, inputs, m2, o2, steps=4)),
                             np.asarray(rep.run(step, inputs, m2, o2, steps=4))])
    np.testing.assert_array_equal(losses, np.asarray(ref))
    _exactly_equal(nnx.state(m2), nnx.state(m1))
    _exactly_equal(nnx.state(o2), nnx.state(o1))


def test_per_step_randomness_through_fold_in_of_a_carried_step():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))

    def step(ctx, key, count, acc):
        k = jax.random.fold_in(jax.random.fold_in(key, count), ctx.replica_id)
        noise = ctx.all_sum(jax.random.normal(k, (3,)))
        return key, count + 1, acc + noise, noise

    key, count, acc = jax.random.key(0), jnp.int32(0), jnp.zeros(3)
    outs = []
    for _ in range(5):
        key, count, acc, noise = rep.run(step, None, key, count, acc)
        outs.append(noise)
    key2, count2, acc2, noise2 = rep.run(step, None, jax.random.key(0), jnp.int32(0),
                                         jnp.zeros(3), steps=5)
    assert int(count2) == 5 and noise2.shape == (5, 3)
    np.testing.assert_array_equal(np.asarray(noise2), np.stack(outs))
    np.testing.assert_array_equal(np.asarray(acc2), np.asarray(acc))
    assert len({tuple(np.asarray(x).round(5)) for x in noise2}) == 5  # differs per step


@needs_devices(2)
def test_tail_compiles_once_per_length_and_a_second_sweep_compiles_nothing():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    traces = []

    def step(ctx, batch, total):
        traces.append(1)
        return total + ctx.all_sum(jnp.sum(batch)), jnp.sum(batch)

    data = [np.full((2,), float(i), np.float32) for i in range(10)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)
    for _sweep in range(2):
        total, seen = jnp.float32(0), []
        while True:
            try:
                total, per = rep.run(step, inputs, total, steps=4)
            except StopIteration:
                break
            seen.append(per.array.shape[1])
        assert seen == [4, 4, 2]
        assert float(total) == 2 * 2 * sum(range(10))
        inputs.reinitialize()
    assert len(traces) == 2  # the 4-step loop and the 2-step tail, each traced once


@needs_devices(2)
def test_partial_final_batch_mid_loop_is_dropped_with_a_warning():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    data = [np.ones((3,), np.float32)] * 5 + [np.ones((1,), np.float32)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)

    def step(ctx, batch, n):
        return n + ctx.all_sum(batch.shape[0] * 1.0)

    n = jnp.float32(0)
    n = rep.run(step, inputs, n, steps=4)
    with pytest.warns(UserWarning, match="dropped a final partial batch"):
        n = rep.run(step, inputs, n, steps=4)  # 1 full step, then the short element
    assert float(n) == 5 * 2 * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StopIteration):
            rep.run(step, inputs, n, steps=4)


def test_loop_without_input():
    rep = jr.Replicator(jr.MirroredStrategy())
    n = rep.num_replicas  # 8 here; any count on an accelerator (bench/device_check.py)
    x, ids = rep.run(lambda ctx, x: (x * 2, ctx.replica_id), None, jnp.ones(2), steps=3)
    np.testing.assert_array_equal(np.asarray(x), [8.0, 8.0])
    assert isinstance(ids, jr.PerReplica) and ids.array.shape == (n, 3)
    np.testing.assert_array_equal(np.asarray(ids[n - 1]), [n - 1] * 3)
    # One argument, returned alone: the result is its final value.
    y = rep.run(lambda ctx, y: y + 1, None, jnp.zeros(()), steps=4)
    assert float(y) == 4


@needs_devices(2)
def test_loop_errors_name_the_fix():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    w = jnp.ones(3)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=r"steps must be an int >= 1"):
            rep.run(lambda ctx, w: (w,), None, w, steps=bad)
    pr = rep.run(lambda ctx: ctx.replica_id)
    with pytest.raises(TypeError, match=r"steps=K\) takes its K batches from an InputIterator"):
        rep.run(lambda ctx, b: b, pr, steps=2)
    with pytest.raises(ValueError, match=r"must return their new values first.*argument \[0\]"):
        rep.run(lambda ctx, w: jnp.sum(w["a"]), None, {"a": w}, steps=2)
    with pytest.raises(ValueError, match=r"argument \[0\] with shape \(\) and dtype float32.*"
                                         r"came in with shape \(3,\)"):
        rep.run(lambda ctx, w: (jnp.sum(w), 1.0), None, w, steps=2)
    with pytest.raises(ValueError, match=r"different on each replica.*ctx.all_sum"):
        rep.run(lambda ctx, w: (w * ctx.replica_id,), None, w, steps=2)


@needs_devices(2)
def test_prefetch_stages_loops_and_mixing_modes_loses_nothing():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    data = [np.full((1,), float(i), np.float32) for i in range(20)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA,
                               prefetch_on_device=True, prefetch_buffer_size=2)

    def step(ctx, batch, n):
        return n + 1, batch[0]

    seen, n, lengths = [], jnp.int32(0), []
    for k in itertools.cycle((3, None, None, 4, 3, None, 5, 5)):
        try:
            if k is None:
                n, v = rep.run(step, inputs, n)
                seen.append(int(v[0]))
            else:
                n, v = rep.run(step, inputs, n, steps=k)
                seen.extend(int(x) for x in np.asarray(v[0]))
                lengths.append(len(v[0]))
        except StopIteration:
            break
    # Every element once, in order, whichever way it was staged; loops up to K long.
    assert seen == list(range(20)) and int(n) == 20
    assert lengths[0] == 3 and max(lengths) <= 5
