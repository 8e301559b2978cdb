"""jreplicate: replicate a JAX step function across devices, hosts and clusters."""

from jreplicate.context import PerReplica, ReplicaContext
from jreplicate.input import InputContext, InputIterator, InputReplicationMode
from jreplicate.losses import compute_average_loss
from jreplicate.replicator import Replicator
from jreplicate.strategies import REPLICA_AXIS, MirroredStrategy, Strategy

__version__ = "0.1.0"

__all__ = [
    "REPLICA_AXIS",
    "InputContext",
    "InputIterator",
    "InputReplicationMode",
    "MirroredStrategy",
    "PerReplica",
    "ReplicaContext",
    "Replicator",
    "Strategy",
    "compute_average_loss",
]
