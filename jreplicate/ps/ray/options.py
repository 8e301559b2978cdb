"""The Ray actor options of :class:`jreplicate.ParameterServerStrategy`'s shards and
workers (``ray_shard_options=``, ``ray_worker_options=``), checked on the driver when
the strategy is created and merged with the carrier's defaults when the actors are.

Each is a dict of Ray's actor options (what ``ActorClass.options(...)`` takes:
``num_cpus``, ``num_gpus``, ``resources``, ``memory``, ``accelerator_type``,
``scheduling_strategy``, ``runtime_env``, ``label_selector``, ...), or a function of the
actor's index returning one (e.g. to put worker ``w`` in bundle ``w`` of a placement
group). The carrier's defaults:

* every actor asks for no CPUs (``num_cpus=0``), so the actors fit any cluster;
* a worker with ``num_gpus`` (> 0) is a GPU worker, using the first
  ``num_replicas_in_sync`` GPUs Ray gives it; without it a worker runs on CPU with
  ``num_replicas_in_sync`` simulated devices (its ``runtime_env`` gets
  ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=g``,
  merged into the user's: variables the user set win, and a user's ``XLA_FLAGS``
  without a device count gets it appended). The driver's own devices play no part;
* a worker restarts after its process dies, every time, as a cluster manager restarts
  a preempted worker (``max_restarts=-1``; a number bounds it; Ray retries no task,
  ``max_task_retries=0``: the coordinator reschedules the step exactly once) and is
  given steps again, told again what the lost process was told (shards, settings,
  functions); its ``PER_WORKER`` input pipelines are built again from ``input_fn`` and
  go on after the elements the lost process's completed steps read, so the elements
  of the step it died in are read again there (the step itself is rerun elsewhere,
  reading other elements): each element is applied once, unless the process died
  after that step's push and before its reply (then twice, and the rerun's are not).
  ``max_restarts=0`` loses the worker for good;
* a shard is never restarted by Ray, which would bring it back with its initial
  parameters: a lost shard stops training, and
  :meth:`jreplicate.ParameterServerStrategy.restart_shard` brings it back from a saved
  state.

Options the strategy sets itself are refused with the reason (``name`` and
``get_if_exists``, one name for many actors; ``max_concurrency`` and
``concurrency_groups``, which the shards' token waits depend on; ``max_task_retries``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: Worker restarts after a process death, unless ``ray_worker_options`` says otherwise.
DEFAULT_WORKER_RESTARTS = -1

_REFUSED = {
    "name": "one name cannot serve several actors",
    "get_if_exists": "each actor is created by the strategy",
    "max_concurrency": "the strategy sets the actors' concurrency",
    "concurrency_groups": "the shards' token waits need their own concurrency group",
    "max_task_retries": "the coordinator reschedules a lost step itself, exactly once",
}
_REFUSED_SHARD = {
    "max_restarts": "Ray would restart a shard with its initial parameters; use "
                    "strategy.restart_shard(i, state) to restart one from a saved state",
}


def _ray_validate(opts: dict[str, Any]) -> None:
    """Ray's own check of actor options (nothing when Ray is not installed)."""
    try:
        from ray._common.ray_option_utils import validate_actor_options
    except ImportError:
        return
    validate_actor_options(opts, in_options=True)


def _ray_option_names() -> frozenset[str] | None:
    """The option names Ray's actors accept (None: Ray is not installed)."""
    try:
        from ray._common.ray_option_utils import actor_options
    except ImportError:
        try:
            from ray._private.ray_option_utils import actor_options
        except ImportError:
            return None
    return frozenset(actor_options)


def _check_one(arg: str, opts: Any, where: str, g: int) -> dict[str, Any]:
    if not isinstance(opts, Mapping):
        raise TypeError(f"ParameterServerStrategy({arg}=...){where} must be a dict of Ray "
                        f"actor options (or a function of the actor's index returning "
                        f"one), got {type(opts).__name__}.")
    opts = dict(opts)
    bad = [k for k in opts if not isinstance(k, str)]
    if bad:
        raise TypeError(f"ParameterServerStrategy({arg}=...){where}: option names must be "
                        f"strings, got {bad!r}.")
    refused = dict(_REFUSED, **(_REFUSED_SHARD if arg == "ray_shard_options" else {}))
    for k in opts:
        if k in refused:
            raise ValueError(f"ParameterServerStrategy({arg}={{{k!r}: ...}}){where}: "
                             f"{refused[k]}; remove {k!r}.")
    known = _ray_option_names()
    unknown = sorted(set(opts) - known) if known is not None else []
    if unknown:
        raise ValueError(f"ParameterServerStrategy({arg}=...){where}: {unknown} are not "
                         f"options of a Ray actor; use some of {sorted(known - set(refused))}.")
    for k in ("num_cpus", "num_gpus", "memory"):
        v = opts.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                              not 0 <= v < float("inf")):
            raise ValueError(f"ParameterServerStrategy({arg}={{{k!r}: {v!r}}}){where} must "
                             "be a number >= 0, finite.")
    gpus = opts.get("num_gpus") or 0
    if arg == "ray_worker_options" and gpus and gpus < g and (gpus >= 1 or g > 1):
        raise ValueError(
            f"ParameterServerStrategy({arg}={{'num_gpus': {gpus!r}}}){where}: a worker runs "
            f"num_replicas_in_sync={g} replicas, one per GPU; use num_gpus={g} (or "
            f"num_replicas_in_sync={max(int(gpus), 1)}).")
    env = opts.get("runtime_env")
    if env is not None and not isinstance(env, Mapping):  # RuntimeEnv is a dict
        raise TypeError(f"ParameterServerStrategy({arg}={{'runtime_env': ...}}){where} must "
                        f"be a dict (Ray's runtime environment), got {type(env).__name__}.")
    env_vars = (env or {}).get("env_vars")
    if env_vars is not None and (not isinstance(env_vars, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())):
        raise TypeError(f"ParameterServerStrategy({arg}={{'runtime_env': {{'env_vars': "
                        f"{env_vars!r}}}}}){where} must map names to strings.")
    restarts = opts.get("max_restarts")
    if restarts is not None and (isinstance(restarts, bool) or not isinstance(restarts, int)
                                 or restarts < -1):
        raise ValueError(f"ParameterServerStrategy({arg}={{'max_restarts': {restarts!r}}})"
                         f"{where} must be an int >= 0, or -1 for no limit.")
    resources = opts.get("resources")
    if resources is not None and (not isinstance(resources, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in resources.items())):
        raise ValueError(f"ParameterServerStrategy({arg}={{'resources': {resources!r}}})"
                         f"{where} must map resource names to amounts >= 0 (e.g. "
                         "{'worker_node': 1}).")
    try:
        _ray_validate(dict(opts))
    except (ValueError, TypeError) as e:
        raise ValueError(f"ParameterServerStrategy({arg}=...){where}: Ray refuses these "
                         f"actor options: {e}") from e
    return opts


