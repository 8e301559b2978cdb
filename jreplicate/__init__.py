"""jreplicate: replicate a JAX step function across devices, hosts and clusters."""

from jreplicate.checkpoint import CheckpointError, CheckpointManager
from jreplicate.cluster import ClusterError, ClusterSpec, Timeouts
from jreplicate.context import PerReplica, ReplicaContext
from jreplicate.input import InputContext, InputIterator, InputReplicationMode
from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS, Layout
from jreplicate.losses import compute_average_loss
from jreplicate.ps.capture import pushable
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    StepCancelledError,
    WorkerLostError,
)
from jreplicate.replicator import Replicator
from jreplicate.strategies import (
    MirroredStrategy,
    MultiWorkerStrategy,
    ParameterServerStrategy,
    Strategy,
    TPUStrategy,
)
from jreplicate.sync import (
    SyncReplicasState,
    TokenQueue,
    averaged_params,
    replica_grad,
    replica_value_and_grad,
    sync_replicas,
    take_token,
    tokens_available,
)

__version__ = "0.1.0"

__all__ = [
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "CheckpointError",
    "CheckpointManager",
    "ClusterError",
    "ClusterSpec",
    "InputContext",
    "InputIterator",
    "InputReplicationMode",
    "Layout",
    "MirroredStrategy",
    "MultiWorkerStrategy",
    "ParameterServerError",
    "ParameterServerStrategy",
    "PerReplica",
    "RemoteValue",
    "ReplicaContext",
    "Replicator",
    "StepCancelledError",
    "Strategy",
    "SyncReplicasState",
    "TPUStrategy",
    "Timeouts",
    "TokenQueue",
    "WorkerLostError",
    "averaged_params",
    "compute_average_loss",
    "pushable",
    "replica_grad",
    "replica_value_and_grad",
    "sync_replicas",
    "take_token",
    "tokens_available",
]
