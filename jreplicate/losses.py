"""Loss scaling for replicated training."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jreplicate.context import replica_axis_or_none


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


def scale_regularization_loss(
    regularization_loss: jax.Array | Sequence[jax.Array],
    *,
    axis_name: str | None = None,
) -> jax.Array:
    """This replica's share of a batch-independent loss term (TF's
    ``tf.nn.scale_regularization_loss``).

    A term that does not depend on the batch (an L2 penalty ``wd * sum(w ** 2)``, a KL
    prior) is computed identically on every replica. Since the gradient of a replicated
    parameter is the **sum** over the replicas in sync (see
    :func:`compute_average_loss`), adding the term as is to every replica's loss applies
    it ``num_replicas_in_sync`` times: N-times weight decay, silently. This divides it by
    the number of replicas in sync, so the summed gradient is the term's gradient once,
    and an N-replica step with ``compute_average_loss(...) +
    scale_regularization_loss(term)`` equals a one-device step on the global batch with
    ``mean loss + term``.

    Inside :meth:`jreplicate.Replicator.run` (any strategy, whatever its ``axis_name``)
    it returns ``sum(terms) / ctx.num_replicas_in_sync``: under
    ``ParameterServerStrategy`` that is the size of a worker's sync group (1 without
    sync groups), whose replicas all-reduce into one push, exactly the replicas
    :func:`compute_average_loss`'s ``global_batch_size`` counts. Outside a replica
    context (a one-device step) it returns ``sum(terms)`` unchanged.

    It pairs with gradients summed over the replicas (plain ``jax.grad`` in the step).
    With :func:`jreplicate.sync.replica_grad`, which gives each replica its own
    gradient for ``sync_replicas`` to average, add the term unscaled.

    To report the term itself, sum it: ``ctx.all_sum(scaled)`` is the term.

    Args:
      regularization_loss: a scalar, or a list/tuple of scalars which are summed.
      axis_name: the replica mesh axis. Default ``None``: the axis of the step ``run``
        is tracing (its strategy's ``axis_name``), else ``jr.REPLICA_AXIS`` when bound;
        set it only for your own ``jax.shard_map`` over another axis name.

    Returns:
      A scalar: the (summed) term divided by the number of replicas in sync.

    Raises:
      ValueError: a term is not a scalar, or the list is empty.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> w = jnp.array([1.0, 2.0])
      >>> float(jr.scale_regularization_loss(0.1 * jnp.sum(w ** 2)))  # one device
      0.5
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
      >>> float(rep.run(lambda ctx: jr.scale_regularization_loss(
      ...     [0.1 * jnp.sum(w ** 2), jnp.float32(1.5)])))  # 2.0 / 4 replicas
      0.5
    """
    terms = _regularization_terms(regularization_loss)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    axis = replica_axis_or_none(axis_name)
    if axis is None:  # not inside a replica context: nothing is summed over replicas
        return total
    return total / int(jax.lax.axis_size(axis))


def _regularization_terms(regularization_loss: object) -> list[jax.Array]:
    """The terms as scalar arrays; ``ValueError`` naming the offending one otherwise."""
    many = isinstance(regularization_loss, (list, tuple))
    items = list(regularization_loss) if many else [regularization_loss]
    if not items:
        raise ValueError(
            "scale_regularization_loss(regularization_loss=[]) got no term: pass a scalar "
            "or a non-empty list of scalars."
        )
    terms = []
    for i, item in enumerate(items):
        where = f"regularization_loss[{i}]" if many else "regularization_loss"
        try:
            term = jnp.asarray(item)
        except TypeError as e:
            raise TypeError(
                f"scale_regularization_loss({where}=...) must be a scalar array or number, "
                f"got {type(item).__name__}."
            ) from e
        if term.ndim != 0:
            raise ValueError(
                f"scale_regularization_loss({where}=...) must be a scalar, got shape "
                f"{term.shape}: reduce it first, e.g. jnp.sum(term) (a penalty "
                "wd * jnp.sum(w ** 2) is already one)."
            )
        terms.append(term)
    return terms
