"""Strategies: how replicas are laid out over devices and processes."""

from jreplicate.strategies.base import REPLICA_AXIS, Strategy
from jreplicate.strategies.mirrored import MirroredStrategy

__all__ = ["REPLICA_AXIS", "MirroredStrategy", "Strategy"]
