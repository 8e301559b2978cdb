"""Flax NNX arguments: the fast pytree split, and nnx.split where Variables are shared."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jreplicate as jr
from jreplicate.execution import nnx_args


def _train(rep, model, steps=3):
    from flax import nnx
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.arange(rep.num_replicas * 4 * 3, dtype=jnp.float32).reshape(
        rep.num_replicas, 4, 3) / 50

    def step(ctx, xb, model, opt):
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            jnp.sum(m(xb) ** 2, -1), 4 * rep.num_replicas))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    return [float(rep.run(step, None, jr.PerReplica(x), model, opt)) for _ in range(steps)]


def test_fast_split_only_without_shared_variables():
    from flax import nnx
    lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    assert nnx_args.split_fast((lin,)) is not None
    tied = nnx.Sequential(lin, lin)  # one Linear twice: shared Variables
    assert nnx_args.split_fast((tied,)) is None


def test_shared_and_unshared_modules_train_like_one_device():
    from flax import nnx
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
    results = []
    for make in (lambda: nnx.Linear(3, 3, rngs=nnx.Rngs(0)),
                 lambda: (lambda lin: nnx.Sequential(lin, lin))(
                     nnx.Linear(3, 3, rngs=nnx.Rngs(0)))):
        with rep.scope():
            model = make()
        one = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:1]))
        with one.scope():
            ref = make()
        got = _train(rep, model)
        # One device, the global batch as one replica's: the same losses.
        opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
        x = jnp.arange(4 * 4 * 3, dtype=jnp.float32).reshape(16, 3) / 50
        want = []
        for _ in range(3):
            loss, g = nnx.value_and_grad(lambda m, x=x: jnp.mean(jnp.sum(m(x) ** 2, -1)))(ref)
            opt.update(ref, g)
            want.append(float(loss))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        results.append(got)
    assert results[0] != results[1]


def test_a_plain_step_never_imports_flax():
    import subprocess
    import sys
    code = (
        "import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
        "import sys, numpy as np, jreplicate as jr\n"
        "rep = jr.Replicator(jr.MirroredStrategy())\n"
        "it = rep.prepare_input(lambda ctx: iter([np.ones(2)] * 3))\n"
        "rep.run(lambda ctx, b, w: (w + ctx.all_sum(b.sum()),), it, np.float32(0))\n"
        "print('flax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
