"""``jr.one_replica``: code written for the replica axis (``nnx.BatchNorm(axis_name=
"batch")``, ``jax.lax.pmean(x, "batch")``) called outside ``run`` computes what the
same code computes on one device without an axis, and NNX state updates land as they
do there. The reference is a twin model built without ``axis_name``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr


class Net(nnx.Module):
    """BatchNorm over ``axis_name`` (None: the one-device twin) and dropout."""

    def __init__(self, axis_name, *, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name=axis_name, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, *, train=True):
        if not isinstance(train, bool):  # a flag stays a Python value, as in a direct call
            raise TypeError(f"train is a {type(train).__name__}")
        y = self.bn(self.lin(x), use_running_average=not train)
        return self.drop(y, deterministic=not train)

    def features(self, x):
        return self.bn(self.lin(x))


def _pair():
    return (Net("batch", rngs=nnx.Rngs(0, dropout=1)),
            Net(None, rngs=nnx.Rngs(0, dropout=1)))


def _assert_same_state(a, b):
    for u, v in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)),
                    strict=True):
        if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_without_it_the_axis_is_unbound():
    """What the docs answer: Flax's "call the model on a sample" raises this."""
    model, _ = _pair()
    with pytest.raises(NameError, match="unbound axis name: batch"):
        model(jnp.ones((2, 3)))


@settings(deadline=None, max_examples=6)
@given(batch=st.integers(1, 5), train=st.booleans(), calls=st.integers(1, 2),
       seed=st.integers(0, 2 ** 16))
def test_a_module_computes_and_updates_as_its_one_device_twin(batch, train, calls, seed):
    model, twin = _pair()
    xs = np.random.default_rng(seed).normal(size=(calls, batch, 3)).astype(np.float32)
    call = jr.one_replica(model, axis_name="batch")
    for x in xs:
        np.testing.assert_array_equal(call(x, train=train), twin(x, train=train))
    _assert_same_state(model, twin)  # running statistics and random streams moved alike
    if train:
        assert not np.allclose(np.asarray(model.bn.mean[...]), 0.0)


def test_bound_methods_and_modules_as_arguments_are_updated_in_place():
    model, twin = _pair()
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jr.one_replica(model.features, axis_name="batch")(x),
                                  twin.features(x))
    f = jr.one_replica(lambda m, x, scale=1.0: m(x) * scale, axis_name="batch")
    np.testing.assert_array_equal(f(model, x, scale=2.0), twin(x) * 2.0)
    nested = jr.one_replica(lambda d, x: d["net"](x), axis_name="batch")
    np.testing.assert_array_equal(nested({"net": model}, x), twin(x))
    _assert_same_state(model, twin)


def test_collectives_over_the_axis_are_those_of_one_replica():
    x = jnp.arange(6.0).reshape(2, 3)

    def f(x, label, extra=None):
        assert label == "as is" and extra is None  # non-array arguments pass unchanged
        return {"psum": jax.lax.psum(x, "i"), "pmean": jax.lax.pmean(x, "i"),
                "index": jax.lax.axis_index("i"), "gather": jax.lax.all_gather(x, "i"),
                "size": jax.lax.axis_size("i") * jnp.ones(())}

    out = jr.one_replica(f, axis_name="i")(x, "as is")
    np.testing.assert_array_equal(out["psum"], x)
    np.testing.assert_array_equal(out["pmean"], x)
    np.testing.assert_array_equal(out["gather"], x[None])
    assert int(out["index"]) == 0 and float(out["size"]) == 1.0
    assert jr.one_replica(jnp.sum)(x).shape == ()  # default: jr.REPLICA_AXIS, unused


def test_a_module_closed_over_is_refused_with_the_fix_and_left_as_it_was():
    model, twin = _pair()
    with pytest.raises(ValueError, match=r"Pass the module as an argument.*\(model, x\)"):
        jr.one_replica(lambda x: model(x), axis_name="batch")(jnp.ones((2, 3)))
    _assert_same_state(model, twin)  # nothing half-applied


def test_refused_where_the_axis_is_bound_already():
    """Binding the replica axis again with size 1 inside a step would give every
    replica its own batch statistics, silently: refused."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2],
                                            axis_name="batch"))
    with rep.scope():
        model = Net("batch", rngs=nnx.Rngs(0, dropout=1))
    with pytest.raises(RuntimeError, match="Call fn directly inside the step"):
        rep.run(lambda ctx, x, m: jr.one_replica(m, axis_name="batch")(x),
                jnp.ones((4, 3)), model)
    mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])
    with pytest.raises(RuntimeError, match="replica axis is bound already"):
        x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P("i")))
        jax.jit(jax.shard_map(lambda x: jr.one_replica(jnp.sum, axis_name="i")(x),
                              mesh=mesh, in_specs=P("i"), out_specs=P()))(x)


@pytest.mark.parametrize("fn, axis_name, error", [
    (3, "batch", TypeError), (jnp.sum, "", TypeError), (jnp.sum, None, TypeError)])
def test_bad_arguments_are_refused_at_once(fn, axis_name, error):
    with pytest.raises(error, match=r"jr.one_replica\("):
        jr.one_replica(fn, axis_name=axis_name)


def test_a_sample_call_before_training_changes_nothing_about_the_training():
    """Flax's tutorial habit: build the model in scope, call it once on a sample, then
    train. The sample call's state stays where run expects it (replicated on the
    strategy's mesh), and training matches the twin's one-device training after the
    same sample call."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4],
                                            axis_name="batch"))
    with rep.scope():
        model = Net("batch", rngs=nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    twin = Net(None, rngs=nnx.Rngs(0, dropout=1))
    twin_opt = nnx.Optimizer(twin, optax.sgd(0.1), wrt=nnx.Param)
    sample = jnp.ones((1, 3))
    assert jr.one_replica(model, axis_name="batch")(sample, train=False).shape == (1, 4)
    twin(sample, train=False)
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert leaf.sharding == rep.strategy.layout.replicated  # still where run wants it

    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)

    def step(ctx, x, model, opt):
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            jnp.sum(m(x, train=False) ** 2, -1), 8))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    loss = rep.run(step, x, model, opt)
    ref, g = nnx.value_and_grad(lambda m: jnp.mean(jnp.sum(m(x, train=False) ** 2, -1)))(twin)
    twin_opt.update(twin, g)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    for u, v in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(twin, nnx.Param))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-7)