def resolve(arg: str, options: dict | Callable[[int], dict] | None, count: int,
            g: int = 1) -> tuple[dict[str, Any], ...]:
    """The checked options of each of ``count`` actors.

    Args:
      arg: the strategy's argument (``"ray_worker_options"`` or ``"ray_shard_options"``),
        named in errors.
      options: a dict for every actor, a function of the actor's index returning one,
        or None.
      count: the actors.
      g: ``num_replicas_in_sync`` (a GPU worker needs that many GPUs).

    Raises:
      TypeError, ValueError: naming the argument, the option and the fix.
    """
    if options is None:
        return tuple({} for _ in range(count))
    if callable(options) and not isinstance(options, Mapping):
        out = []
        for i in range(count):
            try:
                opts = options(i)
            except Exception as e:  # broad: the user's callable may raise anything;
                # named with the actor it was called for
                raise ValueError(f"ParameterServerStrategy({arg}=...) raised for actor {i}: "
                                 f"{type(e).__name__}: {e}") from e
            out.append(_check_one(arg, opts, f" for actor {i}", g))
        return tuple(out)
    opts = _check_one(arg, options, "", g)
    return tuple(dict(opts) for _ in range(count))


def warn_if_gpus_unused(options: tuple[dict[str, Any], ...], driver_platform: str,
                        g: int) -> None:
    """A driver with GPUs whose workers ask for none: they run on CPU; say so (an
    explicit ``num_gpus=0`` is taken as meant)."""
    if driver_platform == "gpu" and options and not any("num_gpus" in o for o in options):
        warnings.warn(
            "ParameterServerStrategy(carrier='ray'): the worker actors ask for no GPUs, so "
            f"they run on CPU although this process has GPUs; pass ray_worker_options="
            f"{{'num_gpus': {g}}} for GPU workers, or {{'num_gpus': 0}} to keep them on "
            "CPU without this warning.", stacklevel=4)


def is_gpu_worker(opts: Mapping[str, Any]) -> bool:
    """Whether a worker with these (checked) options runs on GPUs."""
    return bool(opts.get("num_gpus") or 0)


def worker_actor_options(opts: Mapping[str, Any], g: int) -> dict[str, Any]:
    """A worker's options for ``WorkerActor.options(...)``: the user's merged with the
    defaults (see the module docstring)."""
    out = {"num_cpus": 0, "max_restarts": DEFAULT_WORKER_RESTARTS, **opts,
           "max_task_retries": 0}
    if is_gpu_worker(opts):
        return _unpinned(out)
    env = dict(out.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault("JAX_PLATFORMS", "cpu")
    flag = f"--xla_force_host_platform_device_count={g}"
    xla = env_vars.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in xla:
        env_vars["XLA_FLAGS"] = f"{xla} {flag}".strip()
    env["env_vars"] = env_vars
    out["runtime_env"] = env
    return out


def _unpinned(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` for an actor with GPUs: not the JAX_PLATFORMS of the process that started
    Ray (e.g. a CPU-only driver's ``"cpu"``) but every platform, the GPUs first."""
    env = dict(out.get("runtime_env") or {})
    env["env_vars"] = {"JAX_PLATFORMS": "", **(env.get("env_vars") or {})}
    return {**out, "runtime_env": env}


def shard_actor_options(opts: Mapping[str, Any]) -> dict[str, Any]:
    """A shard's options for ``ShardActor.options(...)`` (with ``num_gpus``, its JAX
    sees the GPUs, as a GPU worker's does)."""
    out = {"num_cpus": 0, **opts, "max_restarts": 0, "max_task_retries": 0}
    return _unpinned(out) if opts.get("num_gpus") else out
