"""The arguments of :class:`jreplicate.ParameterServerStrategy`, checked.

Each check names the argument, the value and the fix; they read only the arguments
(and the local devices), so they raise alike on every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jreplicate.layout import check_axis_name
from jreplicate.ps.placement import POLICIES

_WHO = "ParameterServerStrategy"


class PSArguments(NamedTuple):
    """The checked scalar arguments (see :class:`jreplicate.ParameterServerStrategy`)."""

    num_ps: int
    num_workers: int | None
    num_replicas_in_sync: int
    devices: list
    axis_name: str
    max_staleness: int | None
    max_clock_lead: int | None
    token_timeout: float
    max_attempts: int
    max_worker_restarts: int


def check_arguments(*, num_ps: Any, num_workers: Any, num_replicas_in_sync: Any,
                    devices: Sequence[jax.Device] | None, placement: str,
                    max_staleness: Any, max_clock_lead: Any, token_timeout: Any,
                    max_attempts: Any, carrier: str, axis_name: str,
                    max_worker_restarts: Any) -> PSArguments:
    """The strategy's arguments checked (Ray's options are checked on their own).

    Raises:
      ValueError: an argument out of its range, naming it, its value and the fix.
    """
    num_ps = count("num_ps", num_ps, 1, "the parameter-server shards")
    axis = check_axis_name(axis_name, _WHO)
    g = count("num_replicas_in_sync", num_replicas_in_sync, 1,
              "the devices of one worker's sync group")
    devs = list(jax.local_devices() if devices is None else devices)
    if not devs:
        raise ValueError(f"{_WHO}(devices=[]) has no devices; pass some, or devices=None "
                         "for all local devices.")
    if g > len(devs) and carrier != "ray":  # Ray's workers bring their own devices
        raise ValueError(
            f"{_WHO}(num_replicas_in_sync={g}) needs {g} devices per worker but "
            f"{len(devs)} are available; use at most {len(devs)}.")
    if num_workers is not None:
        num_workers = count("num_workers", num_workers, 1, "the workers (sync groups)")
    if placement not in POLICIES:
        raise ValueError(f"{_WHO}(placement={placement!r}) must be one of {POLICIES}.")
    if max_staleness is not None:
        max_staleness = count("max_staleness", max_staleness, 0,
                              "the bounded delay tau, or None for none")
    if max_clock_lead is not None:
        max_clock_lead = count("max_clock_lead", max_clock_lead, 0,
                               "the clocks a worker may lead the slowest by, or None")
        if max_staleness is not None:
            raise ValueError(
                f"{_WHO}(max_staleness={max_staleness}, max_clock_lead={max_clock_lead}): "
                "choose one form of bounded staleness: max_staleness (bounded delay: at "
                "most tau updates stale) or max_clock_lead (stale-synchronous: at most s "
                "clocks ahead).")
    if carrier not in ("embedded", "ray"):
        raise ValueError(f"{_WHO}(carrier={carrier!r}) must be 'embedded' (threads in this "
                         "process) or 'ray'.")
    if not isinstance(token_timeout, (int, float)) or token_timeout <= 0:
        raise ValueError(f"{_WHO}(token_timeout={token_timeout!r}) must be a positive "
                         "number of seconds.")
    return PSArguments(
        num_ps=num_ps, num_workers=num_workers, num_replicas_in_sync=g, devices=devs,
        axis_name=axis, max_staleness=max_staleness, max_clock_lead=max_clock_lead,
        token_timeout=float(token_timeout),
        max_attempts=count("max_attempts", max_attempts, 1, "tries of a step"),
        max_worker_restarts=worker_restarts(max_worker_restarts, carrier))


def worker_restarts(value: Any, carrier: str) -> int:
    """``max_worker_restarts`` checked: an int >= -1 (None: -1, every time)."""
    if value is None:
        return -1
    if carrier == "ray":
        raise ValueError(
            f"{_WHO}(max_worker_restarts={value!r}, carrier='ray'): Ray restarts worker "
            "actors itself; pass ray_worker_options={'max_restarts': "
            f"{value!r}}} instead.")
    return count("max_worker_restarts", value, -1,
                 "times each lost worker is replaced (-1: every time, 0: never)")


def count(name: str, value: Any, minimum: int, what: str) -> int:
    """``value`` checked: an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{_WHO}({name}={value!r}) must be an int >= {minimum}: {what}.")
    return int(value)
