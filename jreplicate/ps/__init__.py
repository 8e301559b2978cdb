"""Parameter-server core shared by the carriers of :class:`jreplicate.ParameterServerStrategy`.

* :mod:`jreplicate.ps.placement`: which shard holds which parameter leaf.
* :mod:`jreplicate.ps.shard`: one shard as a threaded shell (lock, update, tokens) over
  :mod:`jreplicate.ps.shard_update` (its jitted optax update).
* :mod:`jreplicate.ps.fate`: the fate of every push, pure: shard 0's decisions, each
  shard's ledger, the driver's record of the steps that ended, reconciliation after a
  lost worker or shard, and the pushes a restarted shard lost.
* :mod:`jreplicate.ps.client`: a worker's pull and push over all shards.
* :mod:`jreplicate.ps.capture`: :func:`jreplicate.ps.pushable`, how a step's optimizer
  update becomes a push.
* :mod:`jreplicate.ps.worker`: a worker running scheduled steps on its devices.
* :mod:`jreplicate.ps.coordinator`: TF2 ``ClusterCoordinator`` scheduling and faults,
  composed of :mod:`jreplicate.ps.closure_queue` (the queued and running steps, TF's
  ``_CoordinatedClosureQueue``) and :mod:`jreplicate.ps.admission` (the bounded-staleness
  gate, the token-starvation detector, the statistics) and
  :mod:`jreplicate.ps.fate.record` (what became of the pushes of the steps that ended).
* :mod:`jreplicate.ps.per_worker`: values built once on each worker (TF's
  ``PerWorkerValues``).
* :mod:`jreplicate.ps.remote`: :class:`jreplicate.ps.RemoteValue` and the errors.
* :mod:`jreplicate.ps.executor`: the strategy's executor (registration, scheduling).
* :mod:`jreplicate.ps.embedded`: shards and workers as objects and threads of this
  process (the default carrier).
* :mod:`jreplicate.ps.ray.carrier`: shards and workers as Ray actors.
"""

from jreplicate.ps.capture import pushable
from jreplicate.ps.per_worker import PerWorkerValue, WorkerContext
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    ShardUpdateError,
    StepCancelledError,
    WorkerLostError,
)

__all__ = [
    "ParameterServerError",
    "PerWorkerValue",
    "RemoteValue",
    "ShardUpdateError",
    "StepCancelledError",
    "WorkerContext",
    "WorkerLostError",
    "pushable",
]
