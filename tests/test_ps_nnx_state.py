"""Flax NNX state under the parameter server other than the parameters
(jreplicate/ps/nnx_state.py): each step draws from its own random streams (the model's
keys folded with the step's id: every step drew the same dropout mask), and a step that
changes state the PS does not carry (BatchNorm statistics) fails naming it, instead of
training silently without it. Both carriers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
from tests.test_ps_ray import local_ray  # noqa: E402, F401 (the module's Ray instance)
from tests.test_ps_typed_keys import carrier  # noqa: E402, F401 (embedded, ray)


def _folded(model, step_id):
    """A copy of ``model`` with step ``step_id``'s streams: every key folded with it
    (computed here independently of the library)."""
    clone = nnx.clone(model)
    keys = nnx.state(clone, nnx.RngKey)
    nnx.update(clone, jax.tree.map(lambda k: jax.random.fold_in(k, step_id), keys))
    return clone


class Dropped(nnx.Module):
    def __init__(self, rngs, *, batch_norm=False):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs) if batch_norm else None
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        return self.drop(self.bn(y) if self.bn is not None else y)


def _job(carrier, **kw):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier=carrier)
    rep = jr.Replicator(s)
    with rep.scope():
        model = Dropped(nnx.Rngs(0, dropout=1), **kw)
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)
    return s, rep, model, opt


def _step(ctx, model, optimizer):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean(m(jnp.ones((8, 4))) ** 2))(model)
    optimizer.update(model, g)
    return model.drop(jnp.ones((8, 4))) != 0  # this step's next dropout mask


def test_every_step_draws_its_own_dropout_masks(carrier):
    s, rep, model, opt = _job(carrier)
    n = 6
    values = [rep.run(_step, None, model, opt) for _ in range(n)]
    rep.join()
    masks = [v.fetch() for v in values]
    s.shutdown()
    for i, mask in enumerate(masks):  # step i: the model's streams folded with i
        ref = _folded(model, values[i].step_id)
        ref(jnp.ones((8, 4)))  # (the loss's draw)
        np.testing.assert_array_equal(mask, np.asarray(ref.drop(jnp.ones((8, 4))) != 0))
    assert len({m.tobytes() for m in masks}) == n  # (every step drew the same before)


def test_a_step_changing_batch_norm_statistics_fails_naming_them(carrier):
    s, rep, model, opt = _job(carrier, batch_norm=True)
    value = rep.run(_step, None, model, opt)
    with pytest.raises(ValueError, match=r"changed the BatchStat at 'bn/mean'.*"
                                         r"use_running_average=True"):
        value.fetch()
    with pytest.raises(ValueError, match="BatchStat"):
        rep.join()
    s.shutdown()


def test_batch_norm_with_fixed_statistics_trains(carrier):
    s, rep, model, opt = _job(carrier, batch_norm=True)
    model.bn.use_running_average = True
    before = np.asarray(model.lin.kernel[...])
    for _ in range(3):
        rep.run(_step, None, model, opt)
    rep.join()
    params = s.parameters()
    s.shutdown()
    got = [np.asarray(a) for a in jax.tree.leaves(params)]
    assert any(x.shape == before.shape and not np.array_equal(x, before) for x in got)
