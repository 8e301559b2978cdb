"""N-replica training equals one-device training on the concatenated global batch."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jreplicate as jr
from tests._models import NnxMLP, init_mlp, make_data, mlp, per_example_loss

STEPS, GLOBAL_BATCH, N = 50, 64, 8


def _reference_pytree(x, y):
    params = init_mlp(jax.random.key(0))
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, xb, yb):
        loss, g = jax.value_and_grad(lambda p: per_example_loss(mlp(p, xb), yb).mean())(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    losses = []
    for s in range(STEPS):
        params, opt, loss = step(params, opt, x[s], y[s])
        losses.append(float(loss))
    return params, losses


def _input_fn(x, y):
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        i = ctx.input_pipeline_id
        return ((x[s, i * b:(i + 1) * b], y[s, i * b:(i + 1) * b]) for s in range(STEPS))
    return input_fn


def test_pytree_mlp_adam_matches_one_device():
    x, y = make_data(STEPS, GLOBAL_BATCH)
    ref_params, ref_losses = _reference_pytree(x, y)

    rep = jr.Replicator(jr.MirroredStrategy())
    with rep.scope():
        params = init_mlp(jax.random.key(0))
        tx = optax.adam(1e-2)
        opt = tx.init(params)

    def step(ctx, batch, params, opt):
        xb, yb = batch

        def loss_fn(p):
            return jr.compute_average_loss(per_example_loss(mlp(p, xb), yb), GLOBAL_BATCH)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, ctx.all_sum(loss)

    inputs = rep.prepare_input(_input_fn(x, y), jr.InputReplicationMode.PER_REPLICA)
    losses = []
    for _ in range(STEPS):
        params, opt, loss = rep.run(step, inputs, params, opt)
        assert not isinstance(params[0]["w"], jr.PerReplica)
        losses.append(float(loss))
    with pytest.raises(StopIteration):
        rep.run(step, inputs, params, opt)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_nnx_mlp_adam_matches_one_device():
    x, y = make_data(STEPS, GLOBAL_BATCH, seed=1)

    def train_step(model, optimizer, xb, yb, scale):
        def loss_fn(m):
            return per_example_loss(m(xb), yb).sum() / scale

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    ref_model = NnxMLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
    ref_step = nnx.jit(train_step, static_argnums=4)
    ref_losses = [float(ref_step(ref_model, ref_opt, x[s], y[s], GLOBAL_BATCH))
                  for s in range(STEPS)]

    rep = jr.Replicator(jr.MirroredStrategy())
    with rep.scope():
        model = NnxMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def step(ctx, batch, model, optimizer):
        return ctx.all_sum(train_step(model, optimizer, *batch, GLOBAL_BATCH))

    inputs = rep.prepare_input(_input_fn(x, y), jr.InputReplicationMode.PER_REPLICA)
    losses = [float(rep.run(step, inputs, model, optimizer)) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    got = jax.tree.leaves(nnx.state(model, nnx.Param))
    want = jax.tree.leaves(nnx.state(ref_model, nnx.Param))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(optimizer.step[...]) == STEPS
