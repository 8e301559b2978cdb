"""Finding the cluster: where this process stands in the job.

:func:`resolve_cluster` finds the coordinator's address, the number of processes and
this process's id, in this order:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. ``JREPLICATE_COORDINATOR``, ``JREPLICATE_NUM_PROCESSES`` and ``JREPLICATE_PROCESS_ID``,
   set by ``python -m jreplicate.cluster.launch``;
3. a ``TF_CONFIG``-style JSON in the environment:
   ``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``
   (an optional ``"chief": ["host:port"]`` entry is process 0 and the workers follow);
   the first process's ``host:port`` is the coordinator's address;
4. JAX's own detection (Cloud TPU, SLURM, Open MPI, ...): ``jax.distributed.initialize()``
   with no arguments;
5. nothing found: one process, no distributed runtime.

:func:`jreplicate.cluster.runtime.connect` then starts the runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jreplicate.cluster.spec import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    TF_CONFIG,
    ClusterSpec,
    check_address,
)


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
        jobs[job] = [check_address(a, f"{where}: cluster['{job}'][{i}]")
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

    See this module's docstring for the order. Returns a :class:`ClusterSpec` whose
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
            check_address(coordinator_address, "MultiWorkerStrategy(coordinator_address=...)"),
            num_processes,
            _check_int(process_id, "MultiWorkerStrategy(process_id=...)", 0, num_processes),
            ids, "arguments")
    env = {k: os.environ.get(k) for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)}
    if any(env.values()):
        missing = [k for k, v in env.items() if not v]
        if missing:
            raise ValueError(
                f"the environment sets {', '.join(k for k in env if k not in missing)} but not "
                f"{', '.join(missing)}. Set all three (python -m jreplicate.cluster.launch "
                "does), or none."
            )
        n = _check_int(env[ENV_NUM_PROCESSES], f"environment variable {ENV_NUM_PROCESSES}", 1)
        return ClusterSpec(
            check_address(env[ENV_COORDINATOR], f"environment variable {ENV_COORDINATOR}"),
            n, _check_int(env[ENV_PROCESS_ID], f"environment variable {ENV_PROCESS_ID}", 0, n),
            ids or _device_ids(os.environ.get(ENV_LOCAL_DEVICE_IDS) or None,
                               f"environment variable {ENV_LOCAL_DEVICE_IDS}"),
            "JREPLICATE_* environment")
    if os.environ.get(TF_CONFIG, "").strip():
        spec = from_tf_config(os.environ[TF_CONFIG])
        return dataclasses.replace(spec, local_device_ids=ids)
    return ClusterSpec(None, None, None, ids, "auto-detect")
