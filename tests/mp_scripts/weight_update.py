"""Weight-update sharding across processes, used by tests/test_weight_update_processes.py.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 4``. For each
level (``--levels``), trains with MultiWorkerStrategy (a plain pytree with adam: three
single steps, then a device loop of two; a Flax NNX model with ``nnx.Optimizer``: five
steps), computes the one-device reference itself (same seeds, the full global batch, on
this process's first device), compares every shard it holds with the reference's rows,
and checks that the optimizer state is sharded across the processes. Prints one ``OK``
line per check; any mismatch raises (a non-zero exit).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402  (computing must wait for the strategy)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jreplicate as jr  # noqa: E402

GB, STEPS = 64, 5


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, GB, 16)).astype(np.float32)
    y = rng.normal(size=(STEPS, GB, 8)).astype(np.float32)
    return x, y


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 8)) / 6, "b2": jnp.full(5, 0.1, jnp.float32)}


def mlp(p, x):
    return (jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])[:, :5] + p["b2"]


def per_example(p, x, y):
    return jnp.sum((mlp(p, x) - y[:, :5]) ** 2, -1)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def input_fn_for(x, y):
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        per = ctx.num_replicas // ctx.num_input_pipelines
        replicas = range(ctx.input_pipeline_id * per, (ctx.input_pipeline_id + 1) * per)
        return ((x[s, r * b:(r + 1) * b], y[s, r * b:(r + 1) * b])
                for s in range(len(x)) for r in replicas)
    return input_fn


def compare(name, got, want, rtol=2e-5, atol=2e-6):
    """Every shard this process holds of ``got`` against the reference's rows."""
    n = 0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w)
        for s in g.addressable_shards:
            np.testing.assert_allclose(np.asarray(s.data), w[s.index], rtol=rtol, atol=atol,
                                       err_msg=name)
            n += 1
    print(f"OK {name}: {n} shards equal the one-device reference", flush=True)


def across_processes(name, x, axis):
    spec = x.sharding.spec
    assert any(p == axis or (isinstance(p, tuple) and axis in p) for p in spec), \
        f"{name}: {x.sharding}"
    assert not x.is_fully_addressable, f"{name} is held whole by one process"
    devices = {s.device for s in x.addressable_shards}
    assert devices == set(jax.local_devices()), devices


def plain(level, rep, x, y, dev):
    tx = optax.adam(1e-2)

    def step(ctx, batch, p, o):
        xb, yb = batch
        loss, g = jax.value_and_grad(lambda p: jr.compute_average_loss(
            per_example(p, xb, yb), GB))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss)

    with rep.scope():
        p = init_params()
        o = tx.init(p)
    inputs = rep.prepare_input(input_fn_for(x, y))
    for _ in range(3):
        p, o, _ = rep.run(step, inputs, p, o)
    p, o, _ = rep.run(step, inputs, p, o, steps=2)

    @jax.jit
    def ref_step(p, o, xb, yb):
        g = jax.grad(lambda p: jnp.mean(per_example(p, xb, yb)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    rp = jax.device_put(init_params(), dev)
    ro = tx.init(rp)
    for s in range(STEPS):
        rp, ro = ref_step(rp, ro, jax.device_put(x[s], dev), jax.device_put(y[s], dev))
    compare(f"{level} adam params", p, rp)
    compare(f"{level} adam state", o, ro)
    mu = o[0].mu
    across_processes(f"{level} adam mu w1", mu["w1"], rep.mesh.axis_names[0])
    across_processes(f"{level} adam nu w2", o[0].nu["w2"], rep.mesh.axis_names[0])
    assert mu["b2"].sharding.is_fully_replicated  # [5]: no dimension 8 divides
    if level == "parameters":
        across_processes(f"{level} adam w1", p["w1"], rep.mesh.axis_names[0])
    else:
        assert p["w1"].sharding.is_fully_replicated
    print(f"OK {level} adam layout", flush=True)


def with_nnx(level, rep, x, y, dev):
    tx = optax.adamw(1e-2, weight_decay=0.1)

    def step(ctx, batch, model, opt):
        xb, yb = batch
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            jnp.sum((m(xb) - yb) ** 2, -1), GB))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    with rep.scope():
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    inputs = rep.prepare_input(input_fn_for(x, y))
    for _ in range(STEPS):
        rep.run(step, inputs, model, opt)

    with jax.default_device(dev):
        ref_model = Net(nnx.Rngs(0))
        ref_opt = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)
        for s in range(STEPS):
            g = nnx.grad(lambda m, s=s: jnp.mean(jnp.sum((m(x[s]) - y[s]) ** 2, -1)))(
                ref_model)
            ref_opt.update(ref_model, g)
    compare(f"{level} nnx params", nnx.state(model), nnx.state(ref_model))
    compare(f"{level} nnx optimizer", nnx.state(opt.opt_state), nnx.state(ref_opt.opt_state))
    axis = rep.mesh.axis_names[0]
    mu = opt.opt_state[0].mu
    across_processes(f"{level} nnx mu l1", mu["l1"]["kernel"][...], axis)
    kernel = model.l1.kernel[...]
    if level == "parameters":
        across_processes(f"{level} nnx kernel", kernel, axis)
    else:
        assert kernel.sharding.is_fully_replicated
    print(f"OK {level} nnx layout", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="optimizer,parameters")
    args = ap.parse_args()
    x, y = data()
    strategies = {}
    for level in args.levels.split(","):
        strategies[level] = jr.MultiWorkerStrategy(weight_update_sharding=level,
                                                   min_weight_shard_size=0)
    dev = jax.local_devices()[0]
    for level, strategy in strategies.items():
        assert strategy.num_processes == 2 and strategy.num_replicas == 8
        rep = jr.Replicator(strategy)
        plain(level, rep, x, y, dev)
        with_nnx(level, rep, x, y, dev)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
