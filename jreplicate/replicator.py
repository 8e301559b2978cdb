"""Replicator: runs a step function on every replica of a strategy."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _compile
from jreplicate.context import PerReplica, _check_logical_device
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.iterator import InputIterator
from jreplicate.strategies.base import Strategy


class Replicator:
    """Replicates a step function across the replicas of ``strategy``.

    Args:
      strategy: a :class:`jreplicate.Strategy`, e.g. :class:`jreplicate.MirroredStrategy`.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
      >>> with rep.scope():
      ...     w = jnp.ones(3)
      >>> def step(ctx, w):
      ...     return w + ctx.all_sum(1.0), ctx.replica_id
      >>> w, ids = rep.run(step, None, w)
      >>> w.tolist(), [int(i) for i in ids]
      ([5.0, 5.0, 5.0], [0, 1, 2, 3])
    """

    def __init__(self, strategy: Strategy):
        if not isinstance(strategy, Strategy):
            raise TypeError(
                "Replicator(strategy) needs a jreplicate strategy such as "
                f"jr.MirroredStrategy(), got {type(strategy).__name__}."
            )
        self._strategy = strategy
        self._cache = _compile.StepCache(strategy)
        # Iterators finalize() closes; held weakly so a dropped one can be collected.
        self._iterators: weakref.WeakSet[InputIterator] = weakref.WeakSet()

    # -- facts ---------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The strategy's mesh; its ``"replica"`` axis enumerates the replicas."""
        return self._strategy.mesh

    @property
    def num_replicas(self) -> int:
        """The total number of replicas."""
        return self._strategy.num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas training in sync."""
        return self._strategy.num_replicas_in_sync

    # -- lifecycle -----------------------------------------------------------------
    def initialize(self) -> list:
        """Runs start-up work now (JAX is eager) and returns ``[]``."""
        return []

    def finalize(self) -> list:
        """Runs shutdown work now (stops input prefetch threads) and returns ``[]``."""
        for it in list(self._iterators):
            it.close()
        return []

    @contextlib.contextmanager
    def scope(self) -> Iterator[Replicator]:
        """Context in which new arrays are placed replicated on the replicas' devices.

        It is ``jax.set_mesh(mesh)``: arrays, optax states and Flax NNX modules created
        inside it are replicated over the strategy's mesh. Re-entrant; :meth:`run`
        applies it too, and places any argument not yet replicated.
        """
        with jax.set_mesh(self.mesh):
            yield self

    def logical_device_for_variables(self, logical_device_id: int
                                     ) -> contextlib.AbstractContextManager:
        """Context placing variables on a logical device of each replica (only 0 here)."""
        _check_logical_device(logical_device_id, "Replicator.logical_device_for_variables")
        return contextlib.nullcontext()

    # -- input ---------------------------------------------------------------------
    def prepare_input(
        self,
        fn: Callable[[InputContext], Any],
        replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
        prefetch_on_device: bool | None = None,
        enforce_ordering: bool = False,
        *,
        prefetch_buffer_size: int = 1,
    ) -> InputIterator:
        """Builds the input pipelines and returns an iterator to pass to :meth:`run`.

        Args:
          fn: ``input_fn(ctx: InputContext)`` returning an iterable of per-replica
            batches (generator, list, Grain dataset or loader, anything with
            ``as_numpy_iterator()``) or a parameter-less callable returning one batch.
            Batch with ``ctx.get_per_replica_batch_size(global_batch_size)``.
          replication_mode: how many pipelines to create; see
            :class:`InputReplicationMode`.
          prefetch_on_device: read and copy the next batch to the devices on a
            background thread while the current step runs. ``None``: on for
            accelerators and for several processes, off for one process's CPU devices.
          enforce_ordering: read pipelines strictly in replica-id order (replica 0
            before replica 1). Otherwise per-replica pipelines are read concurrently.
          prefetch_buffer_size: batches kept ready when prefetching (default 1).
        """
        if not callable(fn):
            raise TypeError(f"prepare_input(fn) must be callable, got {type(fn).__name__}.")
        if isinstance(prefetch_buffer_size, bool) or not isinstance(prefetch_buffer_size, int) \
                or prefetch_buffer_size < 1:
            raise ValueError(
                f"prepare_input(prefetch_buffer_size={prefetch_buffer_size!r}) must be an "
                "int >= 1."
            )
        if prefetch_on_device is None:
            # Accelerators: overlap the host-to-device copy. Several processes: also
            # keeps each process's per-step input agreement off the critical path.
            prefetch_on_device = (self._strategy.devices[0].platform != "cpu"
                                  or self._strategy.num_workers > 1)
        it = InputIterator(
            self, self._strategy, fn, replication_mode=replication_mode,
            prefetch_buffer_size=prefetch_buffer_size if prefetch_on_device else 0,
            enforce_ordering=bool(enforce_ordering))
        self._iterators.add(it)
        return it

    # -- running -------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], inputs: Any = None, *args: Any) -> Any:
        """Runs ``fn`` on every replica, compiled once with ``jax.jit`` over ``shard_map``.

        ``run(fn)`` calls ``fn(ctx)``; ``run(fn, inputs, *args)`` calls
        ``fn(ctx, batch, *args)`` with this step's per-replica ``batch`` from an
        :class:`InputIterator` (or a pytree of :class:`PerReplica`); ``run(fn, None,
        *args)`` calls ``fn(ctx, *args)``. ``args`` are replicated state (pytrees of
        arrays, optax states, Flax NNX modules, which are updated in place) or
        :class:`PerReplica` values (each replica gets its own).

        Gradients with respect to replicated arguments are **summed** over the replicas
        automatically (the transpose of replication); scale each replica's loss with
        :func:`jreplicate.compute_average_loss` to get the global-batch mean.

        Returns:
          ``fn``'s outputs: each leaf identical on all replicas comes back as one
          replicated ``jax.Array``; each leaf that differs comes back as a
          :class:`PerReplica`.

        Raises:
          StopIteration: ``inputs`` is exhausted.
        """
        if not callable(fn):
            raise TypeError(f"Replicator.run(fn) must be callable, got {type(fn).__name__}.")
        has_batch = inputs is not None  # before get_next: an element may itself be None
        if isinstance(inputs, InputIterator):
            if inputs._owner is not self:
                raise ValueError(
                    "Replicator.run(fn, inputs): `inputs` was prepared by another "
                    "Replicator. Call prepare_input on the Replicator that runs the step."
                )
            inputs = inputs.get_next()
        # No jax.set_mesh here: fn runs inside shard_map over this mesh, which is the
        # scope, and run stays usable under an outer jax.jit (set_mesh is not).
        return self._cache.call(fn, has_batch, inputs, args)

    # -- results -------------------------------------------------------------------
    def reduce(self, reduce_op: str, value: Any) -> Any:
        """Reduces per-replica values over replicas: ``"sum"`` or ``"mean"``.

        :class:`PerReplica` leaves are reduced along their replica axis; a replicated
        leaf counts as the same value on every replica (``"sum"`` multiplies it by
        ``num_replicas``).
        """
        if reduce_op not in ("sum", "mean"):
            raise ValueError(f"reduce(reduce_op={reduce_op!r}) must be 'sum' or 'mean'.")
        n = self.num_replicas

        def red(x):
            if isinstance(x, PerReplica):
                return _REDUCERS[reduce_op](x.array)
            x = jnp.asarray(x)
            return x * n if reduce_op == "sum" else x

        return jax.tree.map(red, value, is_leaf=lambda x: isinstance(x, PerReplica))

    def local_results(self, value: Any) -> list[Any]:
        """This process's replicas' values, one pytree per local replica (replica order)."""
        out = []
        for r in self._strategy.local_replica_ids:
            dev = self._strategy.devices[r]
            out.append(jax.tree.map(
                lambda x: x[r] if isinstance(x, PerReplica) else _local_copy(x, dev),  # noqa: B023
                value, is_leaf=lambda x: isinstance(x, PerReplica)))
        return out

    def replicate(self, value: Any) -> Any:
        """Places a pytree of arrays replicated on every replica's device."""
        sharding = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda x: jax.device_put(x, sharding), value)


# Reductions over the leading replica axis of a PerReplica's global array.
_REDUCERS: dict[str, Callable] = {
    "sum": jax.jit(functools.partial(jnp.sum, axis=0)),
    "mean": jax.jit(functools.partial(jnp.mean, axis=0)),
}


def _local_copy(x: Any, device: jax.Device) -> Any:
    """``device``'s full copy of a replicated array (other values as they are)."""
    if isinstance(x, jax.Array):
        for shard in x.addressable_shards:
            if shard.device == device and all(
                    (s.start in (None, 0) and s.stop in (None, d))
                    for s, d in zip(shard.index, x.shape)):
                return shard.data
    return x
