"""InputIterator: reads per-replica elements and assembles global sharded batches."""

from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate._tree import is_array_like, path_str
from jreplicate.context import PerReplica
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.prefetch import Prefetcher
from jreplicate.input.sources import Pipeline
from jreplicate.strategies.base import Strategy


class InputIterator:
    """Per-step input for :meth:`jreplicate.Replicator.run`, from
    :meth:`jreplicate.Replicator.prepare_input`.

    Each step every replica takes the next element of the pipeline that feeds it; the
    elements are stacked into one global ``jax.Array`` per leaf, of shape
    ``[num_replicas, *element_shape]`` and sharded over the replicas, and returned as a
    pytree of :class:`jreplicate.PerReplica`.

    **Final partial batch: dropped.** Elements must all have the shapes of the first
    step. A step in which any replica's element is smaller along the leading (batch)
    axis, or in which a pipeline runs out, ends the iteration (StopIteration) and its
    elements are dropped with a warning, so a step never recompiles for a short batch.
    Use a pipeline that pads (and passes a mask) if every example must be seen.
    """

    def __init__(self, owner: object, strategy: Strategy,
                 input_fn: Callable[[InputContext], Any], *,
                 replication_mode: InputReplicationMode, prefetch_buffer_size: int,
                 enforce_ordering: bool):
        self._owner = owner
        self._strategy = strategy
        self._mode = replication_mode
        self._enforce_ordering = enforce_ordering
        self._pipelines, self._feeds = _make_pipelines(strategy, input_fn, replication_mode)
        self._spec: list | None = None
        self._exhausted = False
        self._buffer = prefetch_buffer_size
        self._prefetcher = Prefetcher(self._produce, self._buffer) if self._buffer else None

    @property
    def replication_mode(self) -> InputReplicationMode:
        return self._mode

    @property
    def num_input_pipelines(self) -> int:
        """Input pipelines on this process."""
        return len(self._pipelines)

    def get_next(self) -> Any:
        """The next inputs of every replica, as a pytree of :class:`PerReplica`.

        Raises:
          StopIteration: when a pipeline is exhausted (see the partial batch policy).
        """
        if self._prefetcher is not None:
            return self._prefetcher.get()
        return self._produce()

    def __iter__(self) -> InputIterator:
        return self

    def __next__(self) -> Any:
        return self.get_next()

    def reinitialize(self) -> list:
        """Restarts every pipeline from its beginning; returns ``[]`` (eager mode).

        Pipelines built from parameter-less callables are unaffected.
        """
        if self._prefetcher is not None:
            self._prefetcher.close()
        for p in self._pipelines:
            p.reinitialize()
        self._exhausted = False
        if self._buffer:
            self._prefetcher = Prefetcher(self._produce, self._buffer)
        return []

    def close(self) -> None:
        """Stops the prefetch thread, if any."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    # -- reading -----------------------------------------------------------------
    def _read(self) -> list[Any]:
        """One element per local replica, in local replica order."""
        def take(k):
            return self._pipelines[self._feeds[k]].next()

        n = len(self._feeds)
        got = []
        if self._enforce_ordering or len(self._pipelines) == 1 or n == 1:
            for k in range(n):
                try:
                    got.append(take(k))
                except StopIteration:
                    _warn_dropped(len(got), n)
                    raise
            return got
        # Distinct pipelines per replica: read them concurrently.
        with concurrent.futures.ThreadPoolExecutor(min(n, 8)) as pool:
            futures = [pool.submit(take, k) for k in range(n)]
            errors = [f.exception() for f in futures]
        if any(isinstance(e, StopIteration) for e in errors):
            _warn_dropped(sum(e is None for e in errors), n)
            raise StopIteration
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def _produce(self) -> Any:
        if self._exhausted:
            raise StopIteration
        try:
            elements = self._read()
        except StopIteration:
            self._exhausted = True
            raise
        try:
            return self._assemble(elements)
        except _PartialBatch as e:
            self._exhausted = True
            warnings.warn(f"jreplicate: dropped a final partial batch ({e}); the input "
                          "iterator is exhausted.", stacklevel=3)
            raise StopIteration from None

    def _assemble(self, elements: list[Any]) -> Any:
        flat = [_flatten(e, self._strategy.local_replica_ids[k]) for k, e in
                enumerate(elements)]
        treedef = flat[0][1]
        for k, (_, td, _) in enumerate(flat):
            if td != treedef:
                raise ValueError(
                    f"input element of replica {self._strategy.local_replica_ids[k]} has "
                    f"structure {td}, but replica {self._strategy.local_replica_ids[0]}'s "
                    f"has {treedef}. Every pipeline must yield elements of one structure."
                )
        spec = [(x.shape, x.dtype) for x in flat[0][0]]
        if self._spec is None:
            self._spec = spec
        self._check_shapes(flat)
        return self._to_global(flat, treedef)

    def _check_shapes(self, flat: list) -> None:
        for k, (leaves, _, paths) in enumerate(flat):
            rid = self._strategy.local_replica_ids[k]
            for x, (shape, dtype), path in zip(leaves, self._spec, paths):
                if x.shape == shape and x.dtype == dtype:
                    continue
                if (x.ndim == len(shape) and x.ndim and x.shape[1:] == shape[1:]
                        and x.shape[0] < shape[0]):
                    raise _PartialBatch(
                        f"replica {rid} got {x.shape[0]} examples at {path_str(path) or 'root'}"
                        f", the others {shape[0]}")
                raise ValueError(
                    f"input element of replica {rid} at {path_str(path) or 'the root'} has "
                    f"shape {x.shape} and dtype {x.dtype}, but the first step's elements "
                    f"had {shape} and {dtype}. Elements must keep one shape and dtype (only "
                    "a smaller final batch is allowed, and it is dropped)."
                )

    def _to_global(self, flat: list, treedef: Any) -> Any:
        strategy = self._strategy
        devices = [strategy.devices[r] for r in strategy.local_replica_ids]
        sharding = NamedSharding(strategy.mesh, P(strategy.axis_name))
        n_leaves = len(flat[0][0])
        host = [flat[k][0][j][None] for j in range(n_leaves) for k in range(len(devices))]
        placed = jax.device_put(host, devices * n_leaves)
        out = []
        for j in range(n_leaves):
            shards = placed[j * len(devices):(j + 1) * len(devices)]
            shape = (strategy.num_replicas,) + tuple(flat[0][0][j].shape)
            arr = jax.make_array_from_single_device_arrays(shape, sharding, shards)
            out.append(PerReplica(arr, strategy.mesh, strategy.axis_name))
        return jax.tree.unflatten(treedef, out)


class _PartialBatch(Exception):
    pass


def _warn_dropped(read: int, n: int) -> None:
    if read:
        warnings.warn(f"jreplicate: dropped a final partial batch (an input pipeline ran "
                      f"out after {read} of {n} replicas got an element); the input iterator "
                      "is exhausted.", stacklevel=5)


def _flatten(element: Any, replica_id: int) -> tuple[list[np.ndarray], Any, list]:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(element)
    leaves, paths = [], []
    for path, x in pairs:
        if not is_array_like(x):
            raise TypeError(
                f"input element of replica {replica_id} has a {type(x).__name__} at "
                f"{path_str(path) or 'the root'}; elements must be pytrees of arrays "
                "(numpy arrays or Python numbers). Convert it, or drop it in input_fn."
            )
        leaves.append(np.asarray(x))
        paths.append(path)
    return leaves, treedef, paths


def _make_pipelines(strategy: Strategy, input_fn: Callable, mode: InputReplicationMode):
    """Creates this process's pipelines; returns them and, per local replica, the index
    of the pipeline that feeds it."""
    local = strategy.local_replica_ids
    common = dict(num_replicas=strategy.num_replicas,
                  num_replicas_in_sync=strategy.num_replicas_in_sync)
    if mode is InputReplicationMode.PER_REPLICA:
        pipes = [Pipeline(input_fn, InputContext(input_pipeline_id=r,
                                                 num_input_pipelines=strategy.num_replicas,
                                                 **common)) for r in local]
        return pipes, list(range(len(local)))
    if mode is InputReplicationMode.PER_WORKER:
        ctx = InputContext(input_pipeline_id=strategy.worker_index,
                           num_input_pipelines=strategy.num_workers, **common)
    elif mode is InputReplicationMode.SINGLE:
        if strategy.num_workers > 1:
            raise ValueError(
                "InputReplicationMode.SINGLE across several processes needs a strategy "
                "that distributes worker 0's batches (MultiWorkerStrategy)."
            )
        ctx = InputContext(input_pipeline_id=0, num_input_pipelines=1, **common)
    else:
        raise TypeError(
            "prepare_input(replication_mode=...) must be an InputReplicationMode "
            f"(SINGLE, PER_WORKER or PER_REPLICA), got {mode!r}."
        )
    return [Pipeline(input_fn, ctx)], [0] * len(local)
