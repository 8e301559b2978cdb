"""Replicas spanning several logical devices: tensor parallelism over the "model" axis,
the Replicator design's logical-device API, and model-sharded results and checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr

R, M = 4, 2
GB = 32


def _sharded_as(x, rep, spec):
    return x.sharding.is_equivalent_to(NamedSharding(rep.mesh, spec), x.ndim)


def _devices_at(rep, logical):
    return {d for d in rep.mesh.devices[:, logical]}


def _data(steps=6, d_in=8, d_out=4):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, GB, d_in)).astype(np.float32)
    ys = rng.normal(size=(steps, GB, d_out)).astype(np.float32)
    return xs, ys


def _input_fn(xs, ys):
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        return [(xs[s, r * b:(r + 1) * b], ys[s, r * b:(r + 1) * b])
                for s in range(len(xs)) for r in range(ctx.num_replicas)]
    return input_fn


def _mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _init(key, d_in=8, h=16, d_out=4):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d_in, h)) * 0.3, "b1": jnp.zeros(h),
            "w2": jax.random.normal(k2, (h, d_out)) * 0.3, "b2": jnp.zeros(d_out)}


def _reference(params, xs, ys, tx, steps):
    p, o = jax.tree.map(np.asarray, params), tx.init(params)
    for s in range(steps):
        g = jax.grad(lambda p, s=s: jnp.mean(jnp.sum((_mlp(p, xs[s]) - ys[s]) ** 2, -1)))(p)
        u, o = tx.update(g, o, p)
        p = optax.apply_updates(p, u)
    return p


def _train(rep, params, opt, tx, xs, ys, steps):
    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            jnp.sum((_mlp(p, x) - y) ** 2, -1), GB))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    inputs = rep.prepare_input(_input_fn(xs, ys), jr.InputReplicationMode.SINGLE,
                               enforce_ordering=True)
    for _ in range(steps):
        params, opt = rep.run(step, inputs, params, opt)
    return params, opt


def test_mesh_is_replicas_by_logical_devices():
    s = jr.MirroredStrategy(logical_devices_per_replica=M)
    rep = jr.Replicator(s)
    assert rep.mesh.axis_names == (jr.REPLICA_AXIS, jr.MODEL_AXIS) == ("replica", "model")
    assert dict(rep.mesh.shape) == {"replica": R, "model": M}
    assert s.num_replicas == R and s.logical_devices_per_replica == M
    assert s.layout.replica_devices[1] == tuple(jax.local_devices()[2:4])
    assert s.devices == tuple(jax.local_devices()[0::2])  # logical device 0 of each
    # One device per replica is the same 2-D mesh with a model axis of size 1.
    assert dict(jr.MirroredStrategy().mesh.shape) == {"replica": 8, "model": 1}


def test_tensor_parallel_mlp_trains_to_one_device_parameters_and_keeps_its_shardings():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    tx = optax.adam(0.05)
    xs, ys = _data()
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    with rep.scope():
        params = {k: jax.device_put(v, NamedSharding(rep.mesh, specs[k]))
                  for k, v in _init(jax.random.key(0)).items()}
        opt = tx.init(params)
    params, opt = _train(rep, params, opt, tx, xs, ys, len(xs))
    ref = _reference(_init(jax.random.key(0)), xs, ys, tx, len(xs))
    for k in specs:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)
        # Each variable stays split over the model axis where it was created ...
        assert _sharded_as(params[k], rep, specs[k]), k
        assert _sharded_as(opt[0].mu[k], rep, specs[k]), k
    # ... one half of w1's columns per logical device, on every replica.
    shard_shapes = {s.data.shape for s in params["w1"].addressable_shards}
    assert shard_shapes == {(8, 8)}


def test_gradients_of_model_sharded_state_come_back_with_its_sharding():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    w = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(4, 8),
                       NamedSharding(rep.mesh, P(None, "model")))

    def step(ctx, w):
        x = jnp.ones(4) * (ctx.replica_id + 1)
        return jax.grad(lambda w: jnp.sum(x @ w))(w)

    g = rep.run(step, None, w)
    assert _sharded_as(g, rep, P(None, "model"))
    np.testing.assert_allclose(np.asarray(g), np.full((4, 8), 1 + 2 + 3 + 4))


def test_nnx_tensor_parallel_model_matches_one_device():
    from flax import nnx

    def make(rngs, sharded):
        part = (lambda init, names: nnx.with_partitioning(init, names)) if sharded \
            else (lambda init, names: init)
        init = nnx.initializers.lecun_normal()
        return nnx.Sequential(
            nnx.Linear(8, 16, kernel_init=part(init, (None, "model")), rngs=rngs),
            jnp.tanh,
            nnx.Linear(16, 4, kernel_init=part(init, ("model", None)), rngs=rngs))

    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    xs, ys = _data(steps=4)
    with rep.scope():
        model = make(nnx.Rngs(0), sharded=True)
        opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    ref_model = make(nnx.Rngs(0), sharded=False)
    ref_opt = nnx.Optimizer(ref_model, optax.adam(0.05), wrt=nnx.Param)

    def step(ctx, batch, model, opt):
        x, y = batch
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            jnp.sum((m(x) - y) ** 2, -1), GB))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    inputs = rep.prepare_input(_input_fn(xs, ys), jr.InputReplicationMode.SINGLE,
                               enforce_ordering=True)
    for s in range(len(xs)):
        rep.run(step, inputs, model, opt)
        g = nnx.grad(lambda m, s=s: jnp.mean(jnp.sum((m(xs[s]) - ys[s]) ** 2, -1)))(ref_model)
        ref_opt.update(ref_model, g)
    assert _sharded_as(model.layers[0].kernel[...], rep, P(None, "model"))
    assert _sharded_as(model.layers[2].kernel[...], rep, P("model", None))
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_rfc_three_part_example_with_part3_on_logical_device_1():
    """The design's example: inputs on logical device 0, part 3 and its variable on 1."""
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    w1 = np.arange(12.0, dtype=np.float32).reshape(3, 4) / 10
    w2 = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    v_host = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    with rep.scope():
        w1_, w2_ = jnp.asarray(w1), jnp.asarray(w2)
        with rep.logical_device_for_variables(1):
            v = jnp.asarray(v_host)
    assert v.sharding.device_set == _devices_at(rep, 1)
    assert w1_.sharding.device_set == set(rep.mesh.devices.flat)

    def model_part1(x, w):
        return jnp.tanh(x @ w)

    def step(ctx, inputs, w1, w2, v):
        a = model_part1(inputs, w1)
        with ctx.logical_device(0):
            b = a @ w2
        with ctx.logical_device(1):
            return jnp.sum(b * v, axis=-1)

    x = np.random.default_rng(1).normal(size=(R, 2, 3)).astype(np.float32)
    inputs = rep.prepare_input(lambda ctx: iter([x[ctx.input_pipeline_id]]),
                               jr.InputReplicationMode.PER_REPLICA)
    out = rep.run(step, inputs, w1_, w2_, v)
    for r in range(R):
        want = np.sum((np.tanh(x[r] @ w1) @ w2) * v_host, axis=-1)
        np.testing.assert_allclose(np.asarray(out[r]), want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"logical_device\(2\) is out of range.*ids 0\.\.1"):
        rep.run(lambda ctx: ctx.logical_device(2))


