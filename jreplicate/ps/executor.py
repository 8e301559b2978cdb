"""The executor of :class:`jreplicate.ParameterServerStrategy`: registration of the
parameters (``tx.init`` inside ``rep.scope()``), scheduling of steps as closures, and
the carrier (embedded or Ray) holding shards and workers."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jreplicate._tree import host_copy, read_now
from jreplicate.context import PerReplica
from jreplicate.execution.base import Executor
from jreplicate.input.iterator import InputIterator
from jreplicate.ps import capture, saved_state
from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import HostBatch
from jreplicate.ps.config import PSConfig
from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.embedded import EmbeddedCarrier
from jreplicate.ps.fate import (
    StepRecord,
    check_history,
    ids_to_ask,
    judge_live,
    lost_updates,
    settle_restart,
)
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.handle import Carrier
from jreplicate.ps.per_worker import PerWorkerState, PerWorkerValue
from jreplicate.ps.placement import Placement, place_parameters
from jreplicate.ps.remote import ParameterServerError, RemoteValue
from jreplicate.ps.shard_restart import (
    ShardRestart,
    check_shard_state,
    host_shard_state,
)
from jreplicate.ps.shard_update import _is_sync, check_transformation
from jreplicate.ps.step_builder import StepBuilder
from jreplicate.ps.worker_input import (
    WorkerInputIterator,
    ZippedWorkerInputs,
)

_log = logging.getLogger("jreplicate")


class ParameterServerExecutor(Executor):
    """Schedules steps on the workers of a :class:`ParameterServerStrategy`, built from
    its frozen :class:`PSConfig`."""

    def __init__(self, config: PSConfig):
        super().__init__(config.layout)
        self.config = config
        self.client: ShardClient | None = None
        self.placement: Placement | None = None
        self.coordinator: Coordinator | None = None
        self.next_id = 0
        self._tx = None
        self._carrier: Carrier | None = None
        self._steps = StepBuilder(on_function_freed=self._function_freed)

    # -- registration (tx.init inside scope) -------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        token = capture.REGISTRY.set(self)
        try:
            yield
        finally:
            capture.REGISTRY.reset(token)

    def register(self, tx: Any, params: Any, opt_state: Any) -> None:
        if self._tx is not None:
            if tx is self._tx:
                return
            raise ValueError(
                "ParameterServerStrategy holds one optimizer: a second jr.ps.pushable "
                "transformation was initialised inside rep.scope(). Use one (e.g. "
                "optax.multi_transform for parts of the parameters).")
        s = self.config
        for name in ("max_staleness", "max_clock_lead"):
            if getattr(s, name) is not None and _is_sync(opt_state):
                raise ValueError(
                    f"ParameterServerStrategy({name}={getattr(s, name)}) bounds the "
                    "staleness of asynchronous updates; a sync_replicas transformation is "
                    f"token-gated (no stale gradient is applied). Drop {name}, or use a "
                    "plain optax transformation.")
        if "flax.nnx" in sys.modules:  # nnx.Optimizer passes a State of Variables
            from flax import nnx
            if isinstance(params, nnx.State):
                params = nnx.as_pure(params)
        # Copies of NumPy leaves (a jax.Array's view is immutable): the shards may alias
        # what they are given on CPU, and the caller may write to its arrays later.
        host = jax.tree.map(host_copy, params)
        self.placement = place_parameters(host, s.num_ps, s.placement_policy,
                                          min_slice_bytes=s.min_slice_bytes)
        self._tx = tx
        self._steps.register(params, opt_state)
        self._opt_keep = (params, opt_state)  # ids stay valid while held
        pieces = self.placement.split(host)
        for i, piece in enumerate(pieces):  # here, before any shard (or actor) is made
            check_transformation(i, tx, piece, [p.path for p in self.placement.parts
                                                if p.shard == i])
        # The workers' copy of the state, as registered (restore builds them from it).
        self._opt_host = jax.tree.map(host_copy, opt_state)
        self._build(pieces, self._opt_host)

    def _build(self, pieces: list, opt_host: Any, restored: list | None = None,
               record: StepRecord | None = None) -> None:
        s = self.config
        if s.carrier == "ray":
            from jreplicate.ps.ray.carrier import RayCarrier
            self._carrier = RayCarrier(s, self._tx, self.placement, pieces, opt_host,
                                       restored, faults=FaultPlan())
        else:
            self._carrier = EmbeddedCarrier(s, self._tx, self.placement, pieces,
                                            opt_host, restored, faults=FaultPlan())
        self.client = self._carrier.client
        self.coordinator = Coordinator(
            self._carrier, depth=self._carrier.depth, max_staleness=s.max_staleness,
            max_clock_lead=s.max_clock_lead, max_attempts=s.max_attempts, record=record)
        self._carrier.set_live_workers(lambda: sum(self.coordinator.alive))

    def shard_step(self, i: int) -> int:
        """Shard ``i``'s step: updates applied (async) or ``global_step`` (token-gated)."""
        return self._carrier.shard_step(i)

    def shard_summary(self, i: int) -> dict[str, Any]:
        """Shard ``i``'s ledger summary."""
        return self._carrier.shard_summary(i)

    # -- fault injection (reached through jreplicate.testing) ---------------------------
    def _worker_index(self, w: int) -> int:
        if not 0 <= w < self.config.num_workers:
            raise ValueError(f"worker={w} is not in [0, {self.config.num_workers}).")
        return w

    def kill_worker(self, w: int, when: str) -> None:
        """Worker ``w`` dies during its next step (``"compute"``, ``"push"``) or now
        (Ray only: ``"process"``, for good; ``"crash"``, its process killed and restarted
        by Ray)."""
        allowed = ("compute", "push", "process", "crash") if self.config.carrier == "ray" \
            else ("compute", "push")
        if when not in allowed:
            raise ValueError(f"kill_worker(when={when!r}) must be one of {allowed}.")
        self._carrier.kill_worker(self._worker_index(w), when)

    def set_worker_delay(self, w: int, seconds: float) -> None:
        """Worker ``w`` spends ``seconds`` more on each step."""
        seconds = float(seconds)
        if not seconds >= 0.0:  # (NaN too; time.sleep would raise in the worker: lost)
            raise ValueError(f"set_worker_delay(seconds={seconds!r}): a worker's delay is "
                             "seconds >= 0; pass 0.0 for none.")
        self._carrier.set_worker_delay(self._worker_index(w), seconds)

    def kill_shard(self, i: int) -> None:
        """Shard ``i`` is lost (its state is gone)."""
        if not 0 <= i < self.config.num_ps:
            raise ValueError(f"shard={i} is not in [0, {self.config.num_ps}).")
        self._carrier.kill_shard(i)

    def snapshot(self) -> dict[str, Any]:
        """Every shard's state and ledger (see :func:`jreplicate.ps.saved_state.snapshot`).

        Raises:
          RuntimeError: steps are scheduled or running (call ``rep.join()`` first), or
            the shards are not at one step.
        """
        return saved_state.snapshot(self.coordinator, self._carrier, self.config.num_ps,
                                    self.client.token_gated, self.next_id, self.placement)

    def restore(self, state: dict[str, Any]) -> None:
        if self.coordinator is None:
            raise ValueError("restore: create the optimizer state inside rep.scope() first.")
        try:
            self.coordinator.join()
        except ParameterServerError as e:
            # A lost shard stopped training, and restoring every shard is the fix its
            # error names: join ended the steps (their RemoteValues hold the error).
            _log.debug("restore: the steps ended with %s; restoring every shard", e)
        restored, next_id, record = saved_state.read_state(state, self.config.num_ps)
        saved_state.check_names(state, self.placement, "restore(state)")
        # Checked before anything is replaced: a refused state leaves the shards as they are.
        saved_state.check_restorable(
            restored, self.placement.split(jax.tree.map(np.asarray, self._opt_keep[0])),
            self._tx, self._opt_host)
        self.coordinator.shutdown()
        self._carrier.close(why="strategy.restore replaced the worker actors; fetch the "
                                "outputs you need before restoring")
        # The state's record of its steps (which were skipped, on which timeline) is the
        # job's; ids from next_id on are given to new steps, in a new epoch.
        self.next_id = next_id
        self._build([r["params"] for r in restored], self._opt_host, restored, record)

    def restart_shard(self, i: int, state: dict[str, Any]) -> ShardRestart:
        """Shard ``i`` back from ``state["shards"][i]`` (see
        :mod:`jreplicate.ps.shard_restart`); training may go on."""
        if self.coordinator is None:
            raise ValueError("restart_shard: create the optimizer state inside rep.scope() "
                             "first.")
        if not 0 <= i < self.config.num_ps:
            raise ValueError(f"restart_shard(shard={i}): not in [0, {self.config.num_ps}).")
        if self.client.token_gated:
            raise ValueError(
                "restart_shard: token-gated training keeps every shard at one global_step; "
                "restore every shard from the saved state with strategy.restore(state).")
        if self.coordinator.pending:
            raise RuntimeError(
                f"restart_shard: {self.coordinator.pending} steps are scheduled or running; "
                "call rep.join() first (it raises the shard's loss), then restart_shard.")
        shards = state["shards"]
        if len(shards) != self.config.num_ps:
            raise ValueError(f"restart_shard: the state has {len(shards)} shards, this "
                             f"strategy {self.config.num_ps}; pass a state of this job "
                             "(same num_ps).")
        saved_state.check_names(state, self.placement, f"restart_shard({i}, state)")
        record = self.coordinator.record
        check_history(i, state, record, self.next_id)
        saved = host_shard_state(shards[i])
        here = self.placement.split(jax.tree.map(np.asarray, self._opt_keep[0]))[i]
        check_shard_state(i, saved, here, jax.eval_shape(self._tx.init, here) if here
                          else None)
        if not self._carrier.shard_lost(i):
            raise ValueError(
                f"restart_shard({i}, state): shard {i} is not lost; rolling it back alone "
                "would leave it behind the other shards. Restore every shard with "
                "strategy.restore(state).")
        live: dict[int, dict[str, Any]] = {}
        for j in range(self.config.num_ps):
            if j != i:
                try:
                    live[j] = self._carrier.shard_state(j)["ledger"]
                except Exception:  # lost too: restart it as well
                    _log.debug("executor: lost too: restart it as well", exc_info=True)
        # The live shards must agree (checked before anything is replaced); the steps
        # that ended while a shard was lost without any shard deciding them are skipped.
        undecided = self._check_live_shards(i, live)
        lost = lost_updates(shards[i]["ledger"], list(live.values()), record, self.next_id)
        for pid in undecided:
            self.client.skip(pid)  # (the restarted shard: below, with the skipped)
        # No step is pending and every id below next_id has ended: the record and the
        # restarted shard's ledger are brought up to it (see settle_restart).
        settle_restart(record, saved["ledger"], undecided, lost, self.next_id)
        self._carrier.restart_shard(i, saved)
        self.coordinator.resume()
        return ShardRestart(i, saved["step"], lost)

    def _check_live_shards(self, i: int, live: dict[int, dict[str, Any]]) -> list[int]:
        """restart_shard(i): the ids below ``next_id`` that no live shard decided (their
        steps ended, pushing nowhere, while a shard was lost: to skip), after checking
        that the live shards (``live``: their ledgers' arrays) decided the same ids.

        Raises:
          ValueError: a step's push is on some live shards only (a shard was lost in the
            middle of it): restarting shard ``i`` would keep the shards disagreeing.
        """
        if self.coordinator.pending:
            return []
        marks = [int(np.asarray(led["watermark"])) for led in live.values()]
        lo = min([self.coordinator.completed_ids.watermark, *marks])
        hi = self.next_id
        if lo >= hi:
            return []
        record = self.coordinator.record
        undecided = []
        for pid in ids_to_ask(live.values(), lo, hi, record.was_skipped,
                              record.completed_ids.seen):
            fate, yes, no = judge_live(self.client.decided(pid), live,
                                       record.was_skipped(pid), record.completed_ids.seen(pid))
            if fate == "half":
                msg = (f"restart_shard({i}, state): step {pid}'s push is on shard(s) {yes} "
                       f"and not on shard(s) {no} (a shard was lost in the middle of it), "
                       "so the live shards' parameters disagree; restarting shard "
                       f"{i} would keep that. Restore every shard from the saved state "
                       "with strategy.restore(state).")
                self.coordinator.half_applied.setdefault(pid, msg)
                raise ValueError(msg)
            if fate == "undecided":
                undecided.append(pid)
        return undecided

    # -- input read on the workers (PER_WORKER) -----------------------------------------
    def per_worker_input(self, owner: object, input_fn: Callable, *,
                         partial_batch: str = "drop") -> WorkerInputIterator:
        """The iterator of ``prepare_input(input_fn)`` in ``PER_WORKER`` mode: each
        worker builds and reads its own pipeline (:mod:`jreplicate.ps.worker_input`)."""
        if partial_batch != "drop":
            raise ValueError(
                f"prepare_input(partial_batch={partial_batch!r}) under "
                "ParameterServerStrategy with InputReplicationMode.PER_WORKER: each worker "
                "drops its own final partial batch; padding needs the driver-fed path "
                "(replication_mode=InputReplicationMode.SINGLE).")
        return WorkerInputIterator(owner, self.config, self, input_fn)

    def release_input(self, key: int, now: bool = False) -> None:
        """The iterator of input ``key`` was closed (``now``) or collected: every worker
        frees its pipeline (may run on any thread, as a finalizer: never blocks)."""
        if self._carrier is not None:
            self._carrier.release_input(key, now=now)

    def per_worker_value(self, fn: Callable) -> PerWorkerValue:
        """``strategy.create_per_worker_value(fn)`` (see :mod:`jreplicate.ps.per_worker`)."""
        return PerWorkerValue(fn, self.config.num_workers, self.release_value)

    def per_worker_state(self, fn: Callable) -> PerWorkerState:
        """``strategy.create_per_worker_state(fn)`` (see :mod:`jreplicate.ps.per_worker`)."""
        return PerWorkerState(fn, self.config.num_workers, self.release_value,
                              self.read_value)

    def read_value(self, key: int) -> list:
        """Each worker's per-worker state of ``key`` (NumPy; None where it holds none)."""
        if self._carrier is None:
            return [None] * self.config.num_workers
        return self._carrier.read_value(key)

    def release_value(self, key: int) -> None:
        """The PerWorkerValue of ``key`` was collected: every worker lets its value go
        (a finalizer: never blocks)."""
        if self._carrier is not None:
            self._carrier.release_value(key)

    def zip_inputs(self, owner: object, iterators: tuple) -> ZippedWorkerInputs:
        """``rep.run(step, (it1, it2, ...))``: a step reading the next element of each
        per-worker iterator (:class:`ZippedWorkerInputs`).

        Raises:
          TypeError: one of them is not a per-worker iterator of this strategy.
        """
        bad = [f"inputs[{i}] ({type(it).__name__}"
               + (", InputReplicationMode.SINGLE)" if isinstance(it, InputIterator) else ")")
               for i, it in enumerate(iterators) if not isinstance(it, WorkerInputIterator)]
        if bad:
            raise TypeError(
                "Replicator.run(fn, (it1, it2, ...)) under ParameterServerStrategy reads "
                "several per-worker iterators (rep.prepare_input(input_fn) with "
                "InputReplicationMode.PER_WORKER, the default); not "
                f"{', '.join(bad)}. Prepare each with PER_WORKER, or combine the inputs "
                "in one input_fn.")
        return ZippedWorkerInputs(owner, self, tuple(iterators))

    def sweep_exhausted(self, sweep: tuple) -> bool:
        return self.coordinator is not None and self.coordinator.sweeps.exhausted(sweep)

    def input_exhausted(self, key: int, generation: int) -> bool:
        return self.coordinator is not None and \
            self.coordinator.sweeps.exhausted((key, generation))

    def reset_input(self, key: int, generation: int) -> None:
        if self.coordinator is not None:
            self.coordinator.reset_input(key, generation)

    # -- the executor protocol ---------------------------------------------------------
    def place(self, tree: Any) -> Any:
        return jax.tree.map(read_now, tree)  # (values as of now, as every strategy)

    def assemble(self, elements: Sequence[Sequence[np.ndarray]], treedef: Any) -> Any:
        return HostBatch([list(e) for e in elements], treedef)

    def run(self, fn: Callable, has_batch: bool, batch: Any, args: tuple, *,
            steps: int | None, donate_argnums: tuple[int, ...],
            allow: frozenset = frozenset()) -> RemoteValue:
        if steps is not None:
            raise ValueError(
                "Replicator.run(..., steps=K) under ParameterServerStrategy: device loops "
                "are not supported (each step is one push); call run once per step.")
        if self.coordinator is None:
            raise ValueError(
                "ParameterServerStrategy: the parameters are not on the parameter servers "
                "yet. Create them and the optimizer inside rep.scope(): tx = "
                "jr.ps.pushable(optax.adam(...)); opt_state = tx.init(params).")
        c = self._steps.closure(self.next_id, fn, has_batch, batch, args, donate_argnums,
                                allow)
        rv = self.coordinator.schedule(c)
        # The id is taken only once the step is scheduled: a refused one (a lost shard's
        # error, the end of input, shut down) would be decided by no shard, and every
        # ledger's watermark would stop below it for the rest of the job.
        self.next_id += 1
        return rv

    def _function_freed(self, key: int) -> None:
        """The step function of ``key`` was freed here: the workers let their copies go
        (a Ray worker actor keeps the function it was sent, by key)."""
        if self._carrier is not None:
            self._carrier.forget_function(key)

    def reduce(self, reduce_op: str, value: Any) -> Any:
        if isinstance(value, RemoteValue):
            value.fetch()
            value = value._value
        g = self.layout.num_replicas_in_sync

        def red(x):
            if isinstance(x, PerReplica):
                a = np.asarray(x.array)
                return a.sum(0) if reduce_op == "sum" else a.mean(0)
            return np.asarray(x) * (g if reduce_op == "sum" else 1)

        return jax.tree.map(red, value, is_leaf=lambda x: isinstance(x, PerReplica))

    def local_results(self, value: Any) -> list[Any]:
        return [value.fetch() if isinstance(value, RemoteValue) else value]

    def join(self) -> None:
        if self.coordinator is not None:
            self.coordinator.join()

    def shutdown(self) -> None:
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self._carrier.close()


