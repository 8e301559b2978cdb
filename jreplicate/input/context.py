"""InputReplicationMode and InputContext."""

from __future__ import annotations

import enum


class InputReplicationMode(enum.Enum):
    """How many input pipelines ``input_fn`` creates, and which replicas read each.

    * ``SINGLE``: ``input_fn`` is called once (on worker 0); every replica, on every
      worker, reads from that one pipeline.
    * ``PER_WORKER`` (default): ``input_fn`` is called once per worker (process); the
      replicas of a worker read from that worker's pipeline. Under
      :class:`jreplicate.ParameterServerStrategy` a worker is a PS worker: ``input_fn``
      runs on it (its thread, or its Ray actor) and the driver reads nothing.
    * ``PER_REPLICA``: ``input_fn`` is called once per replica; each replica reads its
      own pipeline.

    Whatever the mode, a pipeline yields *per-replica* batches and each replica takes
    one element per step.

    Example (``PER_REPLICA``: one pipeline per replica, each told which it is):
      >>> import numpy as np, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> def input_fn(ctx):
      ...     return iter([np.full((2,), ctx.input_pipeline_id, np.float32)] * 3)
      >>> it = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA)
      >>> np.asarray(rep.run(lambda ctx, x: x[0], it).array).tolist()  # replica r: pipeline r
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """

    SINGLE = 0
    PER_WORKER = 1
    PER_REPLICA = 2


class InputContext:
    """Passed to ``input_fn``: sizes of the replication and which pipeline this is.

    Example:
      >>> import jreplicate as jr
      >>> ctx = jr.InputContext(num_replicas=8, num_replicas_in_sync=8,
      ...                       input_pipeline_id=0, num_input_pipelines=1)
      >>> ctx.get_per_replica_batch_size(256)
      32
    """

    def __init__(self, *, num_replicas: int, num_replicas_in_sync: int,
                 input_pipeline_id: int, num_input_pipelines: int):
        self._num_replicas = num_replicas
        self._num_in_sync = num_replicas_in_sync
        self._pipeline_id = input_pipeline_id
        self._num_pipelines = num_input_pipelines
        # The per-replica batch size input_fn last asked for (None: never): a batch
        # shaped for jax.pmap is told apart by it (see jreplicate._porting).
        self._asked_batch_size: int | None = None

    @property
    def num_replicas(self) -> int:
        """The total number of compute replicas."""
        return self._num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of compute replicas training in sync."""
        return self._num_in_sync

    @property
    def input_pipeline_id(self) -> int:
        """0 for ``SINGLE``, the worker id for ``PER_WORKER``, the replica id for
        ``PER_REPLICA``."""
        return self._pipeline_id

    @property
    def num_input_pipelines(self) -> int:
        """1 for ``SINGLE``, the number of workers for ``PER_WORKER``, the number of
        replicas for ``PER_REPLICA``."""
        return self._num_pipelines

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch each replica should get for a given global batch size.

        Raises:
          ValueError: if ``global_batch_size`` is not divisible by
            ``num_replicas_in_sync``.
        """
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
            raise TypeError(
                "get_per_replica_batch_size(global_batch_size=...) must be an int, got "
                f"{type(global_batch_size).__name__}."
            )
        n = self._num_in_sync
        if global_batch_size <= 0 or global_batch_size % n:
            lo = max(n, global_batch_size // n * n)
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the "
                f"{n} replicas in sync. Use a multiple of {n}, e.g. {lo} or {lo + n}."
            )
        self._asked_batch_size = global_batch_size // n
        return self._asked_batch_size

    def __repr__(self) -> str:
        return (f"InputContext(num_replicas={self._num_replicas}, "
                f"num_replicas_in_sync={self._num_in_sync}, "
                f"input_pipeline_id={self._pipeline_id}, "
                f"num_input_pipelines={self._num_pipelines})")
