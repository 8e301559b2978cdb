"""The JAX distributed runtime: joining it with bounded waits, on the right sockets.

:func:`connect` starts (or joins) ``jax.distributed`` for a
:class:`~jreplicate.cluster.spec.ClusterSpec`, with every wait bounded by
:class:`~jreplicate.cluster.spec.Timeouts` and gloo collectives on CPU;
:func:`resolve_bind_address` decides where process 0's coordination service listens.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time

import jax

from jreplicate import _jax_compat
from jreplicate.cluster.spec import (
    ENV_BIND_ADDRESS,
    ClusterError,
    ClusterSpec,
    Timeouts,
    check_address,
    is_loopback_host,
)
from jreplicate.cluster.watchdog import start_init_watchdog

logger = logging.getLogger("jreplicate")


def resolve_bind_address(coordinator_address: str | None, given: str | None = None
                         ) -> str | None:
    """Where process 0's coordination service listens (``None``: JAX decides).

    In order: ``given`` (``MultiWorkerStrategy(coordinator_bind_address=...)``), then
    ``JREPLICATE_COORDINATOR_BIND_ADDRESS``; then ``None`` when
    ``JAX_COORDINATOR_BIND_ADDRESS`` is set (JAX reads it); then the coordinator's own
    address when it is a loopback address (a local job listens on loopback only); else
    ``None``: JAX's default, every interface (``[::]:port``).
    """
    if given is not None:
        return check_address(given, "MultiWorkerStrategy(coordinator_bind_address=...)")
    if os.environ.get(ENV_BIND_ADDRESS):
        return check_address(os.environ[ENV_BIND_ADDRESS],
                             f"environment variable {ENV_BIND_ADDRESS}")
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    if coordinator_address and is_loopback_host(coordinator_address.rpartition(":")[0]):
        return coordinator_address
    return None


def _gloo_host(coordinator_address: str | None) -> str | None:
    """The address gloo listens on: loopback for a loopback coordinator (every process
    is on this machine), else ``None`` (gloo's default: the host name's address)."""
    if coordinator_address is None:
        return None
    host = coordinator_address.rpartition(":")[0].strip("[]")
    if not is_loopback_host(host):
        return None
    return "::1" if ":" in host else "127.0.0.1"


def _set_collective_timeout(seconds: float) -> None:
    """Bounds CPU (gloo) collectives: an XLA flag read when the backend starts."""
    flag = "--xla_cpu_collective_timeout_seconds"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag + "=")]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{flag}={max(1, math.ceil(seconds))}"])


def _reachable(address: str, deadline: float) -> bool:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def connect(spec: ClusterSpec, timeouts: Timeouts,
            cluster_detection_method: str | None = None,
            bind_address: str | None = None) -> ClusterSpec:
    """Starts (or joins) the JAX distributed runtime for ``spec``.

    Returns the spec with the facts JAX detected filled in. Single-process specs start
    nothing. If ``jax.distributed`` is already initialised, checks it agrees with
    ``spec`` and reuses it.

    Where it listens: process 0's coordination service binds
    :func:`resolve_bind_address` (``bind_address`` first); with a loopback coordinator
    (``python -m jreplicate.cluster.launch``) that is the coordinator's loopback
    address, and gloo's sockets (CPU collectives) listen on loopback too. Otherwise
    JAX's and gloo's defaults apply: every interface, and the address of the host name.

    Raises:
      ClusterError: the coordinator is unreachable within ``initialization_timeout``.
      RuntimeError: the JAX backend was started before the distributed runtime.
      ValueError: ``spec`` disagrees with an already initialised runtime.
    """
    if jax.distributed.is_initialized():
        n, pid = jax.process_count(), jax.process_index()
        if (spec.num_processes not in (None, n)) or (spec.process_id not in (None, pid)):
            raise ValueError(
                f"jax.distributed is already initialised as process {pid} of {n}, but "
                f"MultiWorkerStrategy was given process {spec.process_id} of "
                f"{spec.num_processes} (from {spec.source}). Drop the arguments to reuse the "
                "running cluster."
            )
        return dataclasses.replace(spec, num_processes=n, process_id=pid)
    if spec.num_processes == 1:
        return dataclasses.replace(spec, process_id=0)
    if (spec.source == "auto-detect" and cluster_detection_method is None
            and not _jax_compat.cluster_env_present()):
        logger.info("jreplicate: no cluster found; running as one process.")
        return ClusterSpec(None, 1, 0, spec.local_device_ids, "single process")
    if _jax_compat.backends_are_initialized():
        raise RuntimeError(
            "MultiWorkerStrategy must be created before anything starts the JAX backend "
            "(jax.devices(), jnp arrays, jit calls) so that it can join the cluster first. "
            "Create the strategy at the top of the program."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _set_collective_timeout(timeouts.collective_timeout)
    minutes = max(1, math.ceil(timeouts.initialization_timeout / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes + 1)
    kwargs = dict(
        initialization_timeout=max(1, math.ceil(timeouts.initialization_timeout)),
        heartbeat_timeout_seconds=max(1, math.ceil(timeouts.heartbeat_timeout)),
        shutdown_timeout_seconds=max(1, math.ceil(timeouts.shutdown_timeout)),
    )
    if spec.source == "auto-detect":
        bind = resolve_bind_address(None, bind_address)
        try:
            jax.distributed.initialize(local_device_ids=spec.local_device_ids,
                                       cluster_detection_method=cluster_detection_method,
                                       coordinator_bind_address=bind, **kwargs)
        except ValueError as e:
            if "should be defined" not in str(e) and "must be defined" not in str(e):
                raise
            logger.info("jreplicate: no cluster detected (%s); running as one process.", e)
            return ClusterSpec(None, 1, 0, spec.local_device_ids, "single process")
        return dataclasses.replace(spec, num_processes=jax.process_count(),
                                   process_id=jax.process_index(),
                                   coordinator_bind_address=bind)
    bind = resolve_bind_address(spec.coordinator_address, bind_address)
    if bind is None and spec.process_id == 0 \
            and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        logger.info("jreplicate: the coordination service at %s listens on every interface "
                    "(JAX's default); pass coordinator_bind_address= (or set %s) to choose.",
                    spec.coordinator_address, ENV_BIND_ADDRESS)
    _jax_compat.set_gloo_hostname(_gloo_host(spec.coordinator_address))
    deadline = time.monotonic() + timeouts.initialization_timeout
    if spec.process_id != 0 and not _reachable(spec.coordinator_address, deadline):
        raise ClusterError(
            f"MultiWorkerStrategy: process {spec.process_id} of {spec.num_processes} could not "
            f"reach the coordinator at {spec.coordinator_address} within "
            f"initialization_timeout={timeouts.initialization_timeout:g}s (cluster from "
            f"{spec.source}). Start process 0 first or together with the others, check the "
            "host and port of coordinator_address, and that no firewall blocks the port; "
            "raise initialization_timeout if process 0 starts slowly."
        )
    # What is left of initialization_timeout after waiting for the coordinator.
    kwargs["initialization_timeout"] = max(1, math.ceil(deadline - time.monotonic()))
    done = start_init_watchdog(spec, timeouts, deadline)
    try:
        jax.distributed.initialize(
            spec.coordinator_address, spec.num_processes, spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
            cluster_detection_method="deactivate", coordinator_bind_address=bind, **kwargs)
    finally:
        done.set()
    return dataclasses.replace(spec, coordinator_bind_address=bind)
