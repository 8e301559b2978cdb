"""Loss scaling for replicated training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def compute_average_loss(
    per_example_loss: jax.Array,
    global_batch_size: int | jax.Array,
    *,
    sample_weight: jax.Array | None = None,
) -> jax.Array:
    """This replica's share of the global-batch mean loss.

    Returns ``sum(per_example_loss * sample_weight) / global_batch_size``, where the
    sum runs over this replica's examples only. Summed over the replicas in sync it is
    the mean loss over the global batch, and that sum is exactly what the automatic
    gradient aggregation of :meth:`jreplicate.Replicator.run` computes: the gradient of
    a replicated parameter is the **sum** over replicas of each replica's gradient. So
    with this scaling an N-replica step equals a one-device step on the concatenated
    global batch with a mean loss. (Dividing by the per-replica batch size instead
    would make gradients N times too large.)

    To report the loss itself, sum it: ``ctx.all_sum(loss)``.

    Args:
      per_example_loss: losses of this replica's examples, shape ``[b, ...]``; all
        axes are summed.
      global_batch_size: the number of examples in one step over all replicas in sync
        (``b * num_replicas_in_sync`` when every replica sees ``b``), a positive Python
        int. With padded batches pass the number of real examples over all replicas
        instead, which may be computed in the step: ``ctx.all_sum(mask.sum())``.
      sample_weight: optional weights broadcastable to ``per_example_loss`` (e.g. a
        0/1 mask of padded examples).

    Example:
      >>> import jax.numpy as jnp, jreplicate as jr
      >>> float(jr.compute_average_loss(jnp.array([1.0, 3.0]), global_batch_size=8))
      0.5
      >>> mask = jnp.array([1.0, 0.0])  # the second example is padding
      >>> float(jr.compute_average_loss(jnp.array([1.0, 3.0]), mask.sum(),
      ...                               sample_weight=mask))
      1.0
    """
    loss = jnp.asarray(per_example_loss)
    if isinstance(global_batch_size, (jax.Array, np.ndarray, np.generic)) \
            and not isinstance(global_batch_size, bool):
        if jnp.ndim(global_batch_size) != 0:
            raise ValueError(
                "compute_average_loss(global_batch_size=...) must be a scalar, got shape "
                f"{jnp.shape(global_batch_size)}."
            )
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise TypeError(
            "compute_average_loss(global_batch_size=...) must be a Python int (or a scalar "
            f"array counting the real examples), got {type(global_batch_size).__name__}."
        )
    elif global_batch_size <= 0:
        raise ValueError(
            f"compute_average_loss(global_batch_size={global_batch_size}) must be positive: "
            "pass the number of examples in one step over all replicas."
        )
    if sample_weight is not None:
        loss = loss * jnp.asarray(sample_weight, dtype=loss.dtype)
    return jnp.sum(loss) / global_batch_size
