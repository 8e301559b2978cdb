"""Typed PRNG keys (``jax.random.key``) returned by a step under the parameter server:
``RemoteValue.fetch`` gives them back as key arrays of the same implementation and
data (NumPy cannot hold a key; fetching one raised TypeError on both carriers), from a
sync group of two as a ``[group, ...]`` key array, and held on Ray past the object
store window as from the latest step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.ray.actors import HELD_IN_STORE
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
from tests.test_ps_ray import local_ray  # noqa: E402, F401 (the module's Ray instance)


def _job(carrier, g=1):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=g,
                                   carrier=carrier)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"w": jnp.zeros(3)}
        tx = jr.ps.pushable(optax.sgd(0.5))
        opt = tx.init(params)
    return s, rep, params, tx, opt


def _data(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


def _assert_key(got, want) -> None:
    assert isinstance(got, jax.Array)
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(got) == jax.random.key_impl(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(_data(got), _data(want))


@pytest.fixture(params=["embedded", "ray"])
def carrier(request):
    if request.param == "ray":
        request.getfixturevalue("local_ray")
    return request.param


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_key_and_an_array_of_keys_fetch_as_keys(carrier, impl):
    s, rep, params, tx, opt = _job(carrier)

    def step(ctx, p, o, key):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        key, sub = jax.random.split(key)
        return optax.apply_updates(p, u), o, key, jax.random.split(sub, 4), jnp.sum(p["w"])

    key = jax.random.key(7, impl=impl)
    values = [rep.run(step, None, params, opt, key) for _ in range(HELD_IN_STORE + 2)]
    rep.join()
    want_key, sub = jax.random.split(key)
    for v in (values[0], values[-1]):  # (on Ray: copied out of the store, and not)
        _, _, k, ks, _ = v.fetch()
        _assert_key(k, want_key)
        _assert_key(ks, jax.random.split(sub, 4))
        # The fetched key works as the next step's argument.
        assert rep.run(step, None, params, opt, k).fetch()[2].shape == ()
    rep.join()
    s.shutdown()


def test_per_replica_keys_of_a_sync_group_fetch_stacked(carrier):
    s, rep, params, tx, opt = _job(carrier, g=2)

    def step(ctx, p, o, key):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o, jax.random.fold_in(key, ctx.replica_id)

    key = jax.random.key(3)
    got = rep.run(step, None, params, opt, key).fetch()[2]
    rep.join()
    _assert_key(got, jnp.stack([jax.random.fold_in(key, i) for i in range(2)]))
    s.shutdown()
