"""Cluster discovery and the JAX distributed runtime, for :class:`MultiWorkerStrategy`.

A multi-worker job is a set of processes started with the same program; each calls
``jax.distributed.initialize`` with the address of a coordinator (process 0), the
number of processes and its own id. :func:`resolve_cluster` finds those three facts,
in this order:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. ``JREPLICATE_COORDINATOR``, ``JREPLICATE_NUM_PROCESSES`` and ``JREPLICATE_PROCESS_ID``,
   set by ``python -m jreplicate.launch``;
3. a ``TF_CONFIG``-style JSON in the environment:
   ``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``
   (an optional ``"chief": ["host:port"]`` entry is process 0 and the workers follow);
   the first process's ``host:port`` is the coordinator's address;
4. JAX's own detection (Cloud TPU, SLURM, Open MPI, ...): ``jax.distributed.initialize()``
   with no arguments;
5. nothing found: one process, no distributed runtime.

:func:`connect` then starts the runtime with bounded waits (see :class:`Timeouts`) and
gloo collectives on CPU. The key-value store of the coordination service carries the
small agreements processes need so that they all take the same decision
(:class:`Agreement`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jreplicate import _jax_compat, _wire

logger = logging.getLogger("jreplicate")

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

#: Exit status of a process that could not join the cluster within
#: ``initialization_timeout`` (``os.EX_TEMPFAIL``: try again later).
EXIT_INIT_TIMEOUT = 75


class ClusterError(RuntimeError):
    """A process could not join, or lost contact with, the other processes of the job."""


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
        ``JAX_COORDINATOR_BIND_ADDRESS``); filled in by :func:`connect`.
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None = None
    source: str = "arguments"
    coordinator_bind_address: str | None = None


def _check_address(address: Any, where: str) -> str:
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
        return _check_address(given, "MultiWorkerStrategy(coordinator_bind_address=...)")
    if os.environ.get(ENV_BIND_ADDRESS):
        return _check_address(os.environ[ENV_BIND_ADDRESS],
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


def _check_int(value: Any, where: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo \
            or (hi is not None and value >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{where} is {value!r}; it must be an int {rng}.")
    return value


def _device_ids(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"{where} is {value!r}; use a comma-separated list of ints, e.g. '0,1'."
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, Sequence) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(
            f"{where} is {value!r}; it must be a non-empty list of local device ids, e.g. "
            "[0, 1], or None for all local devices."
        )
    return tuple(value)


def from_tf_config(text: str | Mapping) -> ClusterSpec:
    """Reads a ``TF_CONFIG``-style cluster description.

    Args:
      text: the JSON text (or the parsed dict) of
        ``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker",
        "index": i}}``. An optional ``"chief": ["host:port"]`` job becomes process 0 and
        the workers follow it. The first process's ``host:port`` is the coordinator.

    Returns:
      The :class:`ClusterSpec`, with ``source="TF_CONFIG"``.

    Raises:
      ValueError: the JSON is malformed or does not describe a worker of the cluster.
    """
    where = f"the {TF_CONFIG} environment variable"
    if isinstance(text, str):
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where} is not valid JSON ({e}). Expected e.g. "
                '{"cluster": {"worker": ["host0:1234", "host1:1234"]}, '
                '"task": {"type": "worker", "index": 0}}.'
            ) from None
    else:
        config = text
    if not isinstance(config, Mapping) or not isinstance(config.get("cluster"), Mapping) \
            or not isinstance(config.get("task"), Mapping):
        raise ValueError(
            f"{where} must be a JSON object with 'cluster' and 'task' objects, e.g. "
            '{"cluster": {"worker": ["host0:1234", "host1:1234"]}, '
            '"task": {"type": "worker", "index": 0}}.'
        )
    cluster, task = config["cluster"], config["task"]
    jobs = {}
    for job in ("chief", "worker"):
        addrs = cluster.get(job, [])
        if not isinstance(addrs, list):
            raise ValueError(f"{where}: cluster['{job}'] must be a list of 'host:port' strings.")
        jobs[job] = [_check_address(a, f"{where}: cluster['{job}'][{i}]")
                     for i, a in enumerate(addrs)]
    if len(jobs["chief"]) > 1:
        raise ValueError(f"{where}: cluster['chief'] lists {len(jobs['chief'])} addresses; a "
                         "cluster has at most one chief.")
    processes = jobs["chief"] + jobs["worker"]
    if not processes:
        raise ValueError(f"{where}: cluster has no 'worker' (or 'chief') addresses. List the "
                         "workers' 'host:port' addresses under cluster['worker'].")
    kind = task.get("type")
    if kind not in ("chief", "worker"):
        others = sorted(set(cluster) - {"chief", "worker"})
        raise ValueError(
            f"{where}: task type {kind!r} has no role in MultiWorkerStrategy, which runs "
            "'chief' and 'worker' tasks only"
            + (f" (the cluster also lists {others}; ParameterServerStrategy runs 'ps' "
               "tasks)" if others else "")
            + ". Set task['type'] to 'worker' or 'chief'."
        )
    index = _check_int(task.get("index", 0), f"{where}: task['index']", 0, len(jobs[kind]))
    pid = index if kind == "chief" else len(jobs["chief"]) + index
    return ClusterSpec(processes[0], len(processes), pid, None, TF_CONFIG)


def resolve_cluster(coordinator_address: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None,
                    local_device_ids: int | Sequence[int] | None = None) -> ClusterSpec:
    """Finds the cluster from arguments, ``JREPLICATE_*``, ``TF_CONFIG`` or auto-detection.

    See the module docstring for the order. Returns a :class:`ClusterSpec` whose
    ``source`` is ``"auto-detect"`` (with ``None`` facts) when JAX is left to detect it.
    """
    ids = _device_ids(local_device_ids, "MultiWorkerStrategy(local_device_ids=...)")
    explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                "process_id": process_id}
    if any(v is not None for v in explicit.values()):
        if num_processes is not None:
            num_processes = _check_int(num_processes, "MultiWorkerStrategy(num_processes=...)", 1)
        if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
            return ClusterSpec(None, 1, 0, ids, "single process")
        missing = [k for k, v in explicit.items() if v is None]
        if missing:
            raise ValueError(
                f"MultiWorkerStrategy got {', '.join(k for k in explicit if k not in missing)} "
                f"but not {', '.join(missing)}. Pass all three of coordinator_address, "
                "num_processes and process_id, or none of them to read the cluster from "
                f"{ENV_COORDINATOR}/{TF_CONFIG} or JAX's auto-detection."
            )
        return ClusterSpec(
            _check_address(coordinator_address, "MultiWorkerStrategy(coordinator_address=...)"),
            num_processes,
            _check_int(process_id, "MultiWorkerStrategy(process_id=...)", 0, num_processes),
            ids, "arguments")
    env = {k: os.environ.get(k) for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)}
    if any(env.values()):
        missing = [k for k, v in env.items() if not v]
        if missing:
            raise ValueError(
                f"the environment sets {', '.join(k for k in env if k not in missing)} but not "
                f"{', '.join(missing)}. Set all three (python -m jreplicate.launch does), or "
                "none."
            )
        n = _check_int(env[ENV_NUM_PROCESSES], f"environment variable {ENV_NUM_PROCESSES}", 1)
        return ClusterSpec(
            _check_address(env[ENV_COORDINATOR], f"environment variable {ENV_COORDINATOR}"),
            n, _check_int(env[ENV_PROCESS_ID], f"environment variable {ENV_PROCESS_ID}", 0, n),
            ids or _device_ids(os.environ.get(ENV_LOCAL_DEVICE_IDS) or None,
                               f"environment variable {ENV_LOCAL_DEVICE_IDS}"),
            "JREPLICATE_* environment")
    if os.environ.get(TF_CONFIG, "").strip():
        spec = from_tf_config(os.environ[TF_CONFIG])
        return dataclasses.replace(spec, local_device_ids=ids)
    return ClusterSpec(None, None, None, ids, "auto-detect")


# -- the runtime ---------------------------------------------------------------------
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


def _init_watchdog(spec: ClusterSpec, timeouts: Timeouts, deadline: float) -> threading.Event:
    """Exits with a clear message if start-up outlives ``initialization_timeout``
    (``deadline``, on the ``time.monotonic`` clock).

    ``jax.distributed.initialize`` blocks in C++ and aborts on its own deadline with a
    message about RPC deadlines; this says what went wrong, on time.
    """
    done = threading.Event()

    def watch():
        if done.wait(max(0.0, deadline - time.monotonic()) + 1.0):
            return
        me = "the coordinator" if spec.process_id == 0 else f"process {spec.process_id}"
        sys.stderr.write(
            f"jreplicate: MultiWorkerStrategy: {me} (process {spec.process_id} of "
            f"{spec.num_processes}) could not join the cluster at {spec.coordinator_address} "
            f"within initialization_timeout={timeouts.initialization_timeout:g}s "
            f"(cluster from {spec.source}). "
            + ("Not all processes connected: start all num_processes processes, with the "
               "same coordinator_address and distinct process_id values."
               if spec.process_id == 0 else
               "The coordinator accepted the connection but the job did not start: check that "
               "every process uses the same coordinator_address and num_processes.")
            + f" Exiting with status {EXIT_INIT_TIMEOUT}.\n")
        sys.stderr.flush()
        os._exit(EXIT_INIT_TIMEOUT)

    threading.Thread(target=watch, name="jreplicate-init-watchdog", daemon=True).start()
    return done


def connect(spec: ClusterSpec, timeouts: Timeouts,
            cluster_detection_method: str | None = None,
            bind_address: str | None = None) -> ClusterSpec:
    """Starts (or joins) the JAX distributed runtime for ``spec``.

    Returns the spec with the facts JAX detected filled in. Single-process specs start
    nothing. If ``jax.distributed`` is already initialised, checks it agrees with
    ``spec`` and reuses it.

    Where it listens: process 0's coordination service binds
    :func:`resolve_bind_address` (``bind_address`` first); with a loopback coordinator
    (``python -m jreplicate.launch``) that is the coordinator's loopback address, and
    gloo's sockets (CPU collectives) listen on loopback too. Otherwise JAX's and gloo's
    defaults apply: every interface, and the address of the host name.

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
    done = _init_watchdog(spec, timeouts, deadline)
    try:
        jax.distributed.initialize(
            spec.coordinator_address, spec.num_processes, spec.process_id,
            local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
            cluster_detection_method="deactivate", coordinator_bind_address=bind, **kwargs)
    finally:
        done.set()
    return dataclasses.replace(spec, coordinator_bind_address=bind)


