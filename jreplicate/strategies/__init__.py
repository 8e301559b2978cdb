"""Strategies: how replicas are laid out over devices and processes."""

from jreplicate.cluster import ClusterError, ClusterSpec, Timeouts
from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS, Layout
from jreplicate.strategies.base import Strategy
from jreplicate.strategies.mirrored import MirroredStrategy
from jreplicate.strategies.multi_worker import MultiWorkerStrategy
from jreplicate.strategies.parameter_server import ParameterServerStrategy
from jreplicate.strategies.tpu import TPUStrategy

__all__ = [
    "MODEL_AXIS",
    "REPLICA_AXIS",
    "ClusterError",
    "ClusterSpec",
    "Layout",
    "MirroredStrategy",
    "MultiWorkerStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "TPUStrategy",
    "Timeouts",
]
