"""What a multi-process job is made of: its cluster spec, timeouts and errors.

A multi-worker job is a set of processes started with the same program; each calls
``jax.distributed.initialize`` with the address of a coordinator (process 0), the
number of processes and its own id. :class:`ClusterSpec` holds those facts (found by
:func:`jreplicate.cluster.discovery.resolve_cluster`) and :class:`Timeouts` bounds
every wait of the runtime. The ``ENV_*`` names are the environment variables that
``python -m jreplicate.cluster.launch`` sets and the strategies read.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from typing import Any

ENV_COORDINATOR = "JREPLICATE_COORDINATOR"
ENV_NUM_PROCESSES = "JREPLICATE_NUM_PROCESSES"
ENV_PROCESS_ID = "JREPLICATE_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JREPLICATE_LOCAL_DEVICE_IDS"
ENV_BIND_ADDRESS = "JREPLICATE_COORDINATOR_BIND_ADDRESS"
ENV_TIMEOUTS = {
    "initialization_timeout": "JREPLICATE_INITIALIZATION_TIMEOUT",
    "heartbeat_timeout": "JREPLICATE_HEARTBEAT_TIMEOUT",
    "shutdown_timeout": "JREPLICATE_SHUTDOWN_TIMEOUT",
    "collective_timeout": "JREPLICATE_COLLECTIVE_TIMEOUT",
}
TF_CONFIG = "TF_CONFIG"


class ClusterError(RuntimeError):
    """A process could not join, or lost contact with, the other processes of the job.

    Raised on every surviving process alike (a peer that died or stalled, a coordinator
    that cannot be reached within ``initialization_timeout``, a malformed message); the
    message names the process and the fix.

    Example (a message that is not what every process of the job sends):
      >>> from jreplicate.cluster import ClusterError
      >>> from jreplicate.cluster.agreement import decode_message
      >>> try:
      ...     decode_message(b"not json", 1, "the input outcome", dict)
      ... except ClusterError as e:
      ...     print(str(e)[:66])
      jreplicate: process 1 sent a malformed message while agreeing on t
    """


class MessageError(ClusterError):
    """A process received a malformed agreement message (it names the sender)."""


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Bounds on every wait of the distributed runtime, in seconds.

    The defaults suit production jobs; tests use a few seconds each.

    Attributes:
      initialization_timeout: how long start-up waits for the coordinator and for all
        processes to connect. A process that cannot join in this time exits with a
        message naming the coordinator address (status ``EXIT_INIT_TIMEOUT``).
      heartbeat_timeout: a process that sends no heartbeat for this long is declared
        dead and every other process is terminated with an error saying which one.
      shutdown_timeout: how long a finishing process waits for the others to finish.
      collective_timeout: how long a cross-process collective (a gloo all-reduce on
        CPU) or a cross-process agreement of jreplicate (input, checkpoints) waits for
        the slowest process; a process stuck for longer (alive, but not arriving) makes
        the others fail with an error. It must exceed the longest legitimate skew
        between processes, e.g. the chief writing a checkpoint or a slow first compile.

    Example (explicit values win over ``JREPLICATE_*_TIMEOUT``, which win over the
    defaults; ``MultiWorkerStrategy(heartbeat_timeout=...)`` passes them here):

      >>> from jreplicate.cluster import Timeouts
      >>> t = Timeouts.resolve(heartbeat_timeout=30)
      >>> t.heartbeat_timeout, t.collective_timeout
      (30.0, 600.0)
      >>> Timeouts.resolve(collective_timeout=0)
      Traceback (most recent call last):
      ValueError: MultiWorkerStrategy(collective_timeout=...) is 0; it must be a positive ...
    """

    initialization_timeout: float = 300.0
    heartbeat_timeout: float = 100.0
    shutdown_timeout: float = 300.0
    collective_timeout: float = 600.0

    @classmethod
    def resolve(cls, **given: float | None) -> Timeouts:
        """Explicit values, else ``JREPLICATE_*_TIMEOUT`` environment variables, else defaults."""
        values = {}
        for name, env in ENV_TIMEOUTS.items():
            value = given.get(name)
            where = f"MultiWorkerStrategy({name}=...)"
            if value is None and os.environ.get(env):
                value, where = os.environ[env], f"environment variable {env}"
                try:
                    value = float(value)
                except ValueError:
                    raise ValueError(
                        f"{where}={os.environ[env]!r} is not a number of seconds. Set it to a "
                        "positive number, e.g. 30, or unset it for the default."
                    ) from None
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{where} is {value!r}; it must be a positive number of seconds, e.g. "
                    f"{getattr(cls, name):g} (the default)."
                )
            values[name] = float(value)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process stands in the job.

    Attributes:
      coordinator_address: ``host:port`` of the coordination service (process 0);
        ``None`` when it is left to JAX's auto-detection or there is one process.
      num_processes: the number of processes (``None``: auto-detected).
      process_id: this process's id in ``[0, num_processes)`` (``None``: auto-detected).
      local_device_ids: the local devices this process uses (``None``: all).
      source: where the facts came from (``"arguments"``, ``"JREPLICATE_* environment"``,
        ``"TF_CONFIG"``, ``"auto-detect"`` or ``"single process"``).
      coordinator_bind_address: where process 0's coordination service listens, as
        passed to JAX (``None``: JAX's default, every interface, or
        ``JAX_COORDINATOR_BIND_ADDRESS``); filled in by ``jreplicate.cluster.runtime.connect``.

    Example (TensorFlow's ``TF_CONFIG`` of worker 1 of two):
      >>> from jreplicate.cluster.discovery import from_tf_config
      >>> spec = from_tf_config({"cluster": {"worker": ["h0:1234", "h1:1234"]},
      ...                        "task": {"type": "worker", "index": 1}})
      >>> spec.coordinator_address, spec.num_processes, spec.process_id, spec.source
      ('h0:1234', 2, 1, 'TF_CONFIG')
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "arguments"
    coordinator_bind_address: str | None = None



def check_address(address: Any, where: str) -> str:
    """``address`` if it is a ``'host:port'`` string with a port in 1..65535.

    Raises:
      ValueError: it is not; the message starts with ``where`` (what was given).
    """
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(
            f"{where} is {address!r}; it must be a 'host:port' string, e.g. '10.0.0.1:1234' "
            "(the address and a free port of process 0)."
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{where} is {address!r}; it must be 'host:port' with a port in 1..65535, e.g. "
            "'10.0.0.1:1234'."
        )
    return address


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is this machine's loopback: ``localhost``, ``127.x.y.z`` or
    ``::1`` (literally; a host name that resolves to loopback does not count, because
    it may resolve to another address on another host)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
