"""Layout: where a strategy's replicas live, computed once and frozen.

The frozen value a strategy hands down to what it builds: the executors
(:mod:`jreplicate.execution`) and the parameter-server core (:mod:`jreplicate.ps`)
receive a :class:`Layout`, never the strategy. It sits below all three layers and
imports none of them (``tests/test_import_graph.py`` checks it). Also here: the mesh
axis names and the helpers that build a replica mesh and check its factors.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: The default name of the mesh axis enumerating replicas; collectives of
#: :class:`ReplicaContext` run over it. A strategy's ``axis_name=`` chooses another (e.g.
#: ``"batch"``, the name a ``jax.pmap`` program passes to its collectives).
REPLICA_AXIS = "replica"
#: The mesh axis enumerating the logical devices of one replica (size 1 by default).
MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The facts of a strategy's placement, computed once when the strategy is built.

    Attributes:
      mesh: the ``(replica_axis, MODEL_AXIS)`` device mesh (its model axis has size 1
        unless a replica spans several logical devices). ``None`` for a strategy whose
        replicas do not form one SPMD mesh.
      replica_axis: the mesh axis enumerating replicas (the step is manual over it): the
        strategy's ``axis_name``, ``REPLICA_AXIS`` (``"replica"``) unless chosen.
      model_axes: the mesh axes inside a replica (automatic in the step).
      replica_devices: the devices of each replica, by replica id, in logical device
        order (logical device ``i`` of replica ``r`` is ``replica_devices[r][i]``).
      num_replicas_in_sync: replicas whose gradients are aggregated synchronously.
      local_replica_ids: the replicas whose devices this process addresses.
      num_processes: processes taking part (the SPMD strategies' workers; a
        parameter server's driver is one process, its workers are not counted here).
      process_index: this process's index among them, in process-index order.
      weight_update_sharding: ``None`` (state replicated on every replica),
        ``"optimizer"`` (state only the weight update reads is stored sharded over the
        replicas: ZeRO-1/2) or ``"parameters"`` (every carried state leaf: ZeRO-3/FSDP).
      min_weight_shard_size: leaves with fewer elements stay replicated.

    Example (two replicas of two logical devices each, on 4 of the 8 devices):
      >>> import jax, jreplicate as jr
      >>> s = jr.MirroredStrategy(devices=jax.devices()[:4], logical_devices_per_replica=2)
      >>> layout = s.layout
      >>> layout.num_replicas, layout.logical_devices_per_replica, layout.local_replica_ids
      (2, 2, (0, 1))
      >>> [[d.id for d in r] for r in layout.replica_devices]
      [[0, 1], [2, 3]]
      >>> layout.per_replica.spec  # values stacked over replicas on their leading axis
      P('replica',)
    """

    mesh: Mesh | None
    replica_axis: str
    model_axes: tuple[str, ...]
    replica_devices: tuple[tuple[jax.Device, ...], ...]
    num_replicas_in_sync: int
    local_replica_ids: tuple[int, ...]
    num_processes: int
    process_index: int
    weight_update_sharding: str | None = None
    min_weight_shard_size: int = 1024

    @property
    def num_replicas(self) -> int:
        return len(self.replica_devices)

    @property
    def logical_devices_per_replica(self) -> int:
        return len(self.replica_devices[0])

    @property
    def first_devices(self) -> tuple[jax.Device, ...]:
        """The first device (logical device 0) of each replica, by replica id (one device
        per replica; all of them when a replica spans one device)."""
        return tuple(d[0] for d in self.replica_devices)

    @functools.cached_property
    def replicated(self) -> NamedSharding:
        """The sharding of a value held whole by every device of the mesh."""
        return NamedSharding(self.mesh, P())

    @functools.cached_property
    def per_replica(self) -> NamedSharding:
        """The sharding of a value stacked over replicas on its leading axis."""
        return NamedSharding(self.mesh, P(self.replica_axis))


