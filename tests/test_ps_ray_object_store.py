"""Ray carrier: outputs a caller keeps do not fill Ray's object store.

A one-device worker places the pulled parameters without a copy (they alias the reply
in Ray's object store) and a step's returned parameters are those arrays. A caller that
keeps every RemoteValue would pin one object per step; the worker copies the outputs of
all but its latest few held steps into its own memory, so later transfers never spill
(before: 60 steps of a 4.4 MB model with an 80 MB store took 106 s instead of 1.6 s).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.ray.actors import HELD_IN_STORE
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import private_ray

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")

STORE = 80 * 2**20  # bytes of object store (Ray's minimum is 75 MiB)
SHAPE = (1024, 1024)  # 4 MiB of float32 per step's parameters
LR = 0.5


@pytest.fixture(scope="module")
def small_store_ray():
    yield from private_ray(object_store_memory=STORE)


def test_kept_remote_values_do_not_fill_the_object_store(small_store_ray):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"w": jnp.zeros(SHAPE)}
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(params)

    def step(ctx, p, o):  # gradient 1 everywhere: after k updates, w = -LR * k
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o

    n = 40  # 160 MiB of parameters returned, held on the worker: twice the store
    assert n > 4 * HELD_IN_STORE
    t0 = time.monotonic()
    values = [rep.run(step, None, params, opt) for _ in range(n)]
    rep.join()
    took = time.monotonic() - t0
    # Each step returns the parameters it pulled: those after the steps before it (one
    # worker, one step at a time on it; pipelined steps start from the last push's).
    for k, v in enumerate(values):
        got = v.fetch()[0]["w"]
        assert got.shape == SHAPE and got.dtype == np.float32
        np.testing.assert_array_equal(got, np.float32(-LR) * k if k else 0.0)
    np.testing.assert_array_equal(s.parameters()["w"], np.float32(-LR) * n)
    # Spilling every transfer to disk took ~1.8 s a step here; in memory ~0.04 s.
    assert took < 40.0, f"{n} steps took {took:.1f} s: the object store filled up"
    s.shutdown()


def test_arrays_in_pieces_come_back_as_views_placed_without_a_copy(small_store_ray):
    """An array over 1 MiB sent in pieces (jreplicate.ps.ray.pieces, as the carrier
    sends gradients and parameters) comes out of the object store as a read-only,
    64-byte aligned view of the object (no copy on either side of Ray), which a
    one-device worker places without a copy (jreplicate._jax_compat.alias_host_arrays)."""
    import ray

    from jreplicate._jax_compat import alias_host_arrays
    from jreplicate.ps.ray import pieces

    sent = {"w": np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE),
            "b": np.ones(7, np.float32)}
    back = ray.get(ray.put(pieces.in_pieces(sent)), timeout=60)
    w = back["w"]
    np.testing.assert_array_equal(w, sent["w"])
    np.testing.assert_array_equal(back["b"], sent["b"])
    assert not w.flags.writeable and w.ctypes.data % 64 == 0
    base = w
    while isinstance(base.base, np.ndarray):
        base = base.base
    assert getattr(base.base, "_parts", None) is not None  # the joined view, not a copy
    dev = jax.devices()[0]
    placed = alias_host_arrays([w], jax.sharding.SingleDeviceSharding(dev), dev)[0]
    assert placed.unsafe_buffer_pointer() == w.ctypes.data
