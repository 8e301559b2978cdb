"""compute_average_loss: the scaling that makes N replicas equal one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr


def test_values():
    x = np.array([1.0, 3.0, 5.0], np.float32)
    assert float(jr.compute_average_loss(x, 12)) == pytest.approx(9 / 12)
    w = np.array([1.0, 0.0, 2.0], np.float32)
    assert float(jr.compute_average_loss(x, 4, sample_weight=w)) == pytest.approx(11 / 4)
    assert float(jr.compute_average_loss(x[:, None] * np.ones((3, 2)), 6)) == pytest.approx(3.0)


def test_masked_mean_over_replicas_counts_real_examples():
    """Padded examples are masked, and the count of real ones is computed in the step."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    losses = np.array([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    sharding = jax.sharding.NamedSharding(rep.mesh, jax.sharding.PartitionSpec("replica"))
    per = [jr.PerReplica(jax.device_put(a, sharding), rep.mesh) for a in (losses, mask)]

    def step(ctx, loss, m):
        return ctx.all_sum(jr.compute_average_loss(loss, ctx.all_sum(m.sum()),
                                                   sample_weight=m))

    assert float(rep.run(step, None, *per)) == pytest.approx((1 + 2 + 4) / 3)


@pytest.mark.parametrize("bad, err", [(0, ValueError), (-4, ValueError), (8.0, TypeError),
                                      (True, TypeError), ("8", TypeError)])
def test_bad_global_batch_size(bad, err):
    with pytest.raises(err, match="global_batch_size"):
        jr.compute_average_loss(jnp.ones(2), bad)


def test_array_batch_size_must_be_scalar():
    with pytest.raises(ValueError, match="scalar"):
        jr.compute_average_loss(jnp.ones(2), jnp.ones(2))
