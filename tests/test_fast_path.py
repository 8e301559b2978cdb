"""The steady-state path of run (jreplicate/execution/fast.py): a call shaped like an
earlier one skips the checks; whatever changes between calls gets the full path's
result or error, never a stale program's."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.execution import fast


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy())


def _per_replica(rep, x):
    return jr.PerReplica(jax.device_put(x, NamedSharding(rep.mesh, P("replica"))), rep.mesh)


def _step(ctx, x, w):
    return w * 2.0, ctx.all_sum(jnp.sum(x * w)), x + ctx.replica_id


def _ref(x, w):
    """The step in numpy, one replica after the other."""
    return (w * 2.0, np.sum(x * w), x + np.arange(len(x)).reshape((-1,) + (1,) * (x.ndim - 1)))


def _check(out, x, w):
    ref = _ref(np.asarray(x), np.asarray(w))
    np.testing.assert_allclose(np.asarray(out[0]), ref[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1]), ref[1], rtol=1e-5)
    assert isinstance(out[2], jr.PerReplica)
    np.testing.assert_allclose(np.asarray(out[2].array), ref[2], rtol=1e-6)


def test_steady_state_calls_take_the_fast_path_and_match_numpy(rep, counted):
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    w = rep.replicate(jnp.ones(3))  # placed for the mesh: nothing to copy per call
    for _ in range(5):
        out = rep.run(_step, _per_replica(rep, x), w)
        _check(out, x, w)
    assert counted == {"hit": 4, "miss": 1}


def test_a_new_shape_or_dtype_traces_once_more_and_is_right(rep, counted):
    traces = []

    def step(ctx, x, w):
        traces.append(x.shape)
        return _step(ctx, x, w)

    x = np.ones((8, 3), np.float32)
    w = jnp.ones(3)
    rep.run(step, _per_replica(rep, x), w)
    rep.run(step, _per_replica(rep, x), w)
    assert len(traces) == 1
    x2 = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8, 3, 2)
    w2 = jnp.full((3, 2), 0.5)
    out = rep.run(step, _per_replica(rep, x2), w2)
    _check(out, x2, w2)
    assert len(traces) == 2  # the steady-state attempt traced nothing of the step
    out = rep.run(step, _per_replica(rep, x), w.astype(jnp.bfloat16))
    assert out[0].dtype == jnp.bfloat16
    assert len(traces) == 3


def test_a_too_big_numpy_value_after_steady_state_is_still_an_error(rep):
    x = _per_replica(rep, np.ones((8, 3), np.float32))
    for _ in range(3):
        rep.run(lambda ctx, x, n: x * n, x, jnp.int32(2))
    with pytest.raises(ValueError, match="does not fit int32"):
        rep.run(lambda ctx, x, n: x * n, x, np.int64(2**40))


def test_donated_state_errors_are_jreplicates_after_steady_state(rep, counted):
    x = _per_replica(rep, np.ones((8, 3), np.float32))
    w = rep.replicate(jnp.ones(3))

    def step(ctx, x, w):
        return w + 1.0

    for _ in range(3):
        w = rep.run(step, x, w, donate_argnums=0)
    assert counted["hit"] == 2
    box = [w]  # its only holder: donated (an array something else holds is copied)
    del w
    w = rep.run(step, x, box[0], donate_argnums=0)
    with pytest.raises(ValueError, match=r"argument \[0\] is an array that was donated"):
        rep.run(step, x, box[0], donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(w), np.full(3, 5.0))
    assert counted["hit"] == 3

    def two(ctx, x, a, b):
        return a + b, b

    a, b = rep.replicate((jnp.ones(3), jnp.ones(3)))
    for _ in range(3):
        a, b = rep.run(two, x, a, b, donate_argnums=0)
    with pytest.raises(ValueError, match="is donated .* but the same array is also passed"):
        rep.run(two, x, a, a, donate_argnums=0)


def test_a_per_replica_of_the_wrong_length_after_steady_state(rep):
    w = jnp.ones(3)
    for _ in range(3):
        rep.run(_step, _per_replica(rep, np.ones((8, 3), np.float32)), w)
    bad = jr.PerReplica(jnp.ones((16, 3)), rep.mesh)
    with pytest.raises(ValueError, match="needs a leading axis of one value per replica"):
        rep.run(_step, bad, w)


def test_an_argument_placed_elsewhere_after_steady_state(rep):
    x = np.ones((8, 3), np.float32)
    for _ in range(3):
        rep.run(_step, _per_replica(rep, x), jnp.ones(3))
    w = jax.device_put(jnp.full(3, 3.0), jax.devices()[5])  # committed to one device
    _check(rep.run(_step, _per_replica(rep, x), w), x, w)
    other = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:4]))
    w4 = other.replicate(jnp.full(3, 4.0))  # replicated over another mesh
    _check(rep.run(_step, _per_replica(rep, x), w4), x, w4)


def test_new_function_objects_with_one_id_never_get_a_stale_program(rep):
    x = _per_replica(rep, np.ones((8, 3), np.float32))
    w = jnp.ones(3)

    def make(k):
        return lambda ctx, x, w: w * k

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run warns of the new function objects
        for k in range(12):  # a freed lambda's id is reused by the next one
            fn = make(float(k))
            np.testing.assert_array_equal(np.asarray(rep.run(fn, x, w)), np.full(3, float(k)))
            del fn


def test_equals_the_full_path_bit_for_bit(rep, monkeypatch):
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(8, 4, 5)).astype(np.float32) for _ in range(6)]

    def step(ctx, x, p, o):
        g = jax.grad(lambda p: jr.compute_average_loss(jnp.sum((x @ p) ** 2, -1), 32))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    def train():
        with rep.scope():
            p = jnp.ones((5, 2))
        o = tx.init(p)
        for x in xs:
            p, o = rep.run(step, _per_replica(rep, x), p, o)
        return p

    fast_p = train()
    monkeypatch.setattr(fast, "_ARRAY", None)  # every call on the full path
    np.testing.assert_array_equal(np.asarray(fast_p), np.asarray(train()))


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.b = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def _nnx_step(ctx, x, model, opt):
    loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
        jnp.sum(m(x) ** 2, -1), 16))(model)
    opt.update(model, g)
    return ctx.all_sum(loss)


def _train_nnx(rep, x):
    """Three steps, a Variable replaced (same structure), three more steps."""
    with rep.scope():
        model = _Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    losses = [rep.run(_nnx_step, x, model, opt) for _ in range(3)]
    with rep.scope():
        model.b.bias = nnx.Param(jnp.full((2,), 0.25, jnp.float32))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    losses += [rep.run(_nnx_step, x, model, opt) for _ in range(3)]
    return model, losses


def test_nnx_steady_state_writes_back_and_follows_replaced_variables(rep, counted,
                                                                     monkeypatch):
    x = _per_replica(rep, np.random.default_rng(1).normal(size=(8, 2, 3)).astype(np.float32))
    model, losses = _train_nnx(rep, x)
    assert counted["hit"] >= 4  # the first call and the one after the change: full path
    assert float(model.b.bias[...][0]) != 0.25  # the new Variable was trained
    monkeypatch.setattr(fast, "_ARRAY", None)  # the full path every time
    twin, twin_losses = _train_nnx(rep, x)
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(twin_losses))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(twin))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_variable_shared_after_steady_state_takes_the_full_path(rep, counted):
    x = _per_replica(rep, np.ones((8, 2, 3), np.float32))

    class Two(nnx.Module):
        def __init__(self):
            self.u = nnx.Param(jnp.ones(3))
            self.v = nnx.Param(jnp.ones(3))

    def step(ctx, x, m):
        m.u[...] = m.u[...] + 1.0
        m.v[...] = m.v[...] * 3.0

    with rep.scope():
        m = Two()
    for _ in range(3):
        rep.run(step, x, m)
    assert counted["hit"] == 2
    m.v = m.u  # one Variable under two names now
    misses = counted["miss"]
    rep.run(step, x, m)
    assert counted["miss"] == misses + 1
    # nnx.split/merge semantics: u += 1 then the same Variable *= 3.
    np.testing.assert_array_equal(np.asarray(m.u[...]), np.full(3, (4.0 + 1.0) * 3.0))
    assert m.u is m.v


def test_model_sharded_argument_resharded_after_steady_state():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    split = NamedSharding(rep.mesh, P(None, jr.MODEL_AXIS))
    x = jr.PerReplica(jax.device_put(np.ones((4, 2, 4), np.float32),
                                     NamedSharding(rep.mesh, P("replica"))), rep.mesh)

    def step(ctx, x, w):
        return w + ctx.all_sum(jnp.sum(x)), ctx.all_sum(jnp.sum(x @ w))

    w = jax.device_put(jnp.ones((4, 6)), split)
    for _ in range(3):
        w, _ = rep.run(step, x, w)
    assert w.sharding.spec == P(None, jr.MODEL_AXIS)
    w = rep.replicate(np.asarray(w))  # now replicated: its new value stays replicated
    w, s = rep.run(step, x, w)
    assert w.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(w), np.full((4, 6), 1 + 4 * 32.0))
    assert float(s) == pytest.approx(4 * 2 * 6 * 4 * (1 + 3 * 32))


def test_nnx_modules_inside_a_list_are_written_back_every_step(rep):
    x = _per_replica(rep, np.ones((8, 2, 3), np.float32))

    class Counter(nnx.Module):
        def __init__(self):
            self.n = nnx.Variable(jnp.zeros((), jnp.float32))

    def step(ctx, x, plain, mods):
        for m in mods:
            m.n[...] = m.n[...] + 1.0
        return plain

    with rep.scope():
        mods = [Counter(), Counter()]
        plain = rep.replicate(jnp.ones(2))
    for _ in range(5):
        plain = rep.run(step, x, plain, mods)
    assert [float(m.n[...]) for m in mods] == [5.0, 5.0]