def mesh_layout(mesh: Mesh, *, num_replicas_in_sync: int | None = None,
                weight_update_sharding: str | None = None,
                min_weight_shard_size: int = 1024) -> Layout:
    """The layout of an SPMD mesh of shape ``(replicas, logical devices per replica)``."""
    grid = np.asarray(mesh.devices)
    replica_devices = tuple(tuple(row) for row in grid.reshape(grid.shape[0], -1))
    for r, row in enumerate(replica_devices):
        if len({d.process_index for d in row}) > 1:
            raise ValueError(
                f"replica {r} would span devices of processes "
                f"{sorted({d.process_index for d in row})}; a replica's logical devices must "
                "belong to one process. Choose logical_devices_per_replica dividing the "
                "number of devices per process."
            )
    me = jax.process_index()
    procs = sorted({d.process_index for row in replica_devices for d in row})
    local = tuple(r for r, row in enumerate(replica_devices) if row[0].process_index == me)
    return Layout(
        mesh=mesh, replica_axis=mesh.axis_names[0], model_axes=tuple(mesh.axis_names[1:]),
        replica_devices=replica_devices,
        num_replicas_in_sync=num_replicas_in_sync or len(replica_devices),
        local_replica_ids=local, num_processes=len(procs),
        process_index=procs.index(me) if me in procs else 0,
        weight_update_sharding=weight_update_sharding,
        min_weight_shard_size=min_weight_shard_size)


