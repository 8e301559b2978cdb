"""The small protocol every strategy implements."""

from __future__ import annotations

import abc

import jax
from jax.sharding import Mesh

REPLICA_AXIS = "replica"


class Strategy(abc.ABC):
    """How replicas map onto devices and processes.

    A strategy owns a :class:`jax.sharding.Mesh` whose ``axis_name`` axis enumerates the
    replicas: replica ``i`` runs on ``mesh.devices.flat[i]``. Everything else
    (compilation, collectives, input distribution) is done by
    :class:`jreplicate.Replicator` from these few facts, so a strategy is a small,
    final, immutable description.
    """

    @property
    @abc.abstractmethod
    def mesh(self) -> Mesh:
        """The device mesh; its ``axis_name`` axis enumerates the replicas."""

    @property
    def axis_name(self) -> str:
        """The mesh axis over which replicas are laid out (``"replica"``)."""
        return REPLICA_AXIS

    @property
    def num_replicas(self) -> int:
        """The total number of replicas, over all processes."""
        return int(self.mesh.shape[self.axis_name])

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas whose gradients are aggregated synchronously."""
        return self.num_replicas

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The device of each replica, indexed by replica id."""
        return tuple(self.mesh.devices.flat)

    @property
    def num_workers(self) -> int:
        """The number of processes (workers) taking part."""
        return len({d.process_index for d in self.devices})

    @property
    def worker_index(self) -> int:
        """This process's index among the workers, in process-index order."""
        procs = sorted({d.process_index for d in self.devices})
        return procs.index(jax.process_index()) if jax.process_index() in procs else 0

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        """The replica ids whose devices this process can address."""
        me = jax.process_index()
        return tuple(i for i, d in enumerate(self.devices) if d.process_index == me)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas={self.num_replicas})"
