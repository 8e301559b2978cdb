"""Bad input gets a clear error naming the fix, and nothing is half-updated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jreplicate as jr


def test_mirrored_rejects_no_devices_or_duplicates():
    with pytest.raises(ValueError, match="no devices"):
        jr.MirroredStrategy(devices=[])
    d = jax.local_devices()
    with pytest.raises(ValueError, match="twice.*Remove the duplicate"):
        jr.MirroredStrategy(devices=[d[0], d[1], d[0]])
    with pytest.raises(ValueError, match="twice"):
        jr.MirroredStrategy(devices=[3, 3])
    with pytest.raises(ValueError, match="not the id of a local device"):
        jr.MirroredStrategy(devices=[0, 99])
    with pytest.raises(TypeError, match="jax.Device"):
        jr.MirroredStrategy(devices=["cpu:0"])
    with pytest.raises(TypeError, match="sequence"):
        jr.MirroredStrategy(devices=d[0])


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_mirrored_subsets(n):
    s = jr.MirroredStrategy(devices=jax.local_devices()[:n])
    assert s.num_replicas == n and s.devices == tuple(jax.local_devices()[:n])
    assert s.local_replica_ids == tuple(range(n)) and s.num_workers == 1


def test_replicator_needs_strategy():
    with pytest.raises(TypeError, match="MirroredStrategy"):
        jr.Replicator("mirrored")


def test_inputs_from_another_replicator():
    a, b = jr.Replicator(jr.MirroredStrategy()), jr.Replicator(jr.MirroredStrategy())
    inputs = a.prepare_input(lambda ctx: lambda: np.ones(2))
    with pytest.raises(ValueError, match="prepared by another Replicator"):
        b.run(lambda ctx, x: x, inputs)
    c = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with pytest.raises(ValueError, match="another Replicator"):
        c.run(lambda ctx, x: x, inputs.get_next())


def test_non_array_argument_named():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with pytest.raises(TypeError, match=r"argument \[1\]\['name'\] is a str.*partial"):
        rep.run(lambda ctx, a, b: a, None, jnp.ones(2), {"name": "x"})
    with pytest.raises(TypeError, match=r"str at output \['label'\]"):
        rep.run(lambda ctx: {"label": "x"})


def test_failed_step_leaves_state_untouched():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)
    before = np.asarray(model.kernel[...]).copy()

    def bad(ctx, model, opt):
        grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
        opt.update(model, grads)
        return ctx.broadcast(model.kernel[...], 5)  # out of range: raises at trace time

    with pytest.raises(ValueError, match="out of range"):
        rep.run(bad, None, model, opt)
    np.testing.assert_array_equal(model.kernel[...], before)
    assert int(opt.step[...]) == 0


def test_nnx_state_that_differs_per_replica_is_rejected():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def f(ctx, model):
        model.bias[...] = model.bias[...] + ctx.replica_id

    with pytest.raises(ValueError, match="different on each replica.*all_sum"):
        rep.run(f, None, model)


def test_non_array_argument_named_by_its_position_after_nnx_modules():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"argument \[1\]\['name'\] is a str"):
        rep.run(lambda ctx, m, cfg: m.bias[...], None, model, {"name": "x"})
    with pytest.raises(TypeError, match=r"argument \[2\]\[0\] is a str"):
        rep.run(lambda ctx, m, w, cfg: w, None, model, jnp.ones(2), ["x"])


def test_per_replica_without_one_row_per_replica_is_rejected():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
    # 8 rows for 4 replicas: shard_map alone would give replica r row 2r, silently.
    with pytest.raises(ValueError, match=r"argument \[0\] is a PerReplica.*\(8, 1\).*\(4\)"):
        rep.run(lambda ctx, x: x, None, jr.PerReplica(np.arange(8.0).reshape(8, 1)))
    with pytest.raises(ValueError, match=r"input batch \['x'\] is a PerReplica.*\(\)"):
        rep.run(lambda ctx, b: b, {"x": jr.PerReplica(np.float32(1))})
    ok = rep.run(lambda ctx, x: x * 2, None, jr.PerReplica(np.arange(4.0)))
    assert [float(v) for v in ok] == [0.0, 2.0, 4.0, 6.0]


def test_module_and_array_in_a_tuple_fail_before_any_update():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def f(ctx, pair):
        pair[0].bias[...] = pair[0].bias[...] + 1
        return pair[0](pair[1])

    with pytest.raises(ValueError, match=r"argument\(s\) \[0\].*tuple.*separate arguments"):
        rep.run(f, None, (model, jnp.ones((1, 2))))
    np.testing.assert_array_equal(model.bias[...], [0.0, 0.0])  # not half-applied
    pair = [model, np.ones((1, 2), np.float32)]  # a list can be updated in place
    rep.run(f, None, pair)
    np.testing.assert_array_equal(model.bias[...], [1.0, 1.0])


def test_nnx_module_under_outer_jit_gets_a_hint():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    @nnx.jit
    def outer(model):
        return rep.run(lambda ctx, m: m.kernel[...].sum(), None, model)

    with pytest.raises(TypeError, match="outer jax.jit.*Call run outside"):
        outer(model)
