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
* :mod:`jreplicate.ps.closure`: a scheduled step (``Closure``) and its cancel flag.
* :mod:`jreplicate.ps.worker`: a worker running scheduled steps on its devices.
* :mod:`jreplicate.ps.outcome`: what became of a step's run, as a value.
* :mod:`jreplicate.ps.coordinator`: TF2 ``ClusterCoordinator`` scheduling and faults
  over one carrier (``jreplicate.ps.handle.StepCarrier``), composed of
  :mod:`jreplicate.ps.scheduler` (the pure, thread-free scheduling core: queued and
  running steps, admission, starvation; ``bench/ps_scale_sim.py`` drives it in virtual
  time), :mod:`jreplicate.ps.closure_queue` (its lock and waits, TF's
  ``_CoordinatedClosureQueue``), :mod:`jreplicate.ps.admission` (the bounded-staleness
  gates, the token-starvation detector, the statistics),
  :mod:`jreplicate.ps.step_ends` (how each outcome ends a step),
  :mod:`jreplicate.ps.input_sweeps` (the per-worker inputs' ends) and
  :mod:`jreplicate.ps.fate.record` (what became of the pushes of the steps that ended;
  the fate of a push in all: :mod:`jreplicate.ps.fate`).
* :mod:`jreplicate.ps.per_worker`: values built once on each worker (TF's
  ``PerWorkerValues``), and per-worker state a step updates (TF's per-worker
  variables).
* :mod:`jreplicate.ps.remote`: :class:`jreplicate.ps.RemoteValue` and the errors.
* :mod:`jreplicate.ps.executor`: the strategy's executor (registration, scheduling).
* :mod:`jreplicate.ps.embedded`: shards and workers as objects and threads of this
  process (the default carrier).
* :mod:`jreplicate.ps.ray.carrier`: shards and workers as Ray actors.
"""

from jreplicate.ps.capture import pushable
from jreplicate.ps.per_worker import (
    PerWorkerState,
    PerWorkerValue,
    WorkerContext,
    WorkerStateUpdate,
    update_worker_state,
)
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    ShardUpdateError,
    StepCancelledError,
    StepOutputsLostError,
    WorkerLostError,
)

__all__ = [
    "ParameterServerError",
    "PerWorkerState",
    "PerWorkerValue",
    "RemoteValue",
    "ShardUpdateError",
    "StepCancelledError",
    "StepOutputsLostError",
    "WorkerContext",
    "WorkerLostError",
    "WorkerStateUpdate",
    "pushable",
    "update_worker_state",
]
