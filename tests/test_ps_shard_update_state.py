"""The shard's state-first jitted update and typed PRNG keys
under the parameter server.

* An NNX model holding an ``nnx.Rngs`` (a Dropout's typed key) passed to a PS step: the
  coordinator ships the model's state as NumPy, and NumPy cannot hold a key (run raised
  TypeError on both carriers).
* The shard's update against optax computed independently, for transformations whose
  state holds several leaves shaped like the parameters (chain of two stateful
  transforms, masked, MultiSteps), in float32 and bfloat16: no state leaf swapped, and
  no recompilation after the compile at construction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.shard import PSShard
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_nnx_state import _folded

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
from tests.test_ps_ray import local_ray  # noqa: E402, F401 (the module's Ray instance)
from tests.test_ps_typed_keys import carrier  # noqa: E402, F401 (embedded, ray)


def _dropout_model():
    """A Linear then a Dropout holding its own nnx.Rngs stream (a typed key)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    return Model


def test_an_nnx_model_with_rngs_runs_with_its_keys(carrier):
    from flax import nnx

    Model = _dropout_model()
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier=carrier)
    rep = jr.Replicator(s)
    with rep.scope():
        model = Model(nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)

    def loss_fn(m):
        return jnp.mean(m(x) ** 2)

    def step(ctx, model, optimizer):
        loss, g = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, g)
        return loss, model.drop.rngs.key.get_value()

    ref = _folded(model, 0)  # step 0's own streams (tests/test_ps_nnx_state.py)
    want_loss = loss_fn(ref)
    want_key = ref.drop.rngs.key.get_value()
    loss, key = rep.run(step, None, model, opt).fetch()
    rep.join()
    s.shutdown()
    np.testing.assert_allclose(loss, np.asarray(want_loss), rtol=1e-6)
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want_key))


def _params(dtype):
    rng = np.random.default_rng(0)
    return {"a": rng.normal(size=(8, 4)).astype(dtype),
            "b": rng.normal(size=(4,)).astype(dtype),
            "c": rng.normal(size=(8, 4)).astype(dtype)}


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tx", [
    lambda: optax.chain(optax.trace(0.9), optax.scale_by_adam(), optax.scale(-1e-2)),
    lambda: optax.masked(optax.adam(1e-2), {"a": True, "b": False, "c": True}),
    lambda: optax.MultiSteps(optax.adam(1e-2), 3),
    lambda: optax.partition({"x": optax.adam(1e-2), "y": optax.sgd(0.1, momentum=0.5)},
                            {"a": "x", "b": "y", "c": "y"}),
], ids=["trace+adam", "masked", "multisteps", "partition"])
def test_the_state_first_update_keeps_every_state_leaf_in_place(tx, dtype):
    tx = tx()
    params = _params(dtype)
    shard = PSShard(0, params, tx)
    assert not shard.may_raise
    ref_p, ref_o = params, tx.init(params)
    update = jax.jit(lambda g, o, p: tx.update(g, o, p))
    rng = np.random.default_rng(1)
    for i in range(5):
        g = {k: rng.normal(size=v.shape).astype(dtype) for k, v in params.items()}
        shard.push(i, 0, i, g)
        u, ref_o = update(g, ref_o, ref_p)
        ref_p = jax.jit(optax.apply_updates)(ref_p, u)
    assert shard.update.jitted._cache_size() == 1  # (compiled at construction only)
    got = shard.state()
    want = jax.tree.leaves(ref_o)
    assert len(jax.tree.leaves(got["opt_state"])) == len(want)
    for a, b in zip(jax.tree.leaves(got["opt_state"]), want):  # (same ops: exact)
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    for k in params:  # (update and apply fused in one program here: within an ulp)
        np.testing.assert_allclose(np.asarray(got["params"][k], np.float32),
                                   np.asarray(ref_p[k], np.float32), rtol=1e-6, atol=1e-6)
