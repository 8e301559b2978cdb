"""Token-gated gradient aggregation: TensorFlow's ``SyncReplicasOptimizer`` as optax.

:func:`sync_replicas` wraps any optax transformation. Gradients are accumulated until
``replicas_to_aggregate`` fresh ones of the current step arrived, then averaged and
applied once; stale gradients (computed at an old ``local_step``) and the slowest
gradients of each step (backup replicas) are dropped and counted.

Where things live: ``transform.py`` holds :func:`sync_replicas` itself (its options
checked into a frozen config, ``init`` and the choice of driver); ``aggregate.py`` the two
drivers and the counting of accepted and dropped gradients, as pure functions (private);
``state.py`` its state (:class:`SyncReplicasState`), the token queue and
:func:`averaged_params`; ``spmd.py`` each replica's own gradient inside ``shard_map`` (the
SPMD driver); ``checks.py`` the argument checks (private). This ``__init__`` only
re-exports.

Public names (also at the top level, ``jr.sync_replicas`` etc.):

* :func:`sync_replicas` -- the transformation; its state is :class:`SyncReplicasState`.
* :func:`take_token`, :func:`tokens_available`, :class:`TokenQueue` -- the token queue
  replicas of the host driver take their next ``local_step`` from.
* :func:`averaged_params` -- params with their moving averages (``variable_averages``).
* :func:`replica_value_and_grad`, :func:`replica_grad` -- each replica's OWN gradient
  inside ``shard_map``, which is what the SPMD driver needs.
"""

from jreplicate.sync.spmd import replica_grad, replica_value_and_grad
from jreplicate.sync.state import (
    SyncReplicasState,
    TokenQueue,
    averaged_params,
    take_token,
    tokens_available,
)
from jreplicate.sync.transform import sync_replicas

__all__ = [
    "SyncReplicasState",
    "TokenQueue",
    "averaged_params",
    "replica_grad",
    "replica_value_and_grad",
    "sync_replicas",
    "take_token",
    "tokens_available",
]
