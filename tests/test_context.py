"""ReplicaContext collectives: the Replicator design's two-replica examples, and numpy
references on random pytrees for 1, 2, 4 and 8 replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr

V0 = {"a": 1, "b": np.array([40, 1])}
V1 = {"a": 3, "b": np.array([2, 98])}


def _rep(n):
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))


def _seed_value(ctx):
    return jax.tree.map(lambda a, b: jnp.where(ctx.replica_id == 0, a, b), V0, V1)


def _as_lists(tree):
    return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)


@pytest.mark.parametrize("name, expected", [
    ("all_sum", {"a": 4, "b": [42, 99]}),
    ("all_min", {"a": 1, "b": [2, 1]}),
    ("all_max", {"a": 3, "b": [40, 98]}),
    ("all_gather", {"a": [1, 3], "b": [[40, 1], [2, 98]]}),
])
def test_seed_examples(name, expected):
    out = _rep(2).run(lambda ctx: getattr(ctx, name)(_seed_value(ctx)))
    # Identical on both replicas, so returned replicated (not PerReplica).
    assert not any(isinstance(x, jr.PerReplica) for x in jax.tree.leaves(
        out, is_leaf=lambda x: isinstance(x, jr.PerReplica)))
    assert _as_lists(out) == expected


def test_seed_broadcast_example():
    out = _rep(2).run(lambda ctx: ctx.broadcast(_seed_value(ctx), 1))
    assert _as_lists(out) == {"a": 3, "b": [2, 98]}


def test_broadcast_costs_one_all_reduce():
    rep = _rep(4)

    def f(ctx, x):
        return ctx.broadcast(x * (ctx.replica_id + 1), 2)

    x = jnp.arange(6.0)
    out = rep.run(f, None, x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(6.0) * 3)
    hlo = jax.jit(lambda x: rep.run(f, None, x)).lower(x).as_text()
    assert hlo.count("all_reduce") + hlo.count("all-reduce") == 1
    assert "all_gather" not in hlo and "all-gather" not in hlo


def test_broadcast_bool_and_int_dtypes_preserved():
    def f(ctx):
        return ctx.broadcast({"m": ctx.replica_id % 2 == 1, "i": ctx.replica_id * 7}, 3)

    out = _rep(4).run(f)
    assert out["m"].dtype == jnp.bool_ and bool(out["m"]) is True
    assert out["i"].dtype == jnp.int32 and int(out["i"]) == 21


@pytest.mark.parametrize("src", [-1, 2, 100])
def test_broadcast_source_out_of_range(src):
    with pytest.raises(ValueError, match=r"source_replica_id=.*out of range.*\[0, 1\]"):
        _rep(2).run(lambda ctx: ctx.broadcast(ctx.replica_id, src))


def test_broadcast_source_must_be_static_int():
    with pytest.raises(TypeError, match="source_replica_id"):
        _rep(2).run(lambda ctx: ctx.broadcast(ctx.replica_id, ctx.replica_id))
    with pytest.raises(TypeError, match="must be an int"):
        _rep(2).run(lambda ctx: ctx.broadcast(ctx.replica_id, 1.0))


@pytest.mark.parametrize("name", ["all_sum", "all_min", "all_max", "all_gather", "broadcast"])
def test_non_array_leaf_named_in_error(name):
    def f(ctx):
        value = {"ok": ctx.replica_id, "bad": ["x", "label"]}
        return ctx.broadcast(value, 0) if name == "broadcast" else getattr(ctx, name)(value)

    with pytest.raises(TypeError, match=r"\['bad'\]\[0\].*str.*not an array"):
        _rep(2).run(f)


def test_per_replica_inside_collective_is_rejected():
    rep = _rep(2)
    ids = rep.run(lambda ctx: ctx.replica_id)
    with pytest.raises(TypeError, match="PerReplica"):
        rep.run(lambda ctx: ctx.all_sum({"x": ids}))


def test_replicated_values_reduce_as_if_each_replica_held_them():
    out = _rep(4).run(lambda ctx: (ctx.all_sum(2.0), ctx.all_min(jnp.ones(2)),
                                    ctx.all_gather(jnp.array(5)), ctx.broadcast(1.5, 3)))
    assert float(out[0]) == 8.0
    assert out[1].tolist() == [1.0, 1.0]
    assert out[2].tolist() == [5, 5, 5, 5]
    assert float(out[3]) == 1.5


def test_logical_device():
    def f(ctx):
        with ctx.logical_device(0):
            return ctx.replica_id + 0

    assert len(_rep(2).run(f)) == 2
    with pytest.raises(ValueError, match="one logical device"):
        _rep(2).run(lambda ctx: ctx.logical_device(1))


@settings(deadline=None, max_examples=12)
@given(n=st.sampled_from([1, 2, 4, 8]), shape=st.sampled_from([(), (3,), (2, 3)]),
       seed=st.integers(0, 2**16))
def test_collectives_match_numpy(n, shape, seed):
    data = np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32)
    ints = np.random.default_rng(seed + 1).integers(-50, 50, size=(n, 2)).astype(np.int32)
    rep = _rep(n)

    def f(ctx, x, i):
        tree = {"x": x, "i": [i]}
        src = n - 1
        return (ctx.all_sum(tree), ctx.all_min(tree), ctx.all_max(tree),
                ctx.all_gather(tree), ctx.broadcast(tree, src))

    stacked = jr.PerReplica(rep.replicate(data) if n == 1 else
                            jax.device_put(data, jax.sharding.NamedSharding(
                                rep.mesh, jax.sharding.PartitionSpec("replica"))), rep.mesh)
    stacked_i = jr.PerReplica(jax.device_put(ints, jax.sharding.NamedSharding(
        rep.mesh, jax.sharding.PartitionSpec("replica"))), rep.mesh)
    s, mn, mx, g, b = rep.run(f, None, stacked, stacked_i)
    np.testing.assert_allclose(s["x"], data.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(s["i"][0], ints.sum(0))
    np.testing.assert_array_equal(mn["x"], data.min(0))
    np.testing.assert_array_equal(mx["i"][0], ints.max(0))
    np.testing.assert_array_equal(g["x"], data)
    np.testing.assert_array_equal(g["i"][0], ints)
    np.testing.assert_array_equal(b["x"], data[n - 1])
    np.testing.assert_array_equal(b["i"][0], ints[n - 1])


def test_a_per_replica_whose_leading_axis_was_mapped_away_says_so():
    # flax.jax_utils.unreplicate maps x[0] over the tree, through PerReplica's pytree node.
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    ids = rep.run(lambda ctx: ctx.replica_id * 10)
    mapped = jax.tree.map(lambda a: a[0], ids)
    assert "PerReplica(array=" in repr(mapped)
    with pytest.raises(TypeError, match=r"unreplicate.*x\[i\] is replica i's value"):
        len(mapped)
    assert [int(v) for v in ids] == [0, 10]
