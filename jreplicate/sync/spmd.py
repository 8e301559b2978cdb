"""Helpers for the SPMD driver: replica-axis detection and per-replica gradients."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jreplicate._jax_compat import varying_axes
from jreplicate.context import replica_axis_or_none


def bound_axis_size(axis_name: str) -> int | None:
    """Size of mesh axis ``axis_name`` if it is bound in the current trace, else ``None``.

    The axis is bound inside ``jax.shard_map`` over a mesh with that axis name (what
    :meth:`jreplicate.Replicator.run` does); JAX's own axis environment answers, so
    nothing here keeps state of its own.
    """
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError:
        return None


def tracks_varying(axis_name: str) -> bool:
    """Whether the enclosing ``shard_map`` checks varying-ness (``check_vma=True``)."""
    return axis_name in varying_axes(jax.lax.axis_index(axis_name))


def to_varying(tree: Any, axis_name: str) -> Any:
    """Marks every leaf of ``tree`` as varying over ``axis_name`` (no data moves)."""
    if not tracks_varying(axis_name):
        return tree

    def cast(x):
        if axis_name in varying_axes(x):
            return x
        return jax.lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


def match_varying(tree: Any, like: Any) -> Any:
    """Casts each leaf of ``tree`` to vary over the axes its twin in ``like`` varies over."""

    def cast(x, ref):
        missing = tuple(sorted(varying_axes(ref) - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree, like)


def replica_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: str | None = None,
) -> Callable[..., Any]:
    """Like :func:`jax.value_and_grad`, but gives THIS replica's gradient in ``shard_map``.

    Inside ``jax.shard_map`` (with the default ``check_vma=True``) JAX differentiates a
    function of replicated (unvarying) params into the gradient SUMMED over the
    replicas, since each replica's loss depends on the same params. ``sync_replicas``
    must see each replica's own gradient to drop stragglers, so this wrapper first marks
    the differentiated arguments as varying over ``axis_name`` (``jax.lax.pcast(...,
    to="varying")``, which moves no data) and then differentiates. Outside a replica
    context it is exactly ``jax.value_and_grad``.

    Args:
      fun: function to differentiate, e.g. ``loss(params, batch)``.
      argnums: which positional argument(s) to differentiate with respect to.
      has_aux: as in :func:`jax.value_and_grad`.
      axis_name: the replica mesh axis. Default ``None``: the axis of the step
        ``Replicator.run`` is tracing (its strategy's ``axis_name``), else
        ``jr.REPLICA_AXIS`` when a hand-written ``jax.shard_map`` binds it.

    Returns:
      A function returning ``(value, grads)``; both vary over the replicas.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jreplicate.sync import replica_value_and_grad
      >>> mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> def step(w, x):
      ...     _, own = replica_value_and_grad(loss)(w, x)
      ...     summed = jax.grad(loss)(w, x)  # already summed over replicas
      ...     return own[None], summed
      >>> x = jax.device_put(jnp.array([1.0, 2.0]), jax.NamedSharding(mesh, P("replica")))
      >>> own, summed = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("replica")),
      ...                                     out_specs=(P("replica"), P())))(1.0, x)
      >>> own.tolist(), float(summed)
      ([1.0, 2.0], 3.0)
    """
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        axis = replica_axis_or_none(axis_name)
        if axis is not None:
            args = list(args)
            for i in nums:
                args[i] = to_varying(args[i], axis)
        return vg(*args, **kwargs)

    return wrapped


def replica_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: str | None = None,
) -> Callable[..., Any]:
    """Like :func:`jax.grad`, but gives this replica's own gradient in ``shard_map``.

    See :func:`replica_value_and_grad`; this returns only the gradient (and the aux
    value when ``has_aux=True``).

    Example (each replica's own gradient, not their sum):
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jreplicate.sync import replica_grad
      >>> mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
      >>> step = lambda w, x: replica_grad(lambda w, x: jnp.sum(w * x))(w, x)[None]
      >>> x = jax.device_put(jnp.array([3.0, 4.0]), jax.NamedSharding(mesh, P("replica")))
      >>> jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("replica")),
      ...                       out_specs=P("replica")))(1.0, x).tolist()
      [3.0, 4.0]
    """
    vg = replica_value_and_grad(fun, argnums, has_aux, axis_name=axis_name)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped


def gather_scalars(values: Sequence[jax.Array], axis_name: str, size: int) -> list[jax.Array]:
    """All-gathers per-replica scalars into replicated (unvarying) vectors of ``size``.

    One ``psum`` of one-hot rows, so the result is identical, and typed unvarying, on
    every replica.
    """
    onehot = jnp.arange(size) == jax.lax.axis_index(axis_name)
    rows = [jnp.where(onehot, v, jnp.zeros((), v.dtype)) for v in values]
    return list(jax.lax.psum(rows, axis_name))


def arrives_before(times: jax.Array) -> jax.Array:
    """``before[j, i]``: replica ``i``'s gradient arrives before replica ``j``'s.

    A strict total order on the replicas, whatever the times: by time as a number
    (``-0.0`` equals ``0.0``; a subnormal time equals ``0.0`` too, as XLA flushes
    denormals to zero; ``-inf`` comes first, ``+inf`` after every finite time),
    every NaN after every number, and equal times (NaN among them) by replica id. So the
    ranks ``sum(before & fresh, axis=1)`` of the fresh replicas are ``0, 1, ...`` with
    no repeat, and "rank < needed" selects exactly ``min(needed, fresh)`` of them
    (a comparison with NaN alone is always false, which used to give every NaN rank 0).
    """
    nan = jnp.isnan(times)
    key = jnp.where(nan, jnp.zeros((), times.dtype), times)
    ids = jnp.arange(times.shape[0])

    def lt(a):
        return a[None, :] < a[:, None]

    def eq(a):
        return a[None, :] == a[:, None]

    nan = nan.astype(jnp.int32)
    return lt(nan) | (eq(nan) & (lt(key) | (eq(key) & lt(ids))))


def replicated_vector(value: Any, axis_name: str, size: int, name: str) -> jax.Array | None:
    """``value`` as a float32 vector of ``size`` if it is one, identical on all replicas.

    Lets a caller that knows every replica's value (e.g. a simulated arrival schedule
    passed as replicated data) skip the all-reduce of :func:`gather_scalars`. Returns
    ``None`` for a per-replica scalar (or ``None``).
    """
    if value is None or jnp.ndim(value) != 1:
        return None
    x = jnp.asarray(value)
    if axis_name in varying_axes(x):
        raise ValueError(
            f"{name}: a vector must be the same on every replica (all replicas' values, "
            f"shape ({size},)); pass this replica's own value as a scalar instead."
        )
    if x.shape != (size,):
        raise ValueError(
            f"{name} has shape {x.shape}; pass a scalar for this replica, or a vector of "
            f"all {size} replicas' values (shape ({size},)), identical on every replica."
        )
    return x.astype(jnp.float32)
