"""The frozen configuration the PS core is built from.

:class:`jreplicate.ParameterServerStrategy` validates its arguments and lays out the
devices, then hands the executor a :class:`PSConfig`; the executor, carriers and input
iterators read only this, never the strategy (so ``jreplicate.ps`` does not import
``jreplicate.strategies``).
"""

from __future__ import annotations

import dataclasses

from jreplicate.layout import Layout


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """What the shards, workers and coordinator need to know.

    Attributes:
      num_ps: parameter-server shards.
      shard_devices: one device per shard.
      worker_devices: per worker (sync group), its devices.
      num_replicas_in_sync: devices per worker.
      layout: the :class:`jreplicate.layout.Layout` of the workers' replicas.
      carrier: ``"embedded"`` or ``"ray"``.
      max_staleness: the bounded delay tau, or None.
      max_clock_lead: stale-synchronous parallel's clock lead s, or None.
      max_attempts: tries of a step before its error is raised.
      token_timeout: seconds a worker waits for a token (token-gated).
      skip_stale_tokens: whether a worker skips tokens older than its last step.
      placement_policy: how leaves are placed on shards (``jreplicate.ps.placement``).
      min_slice_bytes: the smallest slice when a leaf is split over shards.
      ray_worker_options: ``carrier="ray"``: each worker actor's checked Ray options
        (:mod:`jreplicate.ps.ray.options`); empty dicts: the defaults.
      ray_shard_options: ``carrier="ray"``: each shard actor's.
      max_worker_restarts: ``carrier="embedded"``: times each lost worker is replaced
        by a new one with its index (-1: every time, as Ray's ``max_restarts``; 0:
        never).

    With ``carrier="ray"`` the devices are the actors' own: ``shard_devices`` is empty
    and each of ``worker_devices`` is an empty group (a worker actor finds its
    ``num_replicas_in_sync`` devices itself).
    """

    num_ps: int
    shard_devices: tuple
    worker_devices: tuple
    num_replicas_in_sync: int
    layout: Layout
    carrier: str
    max_staleness: int | None
    max_attempts: int
    token_timeout: float
    skip_stale_tokens: bool
    placement_policy: str
    min_slice_bytes: int
    ray_worker_options: tuple = ()
    ray_shard_options: tuple = ()
    max_clock_lead: int | None = None
    max_worker_restarts: int = -1

    @property
    def num_workers(self) -> int:
        """Workers (sync groups)."""
        return len(self.worker_devices)

    @property
    def num_replicas(self) -> int:
        """Replicas over all workers."""
        return self.layout.num_replicas
