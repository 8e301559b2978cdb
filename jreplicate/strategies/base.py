"""The small protocol every strategy implements."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS, Layout

if TYPE_CHECKING:
    from jreplicate.cluster.agreement import Agreement
    from jreplicate.execution.base import Executor

__all__ = ["MODEL_AXIS", "REPLICA_AXIS", "Strategy"]


class Strategy(abc.ABC):
    """How replicas map onto devices and processes, and how their steps execute.

    A strategy provides two things, both fixed when it is created:

    * a :class:`~jreplicate.layout.Layout`: the mesh, its replica and model
      axes, the devices of each replica, this process's replicas and the workers;
    * an executor (:meth:`make_executor`): places state, turns input elements into what
      a step consumes, compiles and runs steps, and returns results.

    :class:`jreplicate.Replicator`, the input layer and checkpoints only use this
    protocol, so a strategy that is not SPMD plugs in with an executor of its own.

    Example (the facts every strategy answers, here on 8 devices):
      >>> import jreplicate as jr
      >>> s = jr.MirroredStrategy(logical_devices_per_replica=2)
      >>> isinstance(s, jr.strategies.Strategy), s.num_replicas, s.logical_devices_per_replica
      (True, 4, 2)
      >>> s.axis_name, dict(s.mesh.shape)
      ('replica', {'replica': 4, 'model': 2})
      >>> s.layout.replica_devices[1] == tuple(s.mesh.devices[1])  # replica 1's devices
      True
    """

    @property
    @abc.abstractmethod
    def layout(self) -> Layout:
        """Where the replicas live (computed once)."""

    @abc.abstractmethod
    def make_executor(self) -> Executor:
        """A new executor running steps for one :class:`jreplicate.Replicator`."""

    @property
    def steps_per_run(self) -> int | None:
        """Steps per :meth:`jreplicate.Replicator.run` call with an input iterator when
        ``steps=`` is not given (None: one step)."""
        return None

    def agreement(self, name: str) -> Agreement | None:
        """A channel on which the processes agree on small facts each step (input
        outcomes, checkpoint errors), or ``None`` when there is one process. Every
        process must open its channels in the same order."""
        return None

    # -- facts, from the layout ------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        """The ``(axis_name, "model")`` device mesh."""
        return self.layout.mesh

    @property
    def axis_name(self) -> str:
        """The mesh axis over which replicas are laid out, the strategy's ``axis_name=``
        (default ``jr.REPLICA_AXIS``, ``"replica"``); ``ctx.axis_name`` in a step."""
        return self.layout.replica_axis

    @property
    def num_replicas(self) -> int:
        """The total number of replicas, over all processes."""
        return self.layout.num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas whose gradients are aggregated synchronously."""
        return self.layout.num_replicas_in_sync

    @property
    def logical_devices_per_replica(self) -> int:
        """The number of devices one replica spans (the size of the model axis)."""
        return self.layout.logical_devices_per_replica

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The first device (logical device 0) of each replica, indexed by replica id."""
        return self.layout.first_devices

    @property
    def num_processes(self) -> int:
        """The number of processes taking part (1 unless the job spans several)."""
        return self.layout.num_processes

    @property
    def process_index(self) -> int:
        """This process's index among them, in process-index order."""
        return self.layout.process_index

    @property
    def num_workers(self) -> int:
        """The number of workers. For the SPMD strategies a worker is a process, as in
        TensorFlow's ``MultiWorkerMirroredStrategy``; for
        :class:`jreplicate.ParameterServerStrategy` it is a worker task (sync group)."""
        return self.layout.num_processes

    @property
    def worker_index(self) -> int:
        """This process's index among the workers (its process index, for SPMD strategies)."""
        return self.layout.process_index

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        """The replica ids whose devices this process can address."""
        return self.layout.local_replica_ids

    @property
    def weight_update_sharding(self) -> str | None:
        """Which state the strategy keeps sharded over the replicas: None (none: all
        replicated), ``"optimizer"`` (ZeRO-1/2) or ``"parameters"`` (ZeRO-3/FSDP); the
        strategy's ``weight_update_sharding=``.

        Example:
          >>> import jreplicate as jr
          >>> jr.MirroredStrategy(weight_update_sharding="optimizer").weight_update_sharding
          'optimizer'
          >>> jr.MirroredStrategy().weight_update_sharding is None
          True
        """
        return self.layout.weight_update_sharding

    def _repr_weight_update(self) -> str:
        level = self.weight_update_sharding
        if level is None:
            return ""
        extra = f", weight_update_sharding={level!r}"
        if self.layout.min_weight_shard_size != 1024:
            extra += f", min_weight_shard_size={self.layout.min_weight_shard_size}"
        return extra

    def __repr__(self) -> str:
        m = self.logical_devices_per_replica
        extra = f", logical_devices_per_replica={m}" if m > 1 else ""
        if self.axis_name != REPLICA_AXIS:
            extra += f", axis_name={self.axis_name!r}"
        extra += self._repr_weight_update()
        return f"{type(self).__name__}(num_replicas={self.num_replicas}{extra})"