def test_two_stage_mlp_on_two_logical_devices_trains_to_one_device_parameters():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    tx = optax.adam(0.05)
    xs, ys = _data()
    init = _init(jax.random.key(3))
    with rep.scope():
        with rep.logical_device_for_variables(0):
            stage1 = {"w1": jnp.array(np.asarray(init["w1"])), "b1": jnp.zeros(16)}
        with rep.logical_device_for_variables(1):
            stage2 = {"w2": jnp.array(np.asarray(init["w2"])), "b2": jnp.zeros(4)}
        params = {**stage1, **stage2}
        opt = tx.init(params)
    params, opt = _train(rep, params, opt, tx, xs, ys, len(xs))
    ref = _reference(init, xs, ys, tx, len(xs))
    for k, logical in [("w1", 0), ("b1", 0), ("w2", 1), ("b2", 1)]:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=1e-5, atol=1e-6)
        # Where each stage lives, after training as before: its logical device of
        # every replica, and the optimizer's moments beside it.
        assert params[k].sharding.device_set == _devices_at(rep, logical), k
        assert opt[0].mu[k].sharding.device_set == _devices_at(rep, logical), k
    # Replica 2's copy of a stage-2 variable is on replica 2's logical device 1.
    local = rep.local_results(params)[2]
    assert local["w2"].devices() == {rep.mesh.devices[2, 1]}
    assert local["w1"].devices() == {rep.mesh.devices[2, 0]}


