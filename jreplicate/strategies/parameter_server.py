"""ParameterServerStrategy: parameter-server shards and asynchronous workers.

The parameters live on PS shards (:mod:`jreplicate.ps.shard`, placed by
:mod:`jreplicate.ps.placement`); each worker (a sync group of
``num_replicas_in_sync`` devices, one SPMD mesh) pulls them, runs the step compiled for
its devices and pushes the gradients, which the shards apply with the optax
transformation as they arrive. Scheduling follows TF2's ``ClusterCoordinator``
(:mod:`jreplicate.ps.coordinator`): ``rep.run(step, inputs, params, opt_state)``
returns a :class:`jreplicate.ps.RemoteValue` at once, ``rep.join()`` waits for every step
and re-raises the first error.

**The same step as under MirroredStrategy.** The step computes gradients and calls
``tx.update(grads, opt_state, params)``; create ``tx = jr.ps.pushable(optax...)`` and its
state inside ``rep.scope()``. Under SPMD strategies ``pushable`` changes nothing; here
``tx.init`` in the scope registers the parameters and the transformation (the shards
are built from them), and on a worker ``tx.update`` records the gradients, which the
worker pushes (see :mod:`jreplicate.ps.capture` for the mechanism and its limits).
``run``'s arguments that are the registered ``params`` and optimizer state are
recognised by identity; the worker passes the freshly pulled parameters in their place.

**Modes.** Any optax transformation: asynchronous training (every push applied as it
arrives, staleness recorded, ``max_staleness=tau`` bounds it). A
:func:`jreplicate.sync_replicas` transformation: token-gated synchronous training with
backup workers, its host driver on shard 0 with a blocking token queue.

**Input.** ``rep.prepare_input(input_fn)`` with ``InputReplicationMode.PER_WORKER``
(the default) runs ``input_fn`` on each worker (its thread, or its Ray actor) with
``InputContext(input_pipeline_id=worker, num_input_pipelines=num_workers)``, as
TensorFlow's ``ClusterCoordinator.create_per_worker_dataset``: the driver neither
reads nor ships batches, a step takes ``num_replicas_in_sync`` elements from the
pipeline of the worker that runs it. A rerun of a dead worker's step reads the new
worker's pipeline; when every live worker's pipeline is exhausted, ``run`` raises
``StopIteration`` and queued steps are not run (see
:mod:`jreplicate.ps.worker_input`). ``SINGLE`` reads on the coordinator (this
process): each ``get_next`` is one step's batch for one sync group, shipped to
whichever worker runs the step.

**Carriers.** ``carrier="embedded"`` (default): shards and workers are threads of this
process on distinct local devices (8 devices, ``num_ps=2``: 2 shards + 6 workers;
:mod:`jreplicate.ps.embedded`). ``carrier="ray"``: shards and workers are Ray actors
(:mod:`jreplicate.ps.ray.carrier`). The executor is :mod:`jreplicate.ps.executor`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jreplicate.layout import MODEL_AXIS, REPLICA_AXIS, Layout, replica_mesh
from jreplicate.ps.config import PSConfig
from jreplicate.ps.device_layout import assign_devices
from jreplicate.ps.executor import ParameterServerExecutor
from jreplicate.ps.per_worker import PerWorkerState, PerWorkerValue, WorkerContext
from jreplicate.ps.placement import Placement
from jreplicate.ps.ray.options import resolve as resolve_ray_options
from jreplicate.ps.ray.options import warn_if_gpus_unused
from jreplicate.ps.shard_restart import ShardRestart
from jreplicate.strategies.base import Strategy
from jreplicate.strategies.ps_arguments import check_arguments


class ParameterServerStrategy(Strategy):
    """Asynchronous (or token-gated) training with parameter-server shards and workers.

    Args:
      num_ps: parameter-server shards (default 1).
      num_workers: workers (sync groups); default: as many as the devices left after
        the shards' allow (``(len(devices) - num_ps) // num_replicas_in_sync``, at
        least 1). Worker groups never share devices (an error names the fix); see
        :mod:`jreplicate.ps.device_layout` for the policy and its warnings.
      num_replicas_in_sync: devices (replicas) per worker; each group is one SPMD mesh
        that all-reduces inside and pushes once per step.
      devices: local devices to use (default all): the first ``num_ps`` hold the
        shards, the next ones the workers. With too few devices for both, the shards
        share the workers' devices (with a warning).
      placement: ``"size_balanced"`` (default: the largest leaves first onto the
        lightest shard, so every shard holds a share of the bytes and of each step's
        traffic) or ``"round_robin"`` (TensorFlow's ``replica_device_setter`` order,
        which gives shard 0 of an MLP's ``{"b", "w"}`` layers only the biases); see
        ``jreplicate.ps.placement.place_parameters``.
      max_staleness: bounded staleness tau (None: fully asynchronous): no applied
        update is more than tau updates stale (Li et al., OSDI'14); workers wait
        rather than exceed it, tau = 0 is sequential. Asynchronous mode only. About
        tau + 1 steps run at once whatever the number of workers.
      max_clock_lead: stale-synchronous parallel s (Ho et al., NIPS'13; None: not
        used): a worker's clock is its count of ended steps, and it starts a step only
        while its clock is at most s ahead of the slowest live worker's, so about
        ``(s + 1) x num_workers`` steps run at once; an applied update is then at most
        ``(num_workers - 1) x (2s + 1)`` updates stale. A lost worker no longer holds
        the others back. Asynchronous mode only; not with ``max_staleness``.
      token_timeout: seconds a token wait may last (token-gated mode) before the step
        fails with a clear error.
      skip_stale_tokens: token-gated mode: a worker drops tokens older than
        ``global_step`` instead of computing a gradient that would be dropped (False:
        TensorFlow's FIFO exactly).
      max_attempts: workers a step is tried on before it fails.
      carrier: ``"embedded"`` (threads in this process) or ``"ray"``.
      min_slice_bytes: ``"size_balanced"`` placement's smallest slice of a split leaf.
      ray_worker_options: ``carrier="ray"``: the worker actors' Ray options (a dict for
        every worker, or a function of the worker's index returning one), merged with
        the defaults: e.g. ``{"num_gpus": 1}`` for GPU workers (``num_gpus`` >=
        ``num_replicas_in_sync``; without it a worker runs on CPU with that many
        simulated devices), ``{"resources": {"worker_node": 1}}``, a
        ``scheduling_strategy``, a ``runtime_env``, ``max_restarts`` (default -1: a worker
        whose process died is restarted, every time, and given steps again; 0: lost for
        good). The
        workers' devices are theirs, not this process's: a CPU-only driver can run GPU
        workers. See :mod:`jreplicate.ps.ray.options`.
      ray_shard_options: ``carrier="ray"``: the shard actors' Ray options (as above;
        no ``max_restarts``: a lost shard stops training, see :meth:`restart_shard`).
      axis_name: the name of the replica mesh axis of each worker's sync group (default
        ``jr.REPLICA_AXIS``, ``"replica"``): ``ctx.axis_name`` in the step, over which a
        sync group's collectives run (e.g. ``"batch"`` for a ``jax.pmap`` program's
        ``jax.lax.pmean(x, "batch")`` and ``nnx.BatchNorm(axis_name="batch")``). See
        :class:`jreplicate.MirroredStrategy`.
      max_worker_restarts: ``carrier="embedded"``: how many times each lost worker
        (its step raised a worker failure, e.g. ``jreplicate.testing.kill_worker``) is
        replaced by a new worker with its index, its devices and its ``PER_WORKER``
        input where the lost one left off (default None: every time, as Ray's
        ``max_restarts=-1``; 0: lost for good). On Ray use ``ray_worker_options=
        {"max_restarts": n}``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jreplicate as jr
      >>> strategy = jr.ParameterServerStrategy(num_ps=2)
      >>> rep = jr.Replicator(strategy)
      >>> with rep.scope():
      ...     w = jnp.zeros(2)
      ...     tx = jr.ps.pushable(optax.sgd(0.5))
      ...     opt = tx.init(w)
      >>> def step(ctx, w, opt):
      ...     g = jax.grad(lambda w: jnp.sum(w - 1.0))(w)
      ...     u, opt = tx.update(g, opt, w)
      ...     return optax.apply_updates(w, u), opt
      >>> for _ in range(4):  # keep a RemoteValue only to fetch it: each holds outputs
      ...     last = rep.run(step, None, w, opt)
      >>> rep.join()
      >>> strategy.parameters().tolist(), strategy.ledger()[0]["applied"]
      ([-2.0, -2.0], 4)
      >>> last.fetch()[0].shape  # the step's outputs (here the parameters it started from)
      (2,)

      With Ray (creating the strategy starts nothing; the actors are created by
      ``tx.init`` inside ``rep.scope()``, on the cluster of ``ray.init(address=...)``),
      two GPU workers of two replicas each from a driver without GPUs, and the shards on
      the nodes that offer a ``ps_node`` resource:

      >>> ray_strategy = jr.ParameterServerStrategy(
      ...     num_ps=2, num_workers=2, num_replicas_in_sync=2, carrier="ray",
      ...     ray_worker_options={"num_gpus": 2, "num_cpus": 1},
      ...     ray_shard_options={"resources": {"ps_node": 1}})
      >>> ray_strategy.num_replicas, ray_strategy.num_workers
      (4, 2)
      >>> jr.ParameterServerStrategy(carrier="ray", ray_worker_options={"num_gpu": 1})
      Traceback (most recent call last):
      ValueError: ParameterServerStrategy(ray_worker_options=...): ['num_gpu'] are not ...
    """

    def __init__(self, num_ps: int = 1, num_workers: int | None = None, *,
                 num_replicas_in_sync: int = 1, devices: Sequence[jax.Device] | None = None,
                 placement: str = "size_balanced", max_staleness: int | None = None,
                 max_clock_lead: int | None = None,
                 token_timeout: float = 60.0, skip_stale_tokens: bool = True,
                 max_attempts: int = 4, carrier: str = "embedded",
                 min_slice_bytes: int = 256 << 10,
                 ray_worker_options: dict | Callable[[int], dict] | None = None,
                 ray_shard_options: dict | Callable[[int], dict] | None = None,
                 axis_name: str = REPLICA_AXIS, max_worker_restarts: int | None = None):
        a = check_arguments(
            num_ps=num_ps, num_workers=num_workers, num_replicas_in_sync=num_replicas_in_sync,
            devices=devices, placement=placement, max_staleness=max_staleness,
            max_clock_lead=max_clock_lead, token_timeout=token_timeout,
            max_attempts=max_attempts, carrier=carrier, axis_name=axis_name,
            max_worker_restarts=max_worker_restarts)
        num_ps, g, devs, axis = a.num_ps, a.num_replicas_in_sync, a.devices, a.axis_name
        num_workers = a.num_workers
        self.shard_devices, self.worker_devices = assign_devices(
            devs, num_ps, num_workers, g, carrier)
        self._ray_options = self._check_ray_options(ray_worker_options, ray_shard_options,
                                                    carrier, num_ps, g)
        warn_if_gpus_unused(self._ray_options[0], devs[0].platform, g)
        self.num_ps = num_ps
        self.max_staleness = a.max_staleness
        self.max_clock_lead = a.max_clock_lead
        self.token_timeout = a.token_timeout
        self.skip_stale_tokens = bool(skip_stale_tokens)
        self.max_attempts = a.max_attempts
        self.max_worker_restarts = a.max_worker_restarts
        self.carrier = carrier
        self.placement_policy = placement
        self.min_slice_bytes = int(min_slice_bytes)
        if carrier == "ray":
            # The replicas' devices are the worker actors'; this process's mesh (where
            # e.g. a CheckpointManager places what it restores) is one of its devices.
            mesh = replica_mesh(devs[:1], 1, "ParameterServerStrategy", axis)
            replicas = tuple((devs[0],) for _ in range(len(self.worker_devices) * g))
        else:
            mesh = replica_mesh(list(self.worker_devices[0]), 1, "ParameterServerStrategy",
                                axis)
            replicas = tuple((d,) for grp in self.worker_devices for d in grp)
        self._layout = Layout(
            mesh=mesh, replica_axis=axis, model_axes=(MODEL_AXIS,),
            replica_devices=replicas,
            num_replicas_in_sync=g, local_replica_ids=tuple(range(g)), num_processes=1,
            process_index=0)
        self._executor: ParameterServerExecutor | None = None

    def _check_ray_options(self, worker_opts: Any, shard_opts: Any, carrier: str,
                           num_ps: int, g: int) -> tuple[tuple, tuple]:
        """The checked Ray options of each worker and shard actor."""
        if carrier != "ray":
            for name, v in (("ray_worker_options", worker_opts),
                            ("ray_shard_options", shard_opts)):
                if v is not None:
                    raise ValueError(f"ParameterServerStrategy({name}=...) applies to Ray's "
                                     f"actors; pass carrier='ray' (carrier={carrier!r}).")
            return (), ()
        return (resolve_ray_options("ray_worker_options", worker_opts,
                                    len(self.worker_devices), g),
                resolve_ray_options("ray_shard_options", shard_opts, num_ps))

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def num_workers(self) -> int:
        """The number of workers (sync groups), as given by ``num_workers=`` or the
        default that fits the devices; each has ``num_replicas_in_sync`` replicas."""
        return len(self.worker_devices)

    def make_executor(self) -> ParameterServerExecutor:
        if self._executor is not None:
            raise ValueError("a ParameterServerStrategy serves one Replicator (its shards "
                             "hold that Replicator's parameters); create a new strategy.")
        self._executor = ParameterServerExecutor(PSConfig(
            num_ps=self.num_ps, shard_devices=tuple(self.shard_devices),
            worker_devices=tuple(tuple(g) for g in self.worker_devices),
            num_replicas_in_sync=self.num_replicas_in_sync, layout=self.layout,
            carrier=self.carrier, max_staleness=self.max_staleness,
            max_clock_lead=self.max_clock_lead,
            max_attempts=self.max_attempts, token_timeout=self.token_timeout,
            skip_stale_tokens=self.skip_stale_tokens,
            placement_policy=self.placement_policy, min_slice_bytes=self.min_slice_bytes,
            ray_worker_options=self._ray_options[0], ray_shard_options=self._ray_options[1],
            max_worker_restarts=self.max_worker_restarts))
        return self._executor

    def create_per_worker_value(self, fn: Callable[[WorkerContext], Any]) -> PerWorkerValue:
        """A value built once on each worker by ``fn``, as TensorFlow's per-worker
        resources (``PerWorkerValues``): pass it to ``rep.run(step, ...)`` as an
        argument and the step receives the value of the worker that runs it.

        Args:
          fn: called on each worker (its thread, or its Ray actor), at the first step
            there that takes the value, with a :class:`jreplicate.ps.WorkerContext`
            (``worker_index``, ``num_workers``, ``num_replicas_in_sync``); returns a
            pytree of arrays (read only: the step takes it as any argument). Never
            called on the driver.

        Returns:
          A :class:`jreplicate.ps.PerWorkerValue`; the workers let their values go when
          it is collected (after the last step scheduled with it).

        Raises:
          TypeError: ``fn`` is not callable.
          ValueError: the strategy has no Replicator yet (``jr.Replicator(strategy)``).
        """
        return self._per_worker_executor("create_per_worker_value", fn).per_worker_value(fn)

    def create_per_worker_state(self, fn: Callable[[WorkerContext], Any]) -> PerWorkerState:
        """Per-worker state a step updates, as TensorFlow's per-worker variables: built
        on each worker by ``fn`` (as :meth:`create_per_worker_value`); passed to
        ``rep.run(step, ...)``, the step receives its worker's state and returns the
        new one as ``jr.ps.update_worker_state(new)`` among its outputs. The new state
        is kept exactly when the step succeeds (a failed, cancelled or lost step leaves
        it unchanged); ``state.read()`` / ``state.read("sum")`` read it on the driver.
        Not in :meth:`state` (checkpoints): a replaced or restored worker rebuilds it
        with ``fn``. The rules: :mod:`jreplicate.ps.per_worker`.

        Args:
          fn: called on each worker (never on the driver) with a
            :class:`jreplicate.ps.WorkerContext`; returns the initial state, a pytree of
            arrays (kept in JAX's dtypes: float64 as float32 unless x64 is enabled).

        Returns:
          A :class:`jreplicate.ps.PerWorkerState`; the workers let their states go when
          it is collected (after the last step scheduled with it).

        Raises:
          TypeError: ``fn`` is not callable.
          ValueError: the strategy has no Replicator yet (``jr.Replicator(strategy)``).
        """
        return self._per_worker_executor("create_per_worker_state", fn).per_worker_state(fn)

    def _per_worker_executor(self, name: str, fn: Any) -> Any:
        """The executor that builds a per-worker value or state of ``fn``, after the
        checks both share."""
        if not callable(fn):
            raise TypeError(f"{name}(fn): fn must be callable (called on each worker with "
                            f"a WorkerContext), got {type(fn).__name__}.")
        if self._executor is None:
            raise ValueError(f"{name}: create the Replicator first "
                             "(rep = jr.Replicator(strategy)).")
        return self._executor

    # -- inspection and control ------------------------------------------------------------
    def _ex(self) -> ParameterServerExecutor:
        if self._executor is None or self._executor.client is None:
            raise ValueError(
                "ParameterServerStrategy: no parameters yet. Create the optimizer state "
                "with tx = jr.ps.pushable(optax...); tx.init(params) inside rep.scope().")
        return self._executor

    @property
    def placement(self) -> Placement:
        """Which shard holds which parameter leaf.

        ``strategy.placement.shard_of(path)`` is the shard of the leaf at ``path`` (a list
        of shards for a leaf split into slices)."""
        return self._ex().placement

    def parameters(self) -> Any:
        """The current parameters, pulled from the shards (numpy pytree)."""
        return self._ex().client.pull()[1]

    @property
    def global_step(self) -> int:
        """Shard 0's step, the updates it applied (async) or ``global_step`` (token-gated)."""
        return self._ex().shard_step(0)

    def ledger(self) -> list[dict[str, Any]]:
        """Each shard's ledger summary: pushes, applied, stale, backup, duplicate, failed
        (a shard's update raised: :class:`jreplicate.ps.ShardUpdateError`) and the
        staleness histogram ``{staleness: count}``."""
        return [self._ex().shard_summary(i) for i in range(self.num_ps)]

    def staleness_histogram(self) -> dict[int, int]:
        """Shard 0's histogram of the staleness of applied updates."""
        return self.ledger()[0]["staleness"]

    def stats(self) -> dict[str, Any]:
        """Scheduling counters: scheduled, completed, completed_by (per worker),
        rescheduled, alive, replaced (lost workers that came back: Ray restarted their
        actors, or the embedded carrier made new ones, ``max_worker_restarts``),
        max_alongside (the most steps one step ran alongside: a bound on the staleness
        of its update, at most ``max_staleness``), max_clock_lead (``max_clock_lead``: the
        largest clock lead over the slowest live worker with which a worker started a
        step, at most ``max_clock_lead``), finish_times (per worker,
        ``time.monotonic()`` of each of its latest 1000 completed steps)."""
        c = self._ex().coordinator
        st = c.stats()
        return {"scheduled": st.scheduled, "completed": st.completed,
                "completed_by": list(st.completed_by), "rescheduled": st.rescheduled,
                "alive": c.alive, "replaced": st.replaced, "max_alongside": st.max_alongside,
                "max_clock_lead": st.max_clock_lead,
                "finish_times": [list(t) for t in st.finish_times]}

    def state(self) -> dict[str, Any]:
        """Every shard's state and ledger as numpy, for
        :class:`jreplicate.CheckpointManager`: a consistent snapshot, every shard at the
        step its ledger records, with the record of the job's steps (``"steps"``: which
        of its last step ids were skipped, and the timeline it is on; fixed-size arrays,
        see :mod:`jreplicate.ps.fate.record`) and the parameters' names (``"names"``: a
        CRC-32 of each path, so that :meth:`restore` refuses parameters renamed or
        reordered since). Workers hold no state: it restores into a job with other
        workers, devices or carrier, and the same ``num_ps``.

        Raises:
          RuntimeError: steps are scheduled or running; call ``rep.join()`` first.
        """
        return self._ex().snapshot()

    def restore(self, state: dict[str, Any]) -> None:
        """Loads :meth:`state`'s output (e.g. from a checkpoint) into the shards (new
        shards and workers; also after a lost shard stopped training)."""
        self._ex().restore(state)

    def restart_shard(self, shard: int, state: dict[str, Any]) -> ShardRestart:
        """Brings a lost shard back from a saved state; training may go on.

        A lost shard stops training: ``rep.join()`` raises
        :class:`jreplicate.ps.ParameterServerError`. Then ``restart_shard(i, state)``, with
        ``state`` a :meth:`state` saved earlier (e.g. restored from a
        :class:`jreplicate.CheckpointManager`), recreates shard ``i`` (a new Ray actor,
        with its ``ray_shard_options``) holding that state's parameters, optimizer
        state, step and ledger, while the other shards keep theirs, and new steps run
        again. Asynchronous training only (a token-gated job restores every shard with
        :meth:`restore`).

        Nothing is silently lost or applied twice: the updates shard ``i`` applied after
        the save are gone with it (the other shards still hold theirs), and the report
        names them (``lost``: the step ids another shard decided that the restarted
        shard's ledger has not, less the skipped steps, which applied nothing: also
        those skipped before a state this job was restored from, which its record
        keeps). ``ledger()[i]`` counts what the restarted shard holds: the saved counts
        plus what it applies from now on. See :mod:`jreplicate.ps.shard_restart`.

        Args:
          shard: the lost shard's index.
          state: a :meth:`state` of this job (same ``num_ps`` and placement).

        Returns:
          A :class:`jreplicate.ps.shard_restart.ShardRestart`: the shard, its step as
          saved, and the lost step ids.

        Raises:
          RuntimeError: steps are scheduled or running (call ``rep.join()`` first).
          ValueError: token-gated training, a shard index out of range, a shard that is
            not lost (restore every shard with :meth:`restore`), a state whose shard
            does not match this one (names the piece or optimizer-state leaf), or a
            state not of this job's timeline (saved on one that :meth:`restore` went
            back from), before the history the job keeps (the last 65,536 step ids),
            or without a record of its steps (an earlier jreplicate's); nothing is
            changed then.
        """
        return self._ex().restart_shard(shard, state)

    def shutdown(self) -> None:
        """Stops the workers and shards (pending steps are cancelled)."""
        if self._executor is not None:
            self._executor.shutdown()

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy(num_ps={self.num_ps}, num_workers="
                f"{self.num_workers}, num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"carrier={self.carrier!r})")
