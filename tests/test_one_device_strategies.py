"""Every strategy one device can host, on the machine's first device: training (plain
pytrees and Flax NNX) equal to a one-device reference computed without jreplicate,
device loops equal to separate calls, donation reusing the state's buffers, a
checkpoint restored bit for bit, and the parameter server's embedded carrier with its
shard and worker on that same device.

In CI this runs on CPU device 0 of the 8 simulated ones; bench/device_check.py runs it on
one GPU (``JREPLICATE_TEST_DEVICES=native``, see tests/conftest.py), where the float32
references hold because conftest asks for full-precision matrix products there.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jreplicate as jr
from tests._models import NnxMLP, init_mlp, make_data, mlp, per_example_loss

STEPS, BATCH, K = 6, 8, 3
TX = optax.adam(1e-2)
DEV = jax.devices()[:1]

SPMD = {
    "mirrored": lambda: jr.MirroredStrategy(devices=DEV),
    "tpu-layout": lambda: jr.TPUStrategy(devices=DEV),  # TPUStrategy's mesh and loops
    "tpu-loops": lambda: jr.TPUStrategy(devices=DEV, steps_per_run=K),
}


@pytest.fixture(params=sorted(SPMD))
def spmd(request):
    return SPMD[request.param]()


def _reference(xs, ys):
    """Adam on one device, without jreplicate: the parameters after each step."""
    p = init_mlp(jax.random.key(0))
    o, out = TX.init(p), []
    for x, y in zip(xs, ys):
        g = jax.grad(lambda q, x=x, y=y: per_example_loss(mlp(q, x), y).mean())(p)
        u, o = TX.update(g, o, p)
        p = optax.apply_updates(p, u)
        out.append(p)
    return out


def _step(ctx, batch, p, o):
    x, y = batch
    loss, g = jax.value_and_grad(
        lambda p: jr.compute_average_loss(per_example_loss(mlp(p, x), y), BATCH))(p)
    u, o = TX.update(g, o, p)
    return optax.apply_updates(p, u), o, ctx.all_sum(loss)


def _inputs(rep, xs, ys):
    return rep.prepare_input(lambda ctx: iter(list(zip(xs, ys))))


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_training_equals_one_device_and_loops_equal_separate_calls(spmd):
    xs, ys = make_data(STEPS, BATCH)
    want = _reference(xs, ys)
    rep = jr.Replicator(spmd)
    assert rep.num_replicas == 1 and set(rep.mesh.devices.flat) == set(DEV)
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        o = TX.init(p)
    inputs = _inputs(rep, xs, ys)
    k = getattr(spmd, "steps_per_run", None) or 1
    for i in range(0, STEPS, k):
        p, o, loss = rep.run(_step, inputs, p, o)
        assert np.shape(loss) == ((k,) if k > 1 else ())
        _close(p, want[i + k - 1])
    # A loop of K steps asked for by run(..., steps=K) equals the steps one by one.
    with rep.scope():
        q = init_mlp(jax.random.key(0))
        r = TX.init(q)
    q, r, losses = rep.run(_step, _inputs(rep, xs, ys), q, r, steps=STEPS)
    assert np.shape(losses) == (STEPS,)
    _close(q, want[-1])


def test_donated_state_is_updated_in_place(spmd):
    xs, ys = make_data(2, BATCH)
    rep = jr.Replicator(spmd)
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        o = TX.init(p)
    kept_p, kept_o, _ = rep.run(_step, _inputs(rep, xs[:1], ys[:1]), p, o)  # p, o kept
    assert not any(a.is_deleted() for a in jax.tree.leaves((p, o)))
    before = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(p)]
    new_p, new_o, _ = rep.run(_step, _inputs(rep, xs[:1], ys[:1]), p, o,
                              donate_argnums=(0, 1))
    assert all(a.is_deleted() for a in jax.tree.leaves((p, o)))  # handed to XLA
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(new_p)] == before
    _close((new_p, new_o), (kept_p, kept_o), rtol=0, atol=0)  # the same step, bit for bit


def test_nnx_model_and_optimizer_train_as_on_one_device(spmd):
    xs, ys = make_data(STEPS, BATCH)
    ref = NnxMLP(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    for x, y in zip(xs, ys):
        g = nnx.grad(lambda m, x=x, y=y: per_example_loss(m(x), y).mean())(ref)
        ref_opt.update(ref, g)

    rep = jr.Replicator(spmd)
    with rep.scope():
        model = NnxMLP(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    def step(ctx, batch, model, opt):
        x, y = batch
        loss, g = nnx.value_and_grad(
            lambda m: jr.compute_average_loss(per_example_loss(m(x), y), BATCH))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    inputs = _inputs(rep, xs, ys)
    k = getattr(spmd, "steps_per_run", None) or 1
    for _ in range(STEPS // k):
        rep.run(step, inputs, model, opt)  # the module and optimizer written back
    _close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    assert int(opt.step[...]) == STEPS


def test_checkpoint_restores_the_state_bit_for_bit(spmd, tmp_path):
    xs, ys = make_data(2, BATCH)
    rep = jr.Replicator(spmd)
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        o = TX.init(p)
    p, o, _ = rep.run(_step, _inputs(rep, xs[:1], ys[:1]), p, o)
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        assert mngr.save(1, {"params": p, "opt": o})
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        at, state = mngr.restore_or_initialize(lambda: {"params": p, "opt": o})
    assert at == 1
    _close(state, {"params": p, "opt": o}, rtol=0, atol=0)
    assert all(set(a.sharding.device_set) == set(DEV) for a in jax.tree.leaves(state))
    # Training goes on from the restored state as from the saved one.
    got = rep.run(_step, _inputs(rep, xs[1:], ys[1:]), state["params"], state["opt"])
    want = rep.run(_step, _inputs(rep, xs[1:], ys[1:]), p, o)
    _close(got, want, rtol=0, atol=0)


def test_multi_worker_strategy_in_one_process():
    s = jr.MultiWorkerStrategy()  # no cluster: one process, every local device
    rep = jr.Replicator(s)
    n = rep.num_replicas
    assert (s.num_workers, s.worker_index, s.is_chief) == (1, 0, True)
    xs, ys = make_data(2, BATCH * n)
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        o = TX.init(p)
    step = _step_for(BATCH * n)
    inputs = rep.prepare_input(lambda ctx: iter(
        [(x.reshape(n, BATCH, -1)[ctx.input_pipeline_id], y.reshape(n, BATCH)[
            ctx.input_pipeline_id]) for x, y in zip(xs, ys)]),
        jr.InputReplicationMode.PER_REPLICA)
    for _ in range(2):
        p, o, _ = rep.run(step, inputs, p, o)
    _close(p, _reference(xs, ys)[-1], rtol=2e-5, atol=2e-6)


def _step_for(global_batch):
    def step(ctx, batch, p, o):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jr.compute_average_loss(
            per_example_loss(mlp(p, x), y), global_batch))(p)
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss)
    return step


def test_parameter_server_shard_and_worker_on_one_device(tmp_path):
    """The embedded carrier on one device: the shard's update and the worker's step share
    it; one worker is sequential, so training equals one device; the shards' state,
    saved and restored, carries on identically."""
    with pytest.warns(UserWarning, match=r"shard\(s\) \[0\] share devices with workers"):
        s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, devices=DEV)
    assert s.shard_devices == tuple(DEV) and s.worker_devices == (tuple(DEV),)
    rep = jr.Replicator(s)
    xs, ys = make_data(STEPS, BATCH)
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        tx = jr.ps.pushable(TX)
        o = tx.init(p)

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            per_example_loss(mlp(p, x), y), BATCH))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    inputs = _inputs(rep, xs, ys)
    for _ in range(STEPS - 1):
        rep.run(step, inputs, p, o)
    rep.join()
    want = _reference(xs, ys)
    _close(s.parameters(), want[STEPS - 2])
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        mngr.save(STEPS - 1, s.state())
    with pytest.warns(UserWarning, match="share devices"):
        s2 = jr.ParameterServerStrategy(num_ps=1, num_workers=1, devices=DEV)
    rep2 = jr.Replicator(s2)
    with rep2.scope():
        p2 = init_mlp(jax.random.key(7))  # replaced by the restored state
        tx2 = jr.ps.pushable(TX)
        o2 = tx2.init(p2)
    with jr.CheckpointManager(tmp_path, rep2) as mngr:
        at, state = mngr.restore_or_initialize(s2.state)
    assert at == STEPS - 1
    s2.restore(state)

    def step2(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            per_example_loss(mlp(p, x), y), BATCH))(p)
        u, o = tx2.update(g, o, p)
        return optax.apply_updates(p, u), o

    rep2.run(step2, rep2.prepare_input(lambda ctx: iter([(xs[-1], ys[-1])])), p2, o2)
    rep2.join()
    _close(s2.parameters(), want[-1])
    assert s2.ledger()[0]["applied"] == STEPS
    s.shutdown()
    s2.shutdown()
