"""jreplicate: replicate a JAX step function across devices, hosts and clusters.

The top level holds what a researcher types daily: :class:`Replicator`, the four
strategies, :class:`ReplicaContext` and :class:`PerReplica`, the input API,
:func:`compute_average_loss`, :func:`scale_regularization_loss`,
:func:`same_on_every_replica`, :func:`sync_replicas`, :class:`CheckpointManager`, the
mesh axis names, :func:`one_replica` and :class:`ReplicationHabitWarning` (the pmap
habits ``run`` warns about). The rest lives in namespaces, as ``tf.distribute`` tiers its
``cluster_resolver`` and ``coordinator``:

* ``jr.ps``: parameter-server training (:func:`jreplicate.ps.pushable`,
  :class:`jreplicate.ps.RemoteValue` and its errors);
* ``jr.cluster``: the multi-process runtime (:class:`jreplicate.cluster.ClusterSpec`,
  :class:`jreplicate.cluster.Timeouts`, :class:`jreplicate.cluster.ClusterError`);
* ``jr.sync``: token-gated aggregation's state and helpers (``take_token``,
  ``averaged_params``, ``replica_grad``, ...);
* ``jr.strategies``: the :class:`jreplicate.strategies.Strategy` protocol and the
  :class:`jreplicate.strategies.Layout` a strategy computes;
* ``jr.checkpoint``, ``jr.input``, ``jr.execution``: each layer's own names;
  ``jreplicate.testing``: fault injection for tests.

Example:
  >>> import jax.numpy as jnp, jreplicate as jr
  >>> rep = jr.Replicator(jr.MirroredStrategy())
  >>> total = rep.run(lambda ctx, x: ctx.all_sum(x * ctx.replica_id), None, jnp.ones(2))
  >>> total.tolist()  # 1 * (0 + 1 + ... + 7), on every replica
  [28.0, 28.0]
"""

# First: an unsupported JAX is refused with the fix before anything else uses it.
from jreplicate import _jax_compat  # noqa: F401, I001
from jreplicate import checkpoint, cluster, execution, input, ps, strategies, sync
from jreplicate.checkpoint import CheckpointManager
from jreplicate.context import PerReplica, ReplicaContext
from jreplicate.execution.habits import ReplicationHabitWarning
from jreplicate.execution.nnx_rngs import same_on_every_replica
from jreplicate.input import InputContext, InputIterator, InputReplicationMode
from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS
from jreplicate.losses import compute_average_loss, scale_regularization_loss
from jreplicate.one_replica import one_replica
from jreplicate.replicator import Replicator
from jreplicate.strategies import (
    MirroredStrategy,
    MultiWorkerStrategy,
    ParameterServerStrategy,
    TPUStrategy,
)
from jreplicate.sync import sync_replicas

__version__ = "0.1.0"

__all__ = [
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "CheckpointManager",
    "InputContext",
    "InputIterator",
    "InputReplicationMode",
    "MirroredStrategy",
    "MultiWorkerStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReplicaContext",
    "ReplicationHabitWarning",
    "Replicator",
    "TPUStrategy",
    "checkpoint",
    "cluster",
    "compute_average_loss",
    "execution",
    "input",
    "one_replica",
    "ps",
    "same_on_every_replica",
    "scale_regularization_loss",
    "strategies",
    "sync",
    "sync_replicas",
]
