"""Strategies: how replicas are laid out over devices and processes."""

from jreplicate.strategies.base import REPLICA_AXIS, Strategy
from jreplicate.strategies.cluster import ClusterError, ClusterSpec, Timeouts
from jreplicate.strategies.mirrored import MirroredStrategy
from jreplicate.strategies.multi_worker import MultiWorkerStrategy

__all__ = [
    "REPLICA_AXIS",
    "ClusterError",
    "ClusterSpec",
    "MirroredStrategy",
    "MultiWorkerStrategy",
    "Strategy",
    "Timeouts",
]
