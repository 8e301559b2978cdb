"""TPUStrategy: synchronous replication over TPU devices, laid out for the interconnect."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import final

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jreplicate.cluster.agreement import Agreement
from jreplicate.cluster.spec import Timeouts
from jreplicate.execution.spmd import SPMDExecutor
from jreplicate.layout import (
    MODEL_AXIS,
    REPLICA_AXIS,
    Layout,
    check_axis_name,
    check_factors,
    check_logical_devices_per_replica,
    check_weight_update_sharding,
    mesh_layout,
)
from jreplicate.strategies.base import Strategy

_instances = itertools.count()
_AUTO = (AxisType.Auto, AxisType.Auto)


@final
class TPUStrategy(Strategy):
    """Synchronous replication over TPU devices, with the mesh ordered for the
    interconnect and, optionally, device loops and several logical devices per replica.

    The ``(axis_name, "model")`` mesh comes from ``jax.make_mesh`` (which orders devices
    along the ICI torus); on a multi-slice job (devices with several ``slice_index``
    values) from ``mesh_utils.create_hybrid_device_mesh``, with the slices (DCN) as the
    outermost part of the replica axis, so that a replica's logical devices share a
    slice and only the gradient all-reduce crosses DCN. Axis types are ``Auto``. Steps
    compile and run as with :class:`jreplicate.MirroredStrategy`.

    Mixed precision is the step's business: keep parameters and optimizer state in
    float32 and cast to bfloat16 for the forward pass (``examples/mixed_precision.py``);
    gradients of the float32 parameters come back float32.

    Args:
      devices: the TPU devices to use (default: all of ``jax.devices()``, which must be
        TPUs). Passing devices of another platform lays them out the same way, which is
        how tests run this strategy on CPU.
      logical_devices_per_replica: M, the devices one replica spans (the ``"model"``
        axis, default 1).
      steps_per_run: when set, :meth:`jreplicate.Replicator.run` with an input iterator
        runs this many steps per call as a device loop unless ``steps=`` is given (see
        ``Replicator.run``): the step must then return its arguments first. Default
        None: one step per call.
      axis_name: the name of the replica mesh axis (default ``jr.REPLICA_AXIS``,
        ``"replica"``); e.g. ``"batch"`` for a ``jax.pmap`` program's collectives and
        ``nnx.BatchNorm(axis_name="batch")``. See :class:`jreplicate.MirroredStrategy`.
      weight_update_sharding: ``None`` (the default), ``"optimizer"`` (ZeRO-1/2) or
        ``"parameters"`` (ZeRO-3/FSDP): which state is stored sharded over the replicas.
        See :class:`jreplicate.MirroredStrategy`.
      min_weight_shard_size: leaves with fewer elements stay replicated (default 1024).

    Raises:
      ValueError: no TPU devices and none passed, devices that do not factor into
        replicas x logical devices (per slice), or a bad ``steps_per_run`` or
        ``axis_name``.

    Example (on CPU, with devices passed)::

        >>> import jax, jreplicate as jr
        >>> s = jr.TPUStrategy(devices=jax.devices(), logical_devices_per_replica=2)
        >>> s.num_replicas, s.logical_devices_per_replica
        (4, 2)
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, *,
                 logical_devices_per_replica: int = 1, steps_per_run: int | None = None,
                 axis_name: str = REPLICA_AXIS, weight_update_sharding: str | None = None,
                 min_weight_shard_size: int = 1024):
        m = check_logical_devices_per_replica(logical_devices_per_replica, "TPUStrategy")
        wus = check_weight_update_sharding(weight_update_sharding, min_weight_shard_size,
                                           "TPUStrategy")
        axis = check_axis_name(axis_name, "TPUStrategy")
        if steps_per_run is not None and (
                isinstance(steps_per_run, bool) or not isinstance(steps_per_run, int)
                or steps_per_run < 1):
            raise ValueError(
                f"TPUStrategy(steps_per_run={steps_per_run!r}) must be an int >= 1 (steps "
                "per device loop), or None for one step per run call."
            )
        devs = _tpu_devices(devices)
        self._layout = mesh_layout(tpu_mesh(devs, m, axis), weight_update_sharding=wus[0],
                                   min_weight_shard_size=wus[1])
        self._steps_per_run = steps_per_run
        self._uid = next(_instances)
        self._agreements = itertools.count()

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def steps_per_run(self) -> int | None:
        return self._steps_per_run

    def make_executor(self) -> SPMDExecutor:
        return SPMDExecutor(self._layout)

    def agreement(self, name: str) -> Agreement | None:
        if self.num_processes == 1:
            return None
        prefix = f"jreplicate/tpu{self._uid}/{name}/{next(self._agreements)}"
        return Agreement(prefix, self.num_processes, self.process_index,
                                  Timeouts().collective_timeout)


def _tpu_devices(devices: Sequence[jax.Device] | None) -> list:
    if devices is None:
        found = jax.devices()
        if found[0].platform != "tpu":
            raise ValueError(
                f"TPUStrategy() found no TPU devices: jax.devices() are {len(found)} "
                f"{found[0].platform} device(s). On CPU or GPU use jr.MirroredStrategy() "
                "(or MultiWorkerStrategy across processes); to lay other devices out as "
                "TPUStrategy does (e.g. in tests), pass devices=jax.devices()."
            )
        return list(found)
    devices = list(devices)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(
            "TPUStrategy(devices=...) must be a non-empty list of jax.Device objects, e.g. "
            "jax.devices()."
        )
    if len(set(devices)) != len(devices):
        raise ValueError("TPUStrategy(devices=...) lists a device twice; each device once.")
    return devices


def tpu_mesh(devices: Sequence, logical_devices_per_replica: int,
             axis_name: str = REPLICA_AXIS) -> Mesh:
    """The ``(axis_name, MODEL_AXIS)`` mesh of ``devices``: ``jax.make_mesh`` order on one
    slice, ``create_hybrid_device_mesh`` with the slices outermost on several."""
    m, n = logical_devices_per_replica, len(devices)
    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    per_slice = n // len(slices)
    if n % len(slices) or any(
            sum(getattr(d, "slice_index", 0) == s for d in devices) != per_slice for s in slices):
        raise ValueError(f"TPUStrategy: the {len(slices)} slices hold different numbers of "
                         "the given devices; use the same number of devices on every slice.")
    check_factors(per_slice, m, "TPUStrategy", "devices per slice",
                  " (a replica stays on one slice)")
    if len(slices) > 1:
        grid = mesh_utils.create_hybrid_device_mesh(
            (per_slice // m, m), (len(slices), 1), devices=list(devices))
        return Mesh(np.asarray(grid), (axis_name, MODEL_AXIS), axis_types=_AUTO)
    return jax.make_mesh((n // m, m), (axis_name, MODEL_AXIS), axis_types=_AUTO,
                         devices=list(devices))