def check_logical_devices_per_replica(value: object, where: str) -> int:
    """Validates ``logical_devices_per_replica=`` (an int >= 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"{where}(logical_devices_per_replica={value!r}) must be an int >= 1: the number "
            "of devices one replica spans (1 for pure data parallelism)."
        )
    return int(value)


#: The levels of ``weight_update_sharding=`` (besides None), with what each shards.
WEIGHT_UPDATE_SHARDING = {
    "optimizer": "keeps the state only the weight update reads (optimizer state) sharded "
                 "over the replicas (ZeRO-1, gradients reduce-scattered: ZeRO-2)",
    "parameters": "also keeps the parameters sharded, gathered where the step reads them "
                  "(ZeRO-3 / FSDP)",
}


def check_weight_update_sharding(value: object, min_size: object,
                                 where: str) -> tuple[str | None, int]:
    """Validates ``weight_update_sharding=`` and ``min_weight_shard_size=``.

    Returns:
      ``(level, min_size)``: the level (None, ``"optimizer"`` or ``"parameters"``) and
      the size in elements below which a leaf stays replicated.

    Raises:
      TypeError: ``value`` is not None or a str, or ``min_size`` not an int.
      ValueError: ``value`` is another str, or ``min_size`` is negative.
    """
    choices = "; ".join(f"{k!r} {v}" for k, v in WEIGHT_UPDATE_SHARDING.items())
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"{where}(weight_update_sharding={value!r}) must be None (the default: state "
            f"replicated on every replica) or one of the str choices: {choices}."
        )
    if value is not None and value not in WEIGHT_UPDATE_SHARDING:
        raise ValueError(
            f"{where}(weight_update_sharding={value!r}) is not a choice. Choose None (the "
            f"default: state replicated on every replica), or {choices}."
        )
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)):
        raise TypeError(
            f"{where}(min_weight_shard_size={min_size!r}) must be an int >= 0: the number "
            "of elements below which a state leaf stays replicated (default 1024; 0 shards "
            "every leaf that can be sharded)."
        )
    if min_size < 0:
        raise ValueError(
            f"{where}(min_weight_shard_size={min_size!r}) must be >= 0: the number of "
            "elements below which a state leaf stays replicated (default 1024; 0 shards "
            "every leaf that can be sharded)."
        )
    return value, int(min_size)


def weight_shard_dim(shape: Sequence[int], spec: P | None, n: int,
                     min_size: int) -> int | None:
    """The dimension of a state leaf of ``shape`` that weight-update sharding splits over
    ``n`` replicas, or None when the leaf stays replicated.

    The largest dimension that the leaf's own ``spec`` leaves unsharded and that ``n``
    divides (ties: the first). None for a scalar, a zero-size leaf, a leaf of fewer than
    ``min_size`` elements, or when no dimension qualifies (leaves are never padded).

    Example:
      >>> weight_shard_dim((16, 32), None, 8, 0), weight_shard_dim((6,), None, 8, 0)
      (1, None)
      >>> weight_shard_dim((32, 16), P(None, "model"), 8, 0)
      0
    """
    size = int(np.prod(shape)) if len(shape) else 1
    if not shape or size == 0 or size < min_size:
        return None
    entries = tuple(spec) if spec is not None else ()
    best = None
    for d, extent in enumerate(shape):
        taken = d < len(entries) and entries[d] is not None
        if not taken and extent % n == 0 and (best is None or extent > shape[best]):
            best = d
    return best


def weight_shard_spec(spec: P | None, dim: int, axis: str) -> P:
    """``spec`` (the leaf's own, or None) with ``axis`` on dimension ``dim``."""
    entries = list(spec) if spec is not None else []
    entries += [None] * (dim + 1 - len(entries))
    entries[dim] = axis
    return P(*entries)


#: Characters XLA's compiler mangles in a mesh axis name (found by
#: tests/test_axis_name.py's property test; a name ending in a backslash aborts).
_UNCOMPILABLE = frozenset("\\'")


def check_axis_name(value: object, where: str) -> str:
    """Validates a strategy's ``axis_name=`` (a non-empty str other than the model axis,
    without the characters XLA cannot compile in a mesh axis name).

    Raises:
      TypeError: ``value`` is not a str.
      ValueError: ``value`` is empty, is :data:`MODEL_AXIS`, or holds a backslash or a
        single quote.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{where}(axis_name={value!r}) must be a str: the name of the replica mesh "
            "axis, which the step's collectives use (e.g. axis_name='batch', the name a "
            "jax.pmap program passes to jax.lax.pmean and nnx.BatchNorm(axis_name=...)). "
            f"Default: jr.REPLICA_AXIS ({REPLICA_AXIS!r})."
        )
    if not value:
        raise ValueError(
            f"{where}(axis_name='') must be a non-empty str naming the replica mesh axis, "
            f"e.g. axis_name='batch'; leave it out for jr.REPLICA_AXIS ({REPLICA_AXIS!r})."
        )
    if value == MODEL_AXIS:
        raise ValueError(
            f"{where}(axis_name={value!r}) clashes with the model axis: jr.MODEL_AXIS "
            f"({MODEL_AXIS!r}) names the logical devices inside a replica on the same mesh. "
            f"Choose another name for the replica axis, e.g. axis_name='batch', or leave it "
            f"out for jr.REPLICA_AXIS ({REPLICA_AXIS!r})."
        )
    bad = sorted({c for c in value if c in _UNCOMPILABLE})
    if bad:
        raise ValueError(
            f"{where}(axis_name={value!r}) contains {' and '.join(map(repr, bad))}, which "
            "XLA cannot carry in a mesh axis name (jax 0.12: the step fails to compile, "
            "or the process aborts). Use a name without backslashes and single quotes, "
            "e.g. axis_name='batch'."
        )
    return value


def check_factors(n: int, m: int, where: str, what: str, note: str = "") -> None:
    """Raises when ``n`` devices (``what``) do not split into replicas of ``m``."""
    if n % m:
        fits = [k for k in range(1, n + 1) if n % k == 0]
        raise ValueError(
            f"{where}: {n} {what} do not factor into replicas of "
            f"logical_devices_per_replica={m} devices each{note}. Use a divisor of {n} "
            f"({', '.join(map(str, fits))}), or pass devices=... with a multiple of {m} "
            "devices."
        )


def replica_mesh(devices: Sequence[jax.Device], logical_devices_per_replica: int,
                 where: str, axis_name: str = REPLICA_AXIS) -> Mesh:
    """A ``(axis_name, MODEL_AXIS)`` mesh over ``devices`` in replica order: replica
    ``r`` spans ``devices[r * m:(r + 1) * m]``.

    Raises:
      ValueError: the devices do not factor into replicas x logical devices, or a
        replica would span several processes.
    """
    m = logical_devices_per_replica
    n = len(devices)
    check_factors(n, m, where, "devices")
    grid = np.array(list(devices), dtype=object).reshape(n // m, m)
    return Mesh(grid, (axis_name, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
