"""MirroredStrategy: synchronous data parallelism over this process's devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import jax
import numpy as np

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


def _resolve_devices(devices: Sequence[jax.Device | int] | None) -> list[jax.Device]:
    local = jax.local_devices()
    if devices is None:
        return list(local)
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            "MirroredStrategy(devices=...) takes a sequence of jax.Device objects or local "
            f"device ids, got {type(devices).__name__}. Example: "
            "MirroredStrategy(devices=jax.local_devices()[:4])."
        )
    if len(devices) == 0:
        raise ValueError(
            "MirroredStrategy(devices=[]) has no devices to replicate on. Pass at least one "
            "device, or devices=None to use all local devices "
            f"({len(local)} available)."
        )
    by_id = {d.id: d for d in local}
    resolved = []
    for i, d in enumerate(devices):
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if int(d) not in by_id:
                raise ValueError(
                    f"MirroredStrategy(devices=...)[{i}] = {d} is not the id of a local device; "
                    f"local device ids are {sorted(by_id)}."
                )
            d = by_id[int(d)]
        elif not isinstance(d, jax.Device):
            raise TypeError(
                f"MirroredStrategy(devices=...)[{i}] is a {type(d).__name__}; expected a "
                "jax.Device (from jax.local_devices()) or a local device id."
            )
        elif d.process_index != jax.process_index():
            raise ValueError(
                f"MirroredStrategy(devices=...)[{i}] = {d} belongs to process "
                f"{d.process_index}, not this one ({jax.process_index()}). MirroredStrategy "
                "uses local devices only; use MultiWorkerStrategy across processes."
            )
        resolved.append(d)
    seen: dict[jax.Device, int] = {}
    for i, d in enumerate(resolved):
        if d in seen:
            raise ValueError(
                f"MirroredStrategy(devices=...) lists {d} twice (at positions {seen[d]} and "
                f"{i}); each replica needs its own device. Remove the duplicate."
            )
        seen[d] = i
    return resolved


@final
class MirroredStrategy(Strategy):
    """Synchronous replication over some or all of this process's devices.

    Every replica holds a full copy of the replicated state; one compiled program
    (``jax.jit`` over ``jax.shard_map``, manual over the replica mesh axis, named
    ``axis_name``) runs on an ``(axis_name, "model")`` mesh and gradients of replicated
    state are
    all-reduced. With ``logical_devices_per_replica=M`` each replica spans M devices
    (the ``"model"`` axis, automatic inside the step): state created in
    :meth:`jreplicate.Replicator.scope` with a ``PartitionSpec`` on ``"model"`` is
    split over them (tensor parallelism).

    Args:
      devices: the devices to use, in replica order: ``jax.Device`` objects or local
        device ids. ``None`` (the default) uses all of ``jax.local_devices()``. Replica
        ``r`` spans ``devices[r * M:(r + 1) * M]``.
      logical_devices_per_replica: M, the devices of one replica (default 1).
      axis_name: the name of the replica mesh axis (default ``jr.REPLICA_AXIS``,
        ``"replica"``): ``ctx.axis_name`` in the step, the axis of its collectives. Name
        it as the ``jax.pmap`` program you port does (``axis_name="batch"``) and its
        ``jax.lax.pmean(x, "batch")`` and ``nnx.BatchNorm(..., axis_name="batch")`` work
        unchanged. Any non-empty str but ``jr.MODEL_AXIS`` (``"model"``).
      weight_update_sharding: ``None`` (the default: state replicated on every
        replica), ``"optimizer"`` (state only the weight update reads, such as optimizer
        moments, is stored sharded over the replicas and gradients are reduce-scattered:
        ZeRO-1/2, XLA's weight-update sharding) or ``"parameters"`` (the parameters too,
        gathered where the step reads them: ZeRO-3/FSDP). Keyword-only. New state comes
        back as global ``jax.Array`` s sharded over the replica axis.
      min_weight_shard_size: leaves with fewer elements stay replicated (default 1024;
        0 shards every leaf that can be). Leaves with no dimension divisible by the
        number of replicas also stay replicated (never padded).

    Raises:
      TypeError or ValueError: bad ``devices``, ``logical_devices_per_replica`` or
        ``axis_name`` (the message names the argument and the fix).

    Example:
      >>> import jax, jreplicate as jr
      >>> strategy = jr.MirroredStrategy(devices=jax.local_devices()[:2])
      >>> strategy.num_replicas
      2
      >>> jr.MirroredStrategy(logical_devices_per_replica=2).mesh.shape
      OrderedDict({'replica': 4, 'model': 2})
      >>> jr.MirroredStrategy(axis_name="batch").mesh.shape  # a pmap program's name
      OrderedDict({'batch': 8, 'model': 1})
    """

    def __init__(self, devices: Sequence[jax.Device | int] | None = None, *,
                 logical_devices_per_replica: int = 1, axis_name: str = REPLICA_AXIS,
                 weight_update_sharding: str | None = None,
                 min_weight_shard_size: int = 1024):
        m = check_logical_devices_per_replica(logical_devices_per_replica, "MirroredStrategy")
        wus = check_weight_update_sharding(weight_update_sharding, min_weight_shard_size,
                                           "MirroredStrategy")
        axis = check_axis_name(axis_name, "MirroredStrategy")
        devs = _resolve_devices(devices)
        self._layout = mesh_layout(replica_mesh(devs, m, "MirroredStrategy", axis),
                                   weight_update_sharding=wus[0],
                                   min_weight_shard_size=wus[1])

    @property
    def layout(self) -> Layout:
        return self._layout

    def make_executor(self) -> SPMDExecutor:
        return SPMDExecutor(self._layout)