def test_nnx_module_on_a_logical_device_stays_there():
    from flax import nnx
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    with rep.scope(), rep.logical_device_for_variables(1):
        layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    before = np.asarray(layer.kernel[...])

    def step(ctx, layer):
        layer.kernel[...] = layer.kernel[...] * 2
        return jnp.sum(layer(jnp.ones((1, 3))))

    rep.run(step, None, layer)
    np.testing.assert_allclose(np.asarray(layer.kernel[...]), before * 2)
    assert layer.kernel[...].sharding.device_set == _devices_at(rep, 1)


def test_per_replica_reduce_and_local_results_with_model_sharded_state():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))
    w = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(2, 8),
                       NamedSharding(rep.mesh, P(None, "model")))
    out = rep.run(lambda ctx, w: (w * (ctx.replica_id + 1), w + 1), None, w)
    per, same = out
    assert isinstance(per, jr.PerReplica) and len(per) == R
    for r in range(R):
        np.testing.assert_allclose(np.asarray(per[r]), np.asarray(w) * (r + 1))
    np.testing.assert_allclose(np.asarray(rep.reduce("sum", per)), np.asarray(w) * 10)
    local = rep.local_results(same)
    assert len(local) == R
    for r, x in enumerate(local):
        assert x.sharding.device_set == set(rep.mesh.devices[r])  # replica r's 2 devices
        assert x.sharding.spec in (P(None, "model"), P(None, ("model",)))
        np.testing.assert_allclose(np.asarray(x), np.asarray(w) + 1)


def test_checkpoint_restores_model_sharded_and_logical_device_state(tmp_path):
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=M))

    def init_fn():
        with rep.scope():
            w = jax.device_put(np.zeros((4, 8), np.float32),
                               NamedSharding(rep.mesh, P(None, "model")))
            with rep.logical_device_for_variables(1):
                v = jnp.zeros(3)
            return {"w": w, "v": v, "c": jnp.zeros(())}

    with jr.CheckpointManager(tmp_path, rep) as mngr:
        step, state = mngr.restore_or_initialize(init_fn)
        assert step == 0 and _sharded_as(state["w"], rep, P(None, "model"))
        state = {"w": state["w"] + jnp.arange(8.0), "v": state["v"] + 2, "c": state["c"] + 1}
        mngr.save(5, state)
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        step, got = mngr.restore_or_initialize(init_fn)
    assert step == 5
    assert _sharded_as(got["w"], rep, P(None, "model"))
    assert got["v"].sharding.device_set == _devices_at(rep, 1)
    assert got["c"].sharding.is_fully_replicated
    for k in state:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(state[k]))


def test_layout_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"8 devices do not factor.*1, 2, 4, 8"):
        jr.MirroredStrategy(logical_devices_per_replica=3)
    with pytest.raises(ValueError, match=r"logical_devices_per_replica=0.*int >= 1"):
        jr.MirroredStrategy(logical_devices_per_replica=0)
    rep = jr.Replicator(jr.MirroredStrategy())
    with pytest.raises(ValueError, match=r"logical_device_for_variables\(1\).*one logical "
                                         r"device.*logical_devices_per_replica=M"):
        rep.logical_device_for_variables(1)
    with pytest.raises(ValueError, match=r"not found in mesh.*jr.MODEL_AXIS"):
        with rep.scope():
            from flax import nnx
            nnx.Linear(2, 4, kernel_init=nnx.with_partitioning(
                nnx.initializers.lecun_normal(), (None, "modle")), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int8])
def test_collectives_of_narrow_dtypes(m, dtype):
    """jaxlib 0.12's CPU compiler aborted on these with a replica over 2 devices."""
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=m))
    n = rep.num_replicas

    def f(ctx):
        x = (jnp.ones(3) * ctx.replica_id).astype(dtype)
        return ctx.all_sum(x), ctx.all_max(x)

    out = rep.run(f)
    assert out[0].dtype == dtype
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.full(3, n * (n - 1) / 2))
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.full(3, n - 1))
