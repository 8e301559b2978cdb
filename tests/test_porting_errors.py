"""What code ported from ``jax.pmap`` or single-device Flax NNX meets at its first call,
each error naming the argument, the path, the shapes and the fix: a step left under
``@jax.jit`` / ``@nnx.jit``, state with a leading device axis
(``flax.jax_utils.replicate``), and NNX state left different on each replica (a
BatchNorm without ``axis_name``, a metric updated with per-replica values: the advice
is checked numerically against one device). Look-alikes run: a jitted helper inside the
step, parameters whose leading dimension happens to be 8, an argument sharded one row
per device whose rows differ."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils, nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr

N = 8


@functools.cache
def _rep():
    return jr.Replicator(jr.MirroredStrategy())


def _params():
    return {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones(2)}


TX = optax.sgd(0.1)


def _train(ctx, batch, params, opt):
    def loss(p):
        return jr.compute_average_loss(((batch @ p["w"] + p["b"]) ** 2).sum(-1), 16)
    g = jax.grad(loss)(params)
    u, opt = TX.update(g, opt, params)
    return optax.apply_updates(params, u), opt


def _one_device(params, batch):
    def loss(p):
        return ((batch @ p["w"] + p["b"]) ** 2).sum(-1).mean()
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))


BATCH = np.linspace(-1, 1, 48, dtype=np.float32).reshape(16, 3)


# -- a jitted step ----------------------------------------------------------------------
class _Trainer:
    @jax.jit
    def step(self, ctx, w):
        return w + 1


def _wrapped():
    def step(ctx, w):
        return w + 1
    return {
        "jax.jit": (jax.jit(step), "jax.jit"),
        "nnx.jit": (nnx.jit(step), "nnx.jit"),
        "partial of jax.jit": (functools.partial(jax.jit(step)), "jax.jit"),
        "method under jax.jit": (_Trainer().step, "jax.jit"),
        "jax.jit with static ctx": (jax.jit(step, static_argnums=0), "jax.jit"),
    }


@pytest.mark.parametrize("name", list(_wrapped()))
def test_a_jitted_step_is_refused_with_the_fix_before_any_input_is_taken(name):
    fn, kind = _wrapped()[name]
    rep = _rep()
    it = rep.prepare_input(lambda ctx: iter([np.float32(k) for k in range(2 * N)]))
    with pytest.raises(TypeError) as e:
        rep.run(fn, None, jnp.ones(2))
    msg = str(e.value)
    assert f"wrapped in {kind}" in msg and f"Remove @{kind} from the step" in msg
    assert "jitted function called inside the step" in msg
    with pytest.raises(TypeError, match="Remove @"):
        rep.run(fn, it, jnp.ones(2))
    # Nothing was taken from the iterator: the first step still gets batch 0..7.
    got = rep.run(lambda ctx, x: x, it)
    assert sorted(np.asarray(got.array).tolist()) == list(range(N))


def test_a_jitted_helper_called_inside_the_step_runs():
    helper = jax.jit(lambda x: x * 2)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    @nnx.jit
    def apply(m, x):
        return m(x)

    def step(ctx, batch, w, model):
        return ctx.all_sum(helper(batch).sum() + w.sum() + apply(model, batch).sum())

    want = 2 * BATCH.sum() + N * 2.0 + np.asarray(model(BATCH)).sum()
    got = _rep().run(step, BATCH, jnp.ones(2), model)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_a_jitted_step_is_refused_under_parameter_servers():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    try:
        rep = jr.Replicator(s)
        with pytest.raises(TypeError, match=r"wrapped in jax.jit"):
            rep.run(jax.jit(lambda ctx, w: w), None, jnp.ones(2))
    finally:
        s.shutdown()


# -- state with a device axis -----------------------------------------------------------
def test_state_from_jax_utils_replicate_is_refused_naming_argument_path_shape_and_fix():
    params = _params()
    state = jax_utils.replicate((params, TX.init(params)))
    assert state[0]["w"].shape == (N, 3, 2)
    with pytest.raises(ValueError) as e:
        _rep().run(_train, BATCH, *state)
    msg = str(e.value)
    for part in ("argument [0] has a leading device axis", "argument [0]['b']",
                 "of shape (8, 2)", "one row on each of 8 devices",
                 "flax.jax_utils.unreplicate(state)", "rep.replicate"):
        assert part in msg, part
    # Its own axis name (not flax's default) still shows: identical rows on every device.
    mine = jax_utils.replicate(params, axis_name="batch")
    with pytest.raises(ValueError, match=r"argument \[0\] has a leading device axis"):
        _rep().run(_train, BATCH, mine, TX.init(params))
    # The fix: unreplicate, and run equals one device.
    p, o = jax_utils.unreplicate(state)
    new, _ = _rep().run(_train, BATCH, p, o)
    want = _one_device(params, BATCH)
    for k in want:
        np.testing.assert_allclose(np.asarray(new[k]), want[k], rtol=1e-5, atol=1e-6)


def test_a_jax_pmap_output_passed_as_state_is_refused():
    w = jax.pmap(lambda x: x * 2)(np.arange(N * 3, dtype=np.float32).reshape(N, 3))
    with pytest.raises(ValueError, match=r"argument \[0\] has a leading device axis"):
        _rep().run(lambda ctx, w: w.sum(), None, w)  # rows differ, but pmap's mesh says


def test_an_nnx_module_from_jax_utils_replicate_is_refused():
    model = jax_utils.replicate(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"state of the Flax NNX argument\(s\) \[0\] has a "
                                         r"leading device axis"):
        _rep().run(lambda ctx, m: m.kernel[...].sum(), None, model)


def test_look_alikes_of_device_axis_state_run():
    rep = _rep()
    # Parameters whose leading dimension happens to be 8, made in scope or sharded by
    # rows: replicated state as any other.
    with rep.scope():
        table = jnp.arange(N * 4.0).reshape(N, 4)
    got = rep.run(lambda ctx, t: t.sum(), None, table)
    assert float(got) == float(np.arange(N * 4.0).sum())
    # One row per device on another mesh, rows that differ: each replica sees it whole.
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = jax.device_put(np.arange(N * 3.0).reshape(N, 3), NamedSharding(mesh, P("d")))
    got = rep.run(lambda ctx, r: r[ctx.replica_id].sum(), None, rows)
    np.testing.assert_allclose(np.asarray(got.array),
                               np.arange(N * 3.0).reshape(N, 3).sum(1))
    # Identical rows meant as a whole array: placed with rep.replicate, as the error says.
    same = jax_utils.replicate(jnp.arange(3.0))
    got = rep.run(lambda ctx, r: r.sum(), None, rep.replicate(same))
    assert float(got) == N * 3.0


def test_device_axis_state_is_refused_under_parameter_servers():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    try:
        rep = jr.Replicator(s)
        with rep.scope():
            w = jnp.zeros(3)
            tx = jr.ps.pushable(optax.sgd(0.1))
            opt = tx.init(w)
        with pytest.raises(ValueError, match=r"argument \[3\] has a leading device axis"
                           r".*\(e\.g\. argument \[3\]\['scale'\] of shape \(8, 3\)\)"):
            rep.run(lambda ctx, w, o, *extra: (w, o), None, w, opt, jnp.ones(2),
                    jax_utils.replicate({"shift": jnp.ones(2), "scale": jnp.ones(3)}))
    finally:
        s.shutdown()


# -- NNX state left different on each replica -------------------------------------------
class _Net(nnx.Module):
    def __init__(self, axis_name=None):
        self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(4, axis_name=axis_name, rngs=nnx.Rngs(1))
        self.head = nnx.Linear(4, 3, rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.linear(x))))


LABELS = np.arange(16) % 3


def _loss_and_logits(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), logits


def test_batchnorm_without_axis_name_names_the_fix_and_with_it_equals_one_device():
    def step(ctx, x, model):
        return ctx.all_sum(model(x).sum())

    with pytest.raises(ValueError) as e:
        _rep().run(step, BATCH, _Net())
    msg = str(e.value)
    for part in ("argument [0].bn.mean", "argument [0].bn.var",
                 "nnx.BatchNorm(..., axis_name='replica')", "BatchNorm's running statistics"):
        assert part in msg, part
    assert "ctx.all_sum(x) / ctx.num_replicas" not in msg
    # The fix, against one device on the global batch.
    model, ref = _Net(axis_name=jr.REPLICA_AXIS), _Net()
    out = _rep().run(step, BATCH, model)
    np.testing.assert_allclose(float(out), float(ref(BATCH).sum()), rtol=1e-5)
    for name in ("mean", "var"):
        np.testing.assert_allclose(getattr(model.bn, name)[...], getattr(ref.bn, name)[...],
                                   rtol=1e-5, atol=1e-7)


def _metrics():
    return nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                           accuracy=nnx.metrics.Accuracy())


# (all-reduces a replicated value on purpose: a pmap habit run warns about)
@pytest.mark.filterwarnings("ignore::jreplicate.ReplicationHabitWarning")
def test_a_metric_updated_per_replica_names_the_fix_and_the_fix_equals_one_device():
    def naive(ctx, batch, model, metrics):
        x, y = batch
        per_example, logits = _loss_and_logits(model, x, y)
        metrics.update(loss=jr.compute_average_loss(per_example, 16), logits=logits, labels=y)

    with pytest.raises(ValueError) as e:
        _rep().run(naive, (BATCH, LABELS), _Net(jr.REPLICA_AXIS), _metrics())
    msg = str(e.value)
    for part in ("argument [1].loss.total", "argument [1].accuracy.total",
                 "nnx.metrics metric's state", "ctx.all_sum(loss)",
                 "ctx.all_gather(logits).reshape(-1, *logits.shape[1:])",
                 "num_replicas times too small"):
        assert part in msg, part

    def advised(ctx, batch, model, metrics):  # as the error says
        x, y = batch
        per_example, logits = _loss_and_logits(model, x, y)
        loss = jr.compute_average_loss(per_example, 16)
        metrics.update(loss=ctx.all_sum(loss),
                       logits=ctx.all_gather(logits).reshape(-1, *logits.shape[1:]),
                       labels=ctx.all_gather(y).reshape(-1))

    def averaged(ctx, batch, model, metrics):  # the advice the error used to give
        naive(ctx, batch, model, metrics)
        for m in (metrics.loss, metrics.accuracy):
            for v in (m.total, m.count):
                v[...] = (ctx.all_sum(v[...]) / ctx.num_replicas).astype(v.dtype)

    model, ref_model = _Net(jr.REPLICA_AXIS), _Net()
    got, wrong, ref = _metrics(), _metrics(), _metrics()
    for k in range(2):
        x, y = BATCH * (k + 1), (LABELS + k) % 3
        _rep().run(advised, (x, y), model, got)
        _rep().run(averaged, (x, y), _Net(jr.REPLICA_AXIS), wrong)
        per_example, logits = _loss_and_logits(ref_model, x, y)
        ref.update(loss=per_example.mean(), logits=logits, labels=y)
    got, wrong, ref = got.compute(), wrong.compute(), ref.compute()
    np.testing.assert_allclose(float(got["loss"]), float(ref["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(got["accuracy"]), float(ref["accuracy"]), rtol=1e-6)
    np.testing.assert_allclose(float(wrong["loss"]) * N, float(ref["loss"]), rtol=1e-4)


def test_other_nnx_state_keeps_the_generic_hint():
    class Counter(nnx.Module):
        def __init__(self):
            self.seen = nnx.Variable(jnp.zeros(()))

    def step(ctx, x, c):
        c.seen[...] = c.seen[...] + x.sum()

    with pytest.raises(ValueError) as e:
        _rep().run(step, BATCH, Counter())
    msg = str(e.value)
    assert "argument [0].seen" in msg and "ctx.all_sum(x) / ctx.num_replicas" in msg
    assert "BatchNorm" not in msg and "metric" not in msg


def test_a_device_loop_carrying_per_replica_batch_stats_names_batchnorm_axis_name():
    rep = _rep()
    it = rep.prepare_input(lambda ctx: iter([np.ones(2, np.float32) * k
                                             for k in range(4 * N)]))

    def step(ctx, x, state):
        return {"params": state["params"], "batch_stats": state["batch_stats"] + x.mean()},

    state = {"params": jnp.ones(2), "batch_stats": jnp.zeros(2)}
    with pytest.raises(ValueError) as e:
        rep.run(step, it, state, steps=2)
    msg = str(e.value)
    assert "['batch_stats']" in msg and "axis_name='replica'" in msg