# -- agreement through the coordination service's key-value store ----------------------
def decode_message[T](raw: bytes, sender: int, what: str, check: Callable[[Any], T]) -> T:
    """Process ``sender``'s agreement message: JSON, checked by ``check``.

    ``check`` takes the parsed JSON and returns the typed value, or raises
    ``ValueError`` / ``TypeError`` saying what is wrong. Nothing is unpickled.

    Raises:
      MessageError: ``raw`` is not UTF-8 JSON or ``check`` rejects it; the message names
        the sender and what was being agreed on.
    """
    try:
        return check(json.loads(raw.decode("utf-8")))
    except (ValueError, TypeError, RecursionError) as e:  # JSONDecodeError, Unicode...
        raise MessageError(
            f"jreplicate: process {sender} sent a malformed message while agreeing on "
            f"{what}: {str(e)[:300]} (got {bytes(raw[:120])!r}"
            f"{'...' if len(raw) > 120 else ''}). Every process must run the same program "
            "with the same jreplicate version, and nothing else may write to the job's "
            "coordination service."
        ) from None


class Agreement:
    """All-gathers small messages between the processes, through the coordinator.

    Each call is numbered; process ``p`` publishes ``<prefix>/<n>/<p>`` and reads the
    others' values for the same ``n``, so every process receives the same list, in
    process order, and can take the same decision. Waits are bounded by ``timeout``.
    :meth:`exchange` carries JSON checked against the caller's schema: nothing read
    from the key-value store is unpickled.
    """

    def __init__(self, prefix: str, num_processes: int, process_id: int, timeout: float):
        self._prefix = prefix
        self._n = num_processes
        self._pid = process_id
        self._timeout_ms = max(1, int(timeout * 1000))
        self._timeout = timeout
        self._count = 0
        # Messages already checked (each step's input report is usually the last one's).
        self._checked: dict[tuple[Callable, bytes], Any] = {}

    def all_gather(self, value: bytes, what: str) -> list[bytes]:
        """Publishes ``value`` and returns every process's value, in process order.

        Args:
          value: this process's bytes.
          what: what is being agreed on, for error messages ("the input of step 3").

        Raises:
          ClusterError: a process did not publish within the timeout (dead or stuck).
        """
        if self._n == 1:
            return [value]
        n, self._count = self._count, self._count + 1
        client = _jax_compat.distributed_client()
        key = f"{self._prefix}/{n}"
        client.key_value_set_bytes(f"{key}/{self._pid}", value)
        out = []
        for p in range(self._n):
            if p == self._pid:
                out.append(value)
                continue
            try:
                out.append(client.blocking_key_value_get_bytes(f"{key}/{p}", self._timeout_ms))
            except Exception as e:  # jax raises its own runtime error type
                raise ClusterError(
                    f"jreplicate: process {self._pid} waited for process {p} to agree on "
                    f"{what}, but it did not arrive within collective_timeout="
                    f"{self._timeout:g}s: it died, hangs, or is slower than the timeout "
                    f"allows. ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
                ) from None
        if n > 0:  # everyone has read round n - 1 once they published round n
            try:
                client.key_value_delete(f"{self._prefix}/{n - 1}/{self._pid}")
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        return out

    def exchange[T](self, message: Any, what: str, check: Callable[[Any], T]) -> list[T]:
        """Publishes ``message`` (JSON-serialisable) and returns every process's message
        in process order, each parsed and checked by ``check`` (see
        :func:`decode_message`); this process's own goes through the same check. A
        message equal to one checked before is not parsed again: the values returned
        are shared, do not modify them.

        Raises:
          MessageError: a process's message is malformed (every process raises it).
          ClusterError: a process did not publish within the timeout.
        """
        data = _wire.dumps(message)
        out = []
        for p, raw in enumerate(self.all_gather(data, what)):
            key = (check, bytes(raw))
            if key not in self._checked:
                if len(self._checked) >= 64:
                    self._checked.clear()
                self._checked[key] = decode_message(raw, p, what, check)
            out.append(self._checked[key])
        return out
