"""MultiWorkerStrategy: synchronous data parallelism over the devices of many processes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import final

import jax
from jax.sharding import Mesh

from jreplicate.cluster import discovery, runtime, watchdog
from jreplicate.cluster.agreement import Agreement
from jreplicate.cluster.spec import ClusterSpec, Timeouts
from jreplicate.execution.spmd import SPMDExecutor
from jreplicate.layout import (
    REPLICA_AXIS,
    Layout,
    check_axis_name,
    check_logical_devices_per_replica,
    check_weight_update_sharding,
    mesh_layout,
    replica_mesh,
)
from jreplicate.strategies.base import Strategy

_instances = itertools.count()


@final
class MultiWorkerStrategy(Strategy):
    """Synchronous replication over every device of every process of a job.

    The processes (workers) join JAX's distributed runtime (``jax.distributed``; gloo
    collectives on CPU, NCCL on GPU, ICI/DCN on TPU), and one global replica mesh
    spans all their devices, ordered by process: replicas ``0..k-1`` are process 0's
    ``k`` devices, the next ``k`` process 1's, and so on. Every process runs the same
    program; :meth:`jreplicate.Replicator.run` compiles one ``jax.jit(shard_map)`` step
    over the global mesh, gradients are all-reduced across processes, and outputs stay
    global arrays (use :meth:`jreplicate.Replicator.local_results` for this process's
    replicas).

    Where the cluster comes from, in order: the arguments; the ``JREPLICATE_*``
    environment variables of ``python -m jreplicate.cluster.launch``; a
    ``TF_CONFIG``-style JSON (``{"cluster": {"worker": ["host:port", ...]}, "task":
    {"type": "worker", "index": i}}``, worker 0's address being the coordinator's);
    JAX's auto-detection (Cloud TPU, SLURM, Open MPI); else one process.

    Create the strategy at the start of the program, before any JAX computation: it
    starts the distributed runtime, which must come before the JAX backend.

    Failure semantics (no process waits forever):

    * a process that dies is detected by the others within ``heartbeat_timeout`` (at
      once when it was the coordinator, or when a collective's connection breaks), and
      they terminate with an error naming it ("The following tasks are unhealthy
      (stopped sending heartbeats): 1", or gloo's "Connection closed by peer" followed
      by a jreplicate explanation). Measured on loopback with ``heartbeat_timeout=4``:
      the survivor exits 2.7-3.5 s after the kill; the bound is
      ``heartbeat_timeout + shutdown_timeout`` plus about a second.
    * a process that is alive but stops taking part makes the others' next collective
      (gloo: "Timed out waiting ...ms") or input agreement (:class:`.ClusterError`) fail
      after ``collective_timeout``; those processes exit at once, and the stuck one is
      stopped by the runtime when it loses them (or by the launcher). Measured with
      ``collective_timeout=8, heartbeat_timeout=4``: all processes exit 8.4 s after the
      hang began; the bound is ``collective_timeout + heartbeat_timeout`` plus a second.
    * with ``fail_fast`` (on in processes started by ``python -m
      jreplicate.cluster.launch``), an uncaught exception in one process ends it at
      once, with status 1, after its traceback: it does not wait in the runtime's
      shutdown barrier (up to ``shutdown_timeout``) for peers that wait for it in a
      collective. The launcher then stops the others and names that process and its
      exception (measured with the default timeouts: the group stops 5.4 s after the
      exception, of which 5 s are the launcher's ``--grace``).
    * validation that decides between continuing and raising (device counts, input
      structure and shapes, end of input, a failing ``input_fn``, checkpoint errors,
      ``run``'s host-side arguments: see :mod:`jreplicate.execution.agreed`) is
      computed from facts every process shares, so all processes raise together.
    * at exit a process waits for the computations it dispatched before it joins the
      runtime's shutdown barrier, so none leaves while a peer waits for it in one.

    Args:
      coordinator_address: ``host:port`` of process 0, where the coordination service
        listens (any free port, the same on every process). With a loopback address
        (``127.0.0.1``, ``::1``, ``localhost``) every socket of the job listens on
        loopback only.
      num_processes: the number of processes in the job.
      process_id: this process's id, ``0 <= process_id < num_processes``; process 0 is
        the chief.
      local_device_ids: restricts this process to these local devices (GPU/TPU).
      initialization_timeout: seconds start-up waits for the coordinator and all
        processes (default 300; env ``JREPLICATE_INITIALIZATION_TIMEOUT``).
      heartbeat_timeout: seconds without heartbeats after which a process is declared
        dead (default 100; env ``JREPLICATE_HEARTBEAT_TIMEOUT``).
      shutdown_timeout: seconds a finishing process waits for the others (default 300;
        env ``JREPLICATE_SHUTDOWN_TIMEOUT``).
      collective_timeout: seconds a cross-process collective or agreement waits for the
        slowest process (default 600; env ``JREPLICATE_COLLECTIVE_TIMEOUT``). Applies to
        CPU (gloo) collectives and to jreplicate's own agreements.
      cluster_detection_method: passed to ``jax.distributed.initialize`` when the
        cluster is auto-detected (e.g. ``"mpi4py"``).
      coordinator_bind_address: ``host:port`` on which process 0's coordination
        service listens (env ``JREPLICATE_COORDINATOR_BIND_ADDRESS``). Default: the
        coordinator address itself when it is a loopback address, else JAX's default,
        every interface (``[::]:port``); on a multi-host cluster give the address of the
        interface the other hosts reach, e.g. ``"10.0.0.1:1234"``.
      logical_devices_per_replica: M, the devices one replica spans (default 1); must
        divide the number of devices of each process. See
        :class:`jreplicate.MirroredStrategy`.
      axis_name: the name of the replica mesh axis (default ``jr.REPLICA_AXIS``,
        ``"replica"``); e.g. ``"batch"`` for a ``jax.pmap`` program's collectives and
        ``nnx.BatchNorm(axis_name="batch")``. The same on every process. See
        :class:`jreplicate.MirroredStrategy`.
      weight_update_sharding: ``None`` (the default), ``"optimizer"`` (ZeRO-1/2) or
        ``"parameters"`` (ZeRO-3/FSDP): which state is stored sharded over the replicas.
        See :class:`jreplicate.MirroredStrategy`.
      min_weight_shard_size: leaves with fewer elements stay replicated (default 1024).
      fail_fast: whether an uncaught exception ends this process at once (status 1,
        130 for KeyboardInterrupt), without waiting in ``jax.distributed``'s shutdown
        barrier. A process that raised must not leave its peers hanging in a
        collective, waiting for it until ``collective_timeout``, while it waits for them
        in the barrier until ``shutdown_timeout``. ``True`` installs a process-wide
        ``sys.excepthook`` (it also explains errors caused by a dead or stuck peer);
        ``False`` never does; ``None`` (the default) installs it only when the
        environment sets ``JREPLICATE_FAIL_FAST=1``, as ``python -m
        jreplicate.cluster.launch`` does for the processes of a job of more than one
        process. See ``jreplicate.cluster.watchdog.install_fail_fast``.

    Raises:
      ValueError: inconsistent arguments or environment, or processes with different
        numbers of devices.
      TypeError: ``fail_fast`` is not a bool or None, or ``axis_name`` not a str
        (checked before connecting).
      ClusterError: the coordinator cannot be reached within ``initialization_timeout``.

    Example (``train.py``, run with
    ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 4 train.py``)::

        import jreplicate as jr
        strategy = jr.MultiWorkerStrategy(heartbeat_timeout=30)  # first, before JAX work
        rep = jr.Replicator(strategy)
        print(strategy.num_replicas, strategy.num_workers, strategy.is_chief)
        # process 0 prints "8 2 True", process 1 "8 2 False"

    Without a cluster (no launcher, ``TF_CONFIG`` or arguments) it is one process
    whose local devices are the replicas, here 8:

      >>> import jreplicate as jr
      >>> s = jr.MultiWorkerStrategy()
      >>> s.num_replicas, s.num_workers, s.worker_index, s.is_chief
      (8, 1, 0, True)
    """

    def __init__(
        self,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        local_device_ids: int | Sequence[int] | None = None,
        *,
        initialization_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        collective_timeout: float | None = None,
        cluster_detection_method: str | None = None,
        logical_devices_per_replica: int = 1,
        coordinator_bind_address: str | None = None,
        fail_fast: bool | None = None,
        axis_name: str = REPLICA_AXIS,
        weight_update_sharding: str | None = None,
        min_weight_shard_size: int = 1024,
    ):
        m = check_logical_devices_per_replica(logical_devices_per_replica,
                                              "MultiWorkerStrategy")
        wus = check_weight_update_sharding(weight_update_sharding, min_weight_shard_size,
                                           "MultiWorkerStrategy")  # before connecting
        axis = check_axis_name(axis_name, "MultiWorkerStrategy")  # before connecting
        fail_fast = watchdog.fail_fast_requested(fail_fast)
        self._timeouts = Timeouts.resolve(
            initialization_timeout=initialization_timeout, heartbeat_timeout=heartbeat_timeout,
            shutdown_timeout=shutdown_timeout, collective_timeout=collective_timeout)
        spec = discovery.resolve_cluster(coordinator_address, num_processes, process_id,
                                        local_device_ids)
        self._cluster = runtime.connect(spec, self._timeouts, cluster_detection_method,
                                       coordinator_bind_address)
        self._layout = mesh_layout(_global_mesh(m, axis), weight_update_sharding=wus[0],
                                   min_weight_shard_size=wus[1])
        self._uid = next(_instances)
        self._agreements = itertools.count()
        if fail_fast:
            watchdog.install_fail_fast(self.process_index, self.num_processes, self._timeouts)
        if self.num_processes > 1:
            watchdog.settle_at_exit()  # no process leaves a peer inside a collective

    # -- facts ---------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._layout

    def make_executor(self) -> SPMDExecutor:
        # (across processes, run's host-side arguments are agreed on their own channel)
        return SPMDExecutor(self._layout, self.agreement("arguments"))

    @property
    def cluster(self) -> ClusterSpec:
        """Where this process stands (coordinator, number of processes, id, source)."""
        return self._cluster

    @property
    def timeouts(self) -> Timeouts:
        """The bounds on the runtime's waits."""
        return self._timeouts

    @property
    def is_chief(self) -> bool:
        """True on process 0, which initialises state and writes checkpoints."""
        return self.worker_index == 0

    @property
    def devices_per_worker(self) -> int:
        """The number of replicas (devices) of each process."""
        return self.num_replicas // self.num_workers

    def __repr__(self) -> str:
        return (f"MultiWorkerStrategy(num_replicas={self.num_replicas}, "
                f"num_workers={self.num_workers}, worker_index={self.worker_index}"
                f"{self._repr_weight_update()})")

    # -- agreement (used by the input iterator and the checkpoint manager) -------------
    def agreement(self, name: str) -> Agreement | None:
        """A new all-gather channel (``None`` for one process); every process must create
        its channels in one order."""
        if self.num_processes == 1:
            return None
        prefix = f"jreplicate/{self._uid}/{name}/{next(self._agreements)}"
        return Agreement(prefix, self.num_processes, self.process_index,
                         self._timeouts.collective_timeout)


def _global_mesh(logical_devices_per_replica: int, axis_name: str) -> Mesh:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    counts = sorted(set(per_process.values()))
    if len(counts) > 1:
        listing = ", ".join(f"process {p}: {c}" for p, c in sorted(per_process.items()))
        raise ValueError(
            f"MultiWorkerStrategy needs the same number of devices on every process, got "
            f"{listing}. Give every process the same devices (local_device_ids=..., or "
            "--devices-per-proc K with jreplicate.cluster.launch / "
            "XLA_FLAGS=--xla_force_host_platform_device_count=K on CPU)."
        )
    return replica_mesh(devices, logical_devices_per_replica, "MultiWorkerStrategy", axis_name)
