"""Which local devices hold the PS shards and which each worker's sync group uses.

The policy (embedded carrier, one process):

- shards and workers on distinct devices when ``num_ps + num_workers * g`` fit (``g`` =
  ``num_replicas_in_sync``): the first ``num_ps`` devices hold the shards, the next
  ``num_workers * g`` the workers, group by group;
- devices left over are idle; when ``num_workers`` was left to its default, that is
  announced with a warning naming how to use them or choose them (``devices=...``);
- when the workers fit but the shards do not, the workers take the last
  ``num_workers * g`` devices and shard ``i`` sits on device ``i`` (beside a worker's
  step), announced with a warning;
- worker groups never share a device: ``num_workers * g`` beyond the devices is an
  error naming the largest ``num_workers`` that fits.

With ``carrier="ray"`` shards and workers are actors with devices of their own (see
:mod:`jreplicate.ps.ray.options`): the driver's devices play no part, the layout has no
shard devices and one empty group per worker.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple


class DeviceLayout(NamedTuple):
    """Shard ``i`` lives on ``shard_devices[i]``; worker ``w`` runs on
    ``worker_devices[w]`` (its sync group, one device per replica)."""

    shard_devices: tuple[Any, ...]
    worker_devices: tuple[tuple[Any, ...], ...]


def _cpu_hint(n: int, devs: Sequence[Any]) -> str:
    if devs and getattr(devs[0], "platform", "") == "cpu":
        return f" (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})"
    return ""


def assign_devices(devs: Sequence[Any], num_ps: int, num_workers: int | None, g: int,
                   carrier: str = "embedded") -> DeviceLayout:
    """Lays out ``num_ps`` shards and ``num_workers`` groups of ``g`` devices on ``devs``.

    Args:
      devs: the local devices to use (distinct).
      num_ps: parameter-server shards.
      num_workers: workers (sync groups); None: as many as fit beside the shards
        (at least one).
      g: devices per worker (``num_replicas_in_sync``).
      carrier: ``"embedded"`` (checked as above) or ``"ray"`` (``num_workers`` empty
        groups: the actors' devices are their own).

    Returns:
      The :class:`DeviceLayout`.

    Raises:
      ValueError: a device listed twice, or worker groups that would share devices.
    """
    n = len(devs)
    if len(set(devs)) < n:
        raise ValueError(f"ParameterServerStrategy(devices=...) lists a device twice: "
                         f"{list(devs)}; pass each device once.")
    defaulted = num_workers is None
    nw = max((n - num_ps) // g, 1) if defaulted else int(num_workers)
    need = nw * g
    if carrier == "ray":
        return DeviceLayout((), tuple(() for _ in range(nw)))
    if need > n:
        fit = (n - num_ps) // g or n // g
        raise ValueError(
            f"ParameterServerStrategy(num_workers={nw}, num_replicas_in_sync={g}): the "
            f"workers need {nw} x {g} = {need} devices (num_ps + num_workers * "
            f"num_replicas_in_sync = {num_ps + need}) but {n} devices are given, so worker "
            f"groups would share devices. Use num_workers={fit}, a smaller "
            f"num_replicas_in_sync, or pass more devices{_cpu_hint(num_ps + need, devs)}.")
    if num_ps + need <= n:
        idle = n - num_ps - need
        if idle and defaulted:
            warnings.warn(
                f"ParameterServerStrategy(num_ps={num_ps}, num_replicas_in_sync={g}): "
                f"{idle} of the {n} devices are left idle (num_ps + num_workers * "
                f"num_replicas_in_sync = {num_ps} + {nw} x {g} = {num_ps + need}); use "
                f"num_ps={num_ps + idle} or a num_replicas_in_sync dividing {n - num_ps} "
                f"to use them, or devices=... (the {num_ps + need} to use) to choose them.",
                stacklevel=3)
        return DeviceLayout(tuple(devs[:num_ps]), tuple(
            tuple(devs[num_ps + w * g + j] for j in range(g)) for w in range(nw)))
    pool = devs[n - need:]
    shared = sorted({i for i in range(num_ps) if devs[i % n] in pool})
    fit = (n - num_ps) // g
    warnings.warn(
        f"ParameterServerStrategy: num_ps + num_workers * num_replicas_in_sync = {num_ps} "
        f"+ {nw} x {g} = {num_ps + need} exceeds the {n} devices; shard(s) {shared} share "
        f"devices with workers (their updates run beside the workers' steps). For devices "
        f"of their own {f'use num_workers={fit} or ' if fit else ''}pass more devices"
        f"{_cpu_hint(num_ps + need, devs)}.", stacklevel=3)
    return DeviceLayout(tuple(devs[i % n] for i in range(num_ps)), tuple(
        tuple(pool[w * g + j] for j in range(g)) for w in range(nw)))
