"""ReplicaContext (collectives inside a replicated step) and PerReplica values."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jreplicate._jax_compat import axis_bound
from jreplicate._jax_compat import varying_axes as _varying
from jreplicate._tree import check_array_leaves, covers
from jreplicate.layout import REPLICA_AXIS

T = TypeVar("T")

_TRACING = threading.local()  # .axes: the replica axes of the steps traced in this thread


@contextlib.contextmanager
def tracing_step(axis_name: str) -> Iterator[None]:
    """Marks the step being traced (by the executor, in this thread) as running over
    replica axis ``axis_name``, for :func:`active_axis_name`."""
    axes = _TRACING.__dict__.setdefault("axes", [])
    axes.append(axis_name)
    try:
        yield
    finally:
        axes.pop()


def active_axis_name() -> str | None:
    """The replica axis of the innermost step :meth:`jreplicate.Replicator.run` is
    tracing in this thread, or ``None`` outside a step."""
    axes = getattr(_TRACING, "axes", None)
    return axes[-1] if axes else None


def replica_axis_or_none(axis_name: str | None) -> str | None:
    """The replica axis a helper with an ``axis_name=`` argument works over, or ``None``
    when that axis is not bound (outside a replica context).

    ``axis_name=None`` (the helpers' default) means the axis of the step ``run`` is
    tracing (the strategy's ``axis_name``), else :data:`jreplicate.REPLICA_AXIS` when a
    hand-written ``jax.shard_map`` binds it; a name given is used as it is.
    """
    if axis_name is None:
        axis_name = active_axis_name() or REPLICA_AXIS
    return axis_name if axis_bound(axis_name) else None


class ReplicaContext:
    """What a step function sees of the replication: ids, sizes and collectives.

    An instance is passed as the first argument of the function given to
    :meth:`jreplicate.Replicator.run`. Every collective takes any pytree of arrays and
    must be called by all replicas in the same order (they trace the same program, so
    this holds automatically). The results are those of the Replicator design's
    two-replica examples: for ``value`` ``{'a': 1, 'b': [40, 1]}`` on replica 0 and
    ``{'a': 3, 'b': [2, 98]}`` on replica 1, ``all_sum`` gives
    ``{'a': 4, 'b': [42, 99]}`` on both.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
      >>> out = rep.run(lambda ctx: ctx.all_sum(ctx.replica_id + 1))
      >>> int(out)
      3
    """

    def __init__(self, *, axis_name: str, num_replicas: int, num_replicas_in_sync: int,
                 logical_devices_per_replica: int = 1, batch_mask: Any = None):
        self._mask = batch_mask
        self._axis = axis_name
        self._num_replicas = num_replicas
        self._num_in_sync = num_replicas_in_sync
        self._num_logical = logical_devices_per_replica

    @property
    def axis_name(self) -> str:
        """The mesh axis name of the replicas, for use with ``jax.lax`` collectives."""
        return self._axis

    @property
    def replica_id(self) -> jax.Array:
        """This replica's id, a traced int32 scalar in ``[0, num_replicas)``."""
        if not axis_bound(self._axis):
            raise RuntimeError(
                "ReplicaContext.replica_id was read outside the step Replicator.run is "
                "running: a ReplicaContext is only valid inside the call of the step it "
                "was passed to."
            )
        return jax.lax.axis_index(self._axis).astype(jnp.int32)

    @property
    def num_replicas(self) -> int:
        """The total number of replicas."""
        return self._num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas whose gradients are aggregated synchronously."""
        return self._num_in_sync

    @property
    def batch_mask(self) -> jax.Array:
        """This replica's mask of real examples, float32 ``[per-replica batch]``, 1 for
        an example of the input and 0 for padding (all ones on full steps).

        Available when the input comes from ``prepare_input(..., partial_batch="pad")``;
        use it as ``compute_average_loss(losses, global_batch_size,
        sample_weight=ctx.batch_mask)`` and for counting (``ctx.all_sum(
        ctx.batch_mask.sum())`` is the number of real examples of the step).

        Raises:
          ValueError: the input does not pad (``partial_batch="drop"``, or no input).
        """
        if self._mask is None:
            raise ValueError(
                "ctx.batch_mask exists when the step's input comes from "
                "rep.prepare_input(input_fn, ..., partial_batch='pad'), which pads partial "
                "batches and marks the padding; this step's input does not pad."
            )
        return self._mask

    def with_batch_mask(self, mask: Any) -> ReplicaContext:
        """This context with ``mask`` as :attr:`batch_mask` (used by the executor)."""
        ctx = ReplicaContext(axis_name=self._axis, num_replicas=self._num_replicas,
                             num_replicas_in_sync=self._num_in_sync,
                             logical_devices_per_replica=self._num_logical, batch_mask=mask)
        return ctx

    @property
    def logical_devices_per_replica(self) -> int:
        """The number of logical devices (the model axis's size) this replica spans."""
        return self._num_logical

    def logical_device(self, logical_device_id: int) -> contextlib.AbstractContextManager:
        """Context marking where the Replicator design puts the computation inside it.

        Logical device ``i`` is index ``i`` of the ``"model"`` mesh axis. The context
        validates ``i`` and places nothing: one compiled program spans every device of
        the mesh, and inside a replica XLA's partitioner places the computation by its
        operands' shardings (the design's default on TPU). Inputs are available on every
        logical device of their replica. To place state, use
        :meth:`jreplicate.Replicator.logical_device_for_variables`; to split memory across
        the logical devices during the step, shard over ``"model"`` (the model-parallelism
        guide).

        Raises:
          ValueError: if ``logical_device_id`` is not in ``[0,
            logical_devices_per_replica)``.
        """
        check_logical_device(logical_device_id, self._num_logical,
                             "ReplicaContext.logical_device")
        return contextlib.nullcontext()

    def _prepare(self, value: T, name: str) -> T:
        if not axis_bound(self._axis):
            raise RuntimeError(
                f"ReplicaContext.{name} was called outside the step Replicator.run is "
                "running: a ReplicaContext is only valid inside the call of the step it was "
                "passed to. Call the collective inside the step; outside it, combine "
                "per-replica results with rep.reduce(...) or rep.local_results(...)."
            )
        check_array_leaves(value, f"ReplicaContext.{name}(value)")
        if any(isinstance(x, PerReplica) for x in jax.tree.leaves(
                value, is_leaf=lambda x: isinstance(x, PerReplica))):
            raise TypeError(
                f"ReplicaContext.{name}(value) got a PerReplica, which lives outside the "
                "step. Pass it to Replicator.run as an argument; inside the step it is this "
                "replica's array."
            )
        return jax.tree.map(jnp.asarray, value)

    def all_sum(self, value: T) -> T:
        """Sums ``value`` (a pytree of arrays) elementwise over all replicas."""
        value = self._prepare(value, "all_sum")
        return jax.tree.map(lambda x: jax.lax.psum(x, self._axis), value)

    def all_min(self, value: T) -> T:
        """Elementwise minimum of ``value`` over all replicas."""
        value = self._prepare(value, "all_min")
        return jax.tree.map(lambda x: _reduce(jax.lax.pmin, x, self._axis), value)

    def all_max(self, value: T) -> T:
        """Elementwise maximum of ``value`` over all replicas."""
        value = self._prepare(value, "all_max")
        return jax.tree.map(lambda x: _reduce(jax.lax.pmax, x, self._axis), value)

    def all_gather(self, value: T) -> T:
        """Stacks ``value`` from every replica: a leaf of shape ``dims`` becomes
        ``[num_replicas] + dims``, in replica-id order."""
        value = self._prepare(value, "all_gather")

        def gather(x):
            if self._axis not in _varying(x):
                return jnp.broadcast_to(x[None], (self._num_replicas,) + x.shape)
            return jax.lax.all_gather(x, self._axis, axis=0, tiled=False, to="invarying")

        return jax.tree.map(gather, value)

    def broadcast(self, value: T, source_replica_id: int) -> T:
        """Every replica gets ``value`` as computed on replica ``source_replica_id``.

        ``value`` is evaluated on all replicas; the cost is one all-reduce (the source's
        value summed with zeros from the others).

        Args:
          value: a pytree of arrays.
          source_replica_id: a Python int in ``[0, num_replicas)``, the same on every
            replica.

        Raises:
          ValueError: if ``source_replica_id`` is out of range (JAX itself would wrap it
            silently modulo the number of replicas).
        """
        src = _check_source(source_replica_id, self._num_replicas)
        value = self._prepare(value, "broadcast")
        me = jax.lax.axis_index(self._axis)

        def bcast(x):
            if self._axis not in _varying(x):
                return x
            kind = x.dtype
            y = x.astype(jnp.int32) if kind == jnp.bool_ else x
            y = jax.lax.psum(jnp.where(me == src, y, jnp.zeros_like(y)), self._axis)
            return y.astype(kind)

        return jax.tree.map(bcast, value)


def _reduce(op, x, axis):
    if axis not in _varying(x):
        return x
    return op(x, axis)


def _check_source(source_replica_id: Any, n: int) -> int:
    if isinstance(source_replica_id, jax.core.Tracer):
        raise TypeError(
            "ReplicaContext.broadcast(source_replica_id=...) must be a Python int known at "
            "trace time (the same on every replica), not a traced value."
        )
    if isinstance(source_replica_id, bool) or not isinstance(
            source_replica_id, (int, np.integer)):
        raise TypeError(
            "ReplicaContext.broadcast(source_replica_id=...) must be an int, got "
            f"{type(source_replica_id).__name__}."
        )
    src = int(source_replica_id)
    if not 0 <= src < n:
        raise ValueError(
            f"ReplicaContext.broadcast(source_replica_id={src}) is out of range: there are "
            f"{n} replicas, so it must be in [0, {n - 1}]. (JAX would silently wrap it "
            "modulo the number of replicas.)"
        )
    return src


def check_logical_device(i: Any, num_logical: int, where: str) -> int:
    """Validates a logical device id against the number of logical devices per replica."""
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) \
            or not 0 <= int(i) < num_logical:
        hint = ("each replica has one logical device, id 0; create the strategy with "
                "logical_devices_per_replica=M to give each replica M of them"
                if num_logical == 1 else
                f"each replica has {num_logical} logical devices, ids 0..{num_logical - 1}")
        raise ValueError(f"{where}({i!r}) is out of range: {hint}.")
    return int(i)


@jax.tree_util.register_pytree_node_class
class MaskedBatch:
    """A padded step input and its mask of real examples (``partial_batch="pad"``).

    Built by the input iterator; :meth:`jreplicate.Replicator.run` gives the step
    ``batch`` and exposes ``mask`` as ``ctx.batch_mask``.
    """

    def __init__(self, batch: Any, mask: Any):
        self.batch = batch
        self.mask = mask

    def tree_flatten(self):
        return (self.batch, self.mask), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __repr__(self) -> str:
        return f"MaskedBatch(batch={self.batch!r}, mask={self.mask!r})"


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """Values that differ per replica, held as one global array sharded over replicas.

    Behaves as the list of per-replica values the Replicator design returns from
    ``run``: ``len(x)``, ``x[i]`` (replica ``i``'s value) and iteration, while the data
    stays on the devices as one ``jax.Array`` of shape ``[num_replicas, ...]`` (see
    :attr:`array`), sharded over the replica mesh axis (``axis_name``: the strategy's,
    ``"replica"`` unless chosen). Passed back to
    :meth:`jreplicate.Replicator.run`, each replica receives its own slice.

    Attributes:
      array: the values of every replica, stacked on a leading axis of length
        ``num_replicas`` (replica ``r``'s value is ``array[r]``).

    Example:
      >>> import jax, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
      >>> ids = rep.run(lambda ctx: ctx.replica_id * 10)
      >>> [int(v) for v in ids]
      [0, 10]
    """

    def __init__(self, array: jax.Array, mesh: Mesh | None = None,
                 axis_name: str = REPLICA_AXIS):
        self.array = array
        self.mesh = mesh
        self.axis_name = axis_name

    def tree_flatten(self):
        return (self.array,), (self.mesh, self.axis_name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __len__(self) -> int:
        shape = np.shape(self.array)
        if not shape:
            raise TypeError(
                f"This PerReplica holds a {type(self.array).__name__} of shape {shape}, not "
                "an array with a leading replica axis: a function mapped over the tree "
                "(e.g. flax.jax_utils.unreplicate, which takes x[0]) replaced its "
                "per-replica values. Index the PerReplica (x[i] is replica i's value) or "
                "read rep.local_results(x) instead.")
        return int(shape[0])

    def __getitem__(self, i: int) -> jax.Array:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"PerReplica indices are replica ids (ints), got {type(i).__name__}.")
        if not -n <= int(i) < n:
            raise IndexError(f"replica id {i} is out of range for {n} replicas.")
        i = int(i) % n
        if not isinstance(self.array, jax.Array) or isinstance(self.array, jax.core.Tracer):
            return self.array[i]  # numpy, or traced under an outer jit: no shards to pick
        # Replica i's logical device 0 first (inputs live there), then any holder of row i.
        first = None
        grid = getattr(self.mesh, "devices", None)
        if grid is not None and grid.ndim == 2 and grid.shape[0] == n:
            first = grid[i, 0]
        shards = sorted(self.array.addressable_shards, key=lambda s: s.device != first)
        for shard in shards:
            start = shard.index[0].start or 0 if shard.index else 0
            stop = shard.index[0].stop if shard.index and shard.index[0].stop is not None else n
            if start <= i < stop:
                if covers(shard.index[1:], self.array.shape[1:]):
                    return shard.data[i - start]
                # Split over a replica's logical devices: gather its pieces.
                return self.array[i]
        raise IndexError(
            f"replica {i}'s value lives on another process; use Replicator.local_results "
            "for this process's replicas, or Replicator.reduce to combine all of them."
        )

    def __iter__(self) -> Iterator[jax.Array]:
        return (self[i] for i in range(len(self)))

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-replica shape (without the leading replica axis)."""
        return tuple(self.array.shape[1:])

    @property
    def dtype(self):
        return self.array.dtype

    def __repr__(self) -> str:
        if not np.shape(self.array):
            return f"PerReplica(array={self.array!r})"
        return f"PerReplica(num_replicas={len(self)}, shape={self.shape}, dtype={self.dtype})"
