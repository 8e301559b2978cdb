"""The executor of :class:`jreplicate.ParameterServerStrategy`: registration of the
parameters (``tx.init`` inside ``rep.scope()``), scheduling of steps as closures, and
the carrier (embedded or Ray) holding shards and workers."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jreplicate import _porting
from jreplicate._tree import host_copy, path_str, read_now, report
from jreplicate.context import PerReplica
from jreplicate.execution.base import Executor
from jreplicate.execution.cache import FunctionMap
from jreplicate.input.iterator import InputIterator
from jreplicate.ps import capture
from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import Closure, HostBatch
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
from jreplicate.ps.nnx_state import NnxArg
from jreplicate.ps.per_worker import PerWorkerState, PerWorkerValue
from jreplicate.ps.placement import Placement, place_parameters
from jreplicate.ps.remote import ParameterServerError, RemoteValue, is_key, to_host
from jreplicate.ps.run_arguments import check_run_arguments
from jreplicate.ps.shard_restart import (
    ShardRestart,
    check_same_aggregation,
    check_shard_state,
    host_shard_state,
)
from jreplicate.ps.shard_update import _is_sync, check_transformation
from jreplicate.ps.worker_input import (
    WorkerInput,
    WorkerInputIterator,
    WorkerInputs,
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
        self._param_ids: tuple | None = None
        self._opt_ids: tuple | None = None
        self._tx = None
        self._carrier: Carrier | None = None
        self._fn_keys = FunctionMap(on_drop=self._function_freed)
        self._nnx_cache: dict[int, tuple] = {}  # id -> (weakref to node, treedef, leaves, NnxArg)
        self._next_key = 0
        self._warned_donation = False

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
        self._param_ids = tuple(id(x) for x in jax.tree.leaves(params))
        self._opt_ids = tuple(id(x) for x in jax.tree.leaves(opt_state))
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
        """Every shard's state and ledger, taken while no step is scheduled or running
        (so no push moves a shard between two shards' reads).

        Raises:
          RuntimeError: steps are scheduled or running (call ``rep.join()`` first), or
            the shards are not at one step (token-gated).
        """
        c = self.coordinator
        pending = c.pending
        if pending:
            raise RuntimeError(
                f"ParameterServerStrategy.state(): {pending} steps are scheduled or running, "
                "so the shards may be at different steps. Call rep.join() first, then "
                "state().")
        shards = [self._carrier.shard_state(i) for i in range(self.config.num_ps)]
        if c.pending:
            raise RuntimeError(
                "ParameterServerStrategy.state(): steps were scheduled while the shards "
                "were read; call rep.join() first and schedule no steps meanwhile.")
        if c.half_applied:
            sid, why = next(iter(c.half_applied.items()))
            raise RuntimeError(
                f"ParameterServerStrategy.state(): the shards disagree (step {sid}'s push "
                f"is on some shards only: {why}); saving them would keep it. Restore the "
                "last checkpoint with strategy.restore(state).")
        steps = [int(sh["step"]) for sh in shards]
        if self.client.token_gated and len(set(steps)) > 1:
            raise RuntimeError(
                f"ParameterServerStrategy.state(): the shards are at global steps {steps}; "
                "a push is half committed (a worker lost mid-push whose step never ran "
                "again). Restore the last checkpoint.")
        return {"shards": shards, "next_step_id": np.array(self.next_id, np.int32),
                "steps": c.record.to_arrays(self.next_id)}

    def restore(self, state: dict[str, Any]) -> None:
        if self.coordinator is None:
            raise ValueError("restore: create the optimizer state inside rep.scope() first.")
        try:
            self.coordinator.join()
        except ParameterServerError:
            # A lost shard stopped training, and restoring every shard is the fix its
            # error names: join ended the steps (their RemoteValues hold the error).
            pass
        try:
            shards, next_id = state["shards"], int(np.asarray(state["next_step_id"]))
            if len(shards) != self.config.num_ps:
                raise ValueError(f"restore: the state has {len(shards)} shards, this "
                                 f"strategy {self.config.num_ps}; restore with the same "
                                 "num_ps.")
            restored = [host_shard_state(sh) for sh in shards]
            # (a state saved before the record was: the ids before it are all ended,
            # which of them were skipped is unknown)
            record = StepRecord.from_arrays(state["steps"], next_id) if "steps" in state \
                else StepRecord(next_id)
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(
                f"restore(state): the state is not a strategy.state() ({type(e).__name__}: "
                f"{e}); pass what ParameterServerStrategy.state() returned (e.g. restored "
                "by a CheckpointManager).") from None
        # Checked before anything is replaced: a refused state leaves the shards as they are.
        here = self.placement.split(jax.tree.map(np.asarray, self._opt_keep[0]))
        for i, r in enumerate(restored):
            check_shard_state(i, r, here[i], jax.eval_shape(self._tx.init, here[i])
                              if here[i] else None, caller="restore(state)")
            if here[i]:
                check_same_aggregation(i, r["opt_state"], self._opt_host, "restore(state)")
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
        if donate_argnums and not self._warned_donation:
            self._warned_donation = True
            warnings.warn(
                f"Replicator.run(..., donate_argnums={tuple(donate_argnums)}) has no effect "
                "under ParameterServerStrategy: the step runs later on a worker, with the "
                "parameters pulled from the shards and copies of the other arguments, so "
                "nothing of the caller's is donated (the worker reuses its own buffers). "
                "The step is run as given; drop donate_argnums here to silence this.",
                UserWarning, stacklevel=3)  # the caller of Replicator.run
        p_idx = o_idx = None
        nnx_pos = self._nnx_positions(args)
        _check_device_axis(args, nnx_pos)
        check_run_arguments(
            None if isinstance(batch, (HostBatch, WorkerInput, WorkerInputs)) else batch,
            args, {*nnx_pos, *(i for i, a in enumerate(args) if isinstance(a, PerWorkerValue))})
        for i, a in enumerate(args):
            if i in nnx_pos:
                if nnx_pos[i] == "model":
                    p_idx = i
                continue
            ids = tuple(id(x) for x in jax.tree.leaves(a))
            if ids == self._param_ids and p_idx is None:
                p_idx = i
            elif ids == self._opt_ids and o_idx is None:
                o_idx = i
        if p_idx is None:
            raise ValueError(
                "Replicator.run under ParameterServerStrategy: none of the step's arguments "
                "is the params passed to tx.init inside rep.scope(). Pass those params "
                "(the shards hold their current values; the worker substitutes them).")
        # The step runs later, on a worker: NumPy values are read now (copied), so that
        # refilling the caller's arrays after run returns never changes the step.
        # (a PerWorkerValue: each worker substitutes its own value)
        args = tuple(self._nnx_arg(a) if i in nnx_pos else None if i in (p_idx, o_idx)
                     else a._arg() if isinstance(a, PerWorkerValue)
                     else jax.tree.map(read_now, a) for i, a in enumerate(args))
        if isinstance(batch, (HostBatch, WorkerInput, WorkerInputs)) or batch is None:
            pass
        else:
            # (a PerReplica's array too: it may be the caller's NumPy array)
            batch = jax.tree.map(lambda x: host_copy(x.array if isinstance(
                x, PerReplica) else x), batch, is_leaf=lambda x: isinstance(x, PerReplica))
        key = self._fn_keys.get(fn)
        if key is None:
            key = self._fn_keys[fn] = self._next_key
            self._next_key += 1
        c = Closure(self.next_id, fn, has_batch, batch, args, p_idx, o_idx, key,
                    allow=allow)
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

    def _nnx_positions(self, args: tuple) -> dict[int, str]:
        """Flax NNX arguments: ``{index: "model"}`` for the module whose parameters the
        shards hold (found by identity), ``"other"`` for the rest (an ``nnx.Optimizer``)."""
        if "flax.nnx" not in sys.modules:
            return {}
        from flax import nnx
        out: dict[int, str] = {}
        wrt = nnx.Param
        for a in args:
            if isinstance(a, nnx.Optimizer):
                wrt = a.wrt
        for i, a in enumerate(args):
            if not nnx.graph.is_graph_node(a):
                continue
            out[i] = "other"
            if not isinstance(a, nnx.Optimizer):
                ids = tuple(id(x) for x in jax.tree.leaves(nnx.as_pure(nnx.state(a, wrt))))
                if ids == self._param_ids:
                    out[i] = "model"
        return out

    def _nnx_arg(self, node: Any) -> NnxArg:
        """The node's graph and numpy state as of this call, as every strategy reads its
        arguments when ``run`` is called: the caller may have changed the node since
        the last step (``model.eval()``, a variable set anew), and the scheduled step
        sees that (the parameters are the shards' all the same).

        The last call's result is reused while the node flattens (flax modules are
        pytrees: several times cheaper than ``nnx.split``) to the same structure and
        the same leaf objects, none of them a NumPy array (which may be refilled in
        place)."""
        leaves, treedef = jax.tree_util.tree_flatten(node)
        hit = self._nnx_cache.get(id(node))
        if hit is not None and hit[0]() is node and hit[1] == treedef and \
                len(hit[2]) == len(leaves) and all(a is b for a, b in zip(hit[2], leaves)):
            return hit[3]
        from flax import nnx
        graphdef, state = nnx.split(node)
        # (a NumPy value copied: the caller may refill it before the step runs; a
        # typed PRNG key, as an nnx.Rngs holds, which NumPy cannot, as a HostKey)
        arg = NnxArg(graphdef, jax.tree.map(
            lambda x: to_host(x) if is_key(x) else host_copy(x), state))
        reusable = not (len(leaves) == 1 and leaves[0] is node) and not any(
            isinstance(x, np.ndarray) for x in leaves)
        ref = None
        if reusable:
            # Held weakly: a node the caller lets go (a fresh nnx.Rngs each step) takes
            # its entry, and the state copied from it, with it.
            cache, key = self._nnx_cache, id(node)
            try:
                ref = weakref.ref(node, lambda r: cache.pop(key, None)
                                  if cache.get(key, (None,))[0] is r else None)
            except TypeError:  # (not weakly referable: not kept)
                ref = None
        if ref is not None:
            self._nnx_cache[id(node)] = (ref, treedef, leaves, arg)
        else:
            self._nnx_cache.pop(id(node), None)
        return arg

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


def _check_device_axis(args: tuple, nnx_pos: dict) -> None:
    """Refuses a plain argument holding state with a leading device axis
    (``flax.jax_utils.replicate``'s; see :func:`jreplicate._porting.device_axis_errors`)."""
    groups, leaves, owners = [], [], []
    for i, a in enumerate(args):
        if i in nnx_pos:
            continue
        xs = jax.tree.leaves(a)
        groups.append((f"argument [{i}]", range(len(leaves), len(leaves) + len(xs))))
        leaves += xs
        owners.append(i)

    def name(k: int) -> str:  # (pytree paths only for an error's message: 20-30 us a run)
        for (label, idx), i in zip(groups, owners):
            if k in idx:
                path = jax.tree_util.tree_flatten_with_path(args[i])[0][k - idx.start][0]
                return f"{label}{path_str(path)}"
        raise IndexError(k)

    report(_porting.device_axis_errors(groups, leaves, name), "Replicator.run")
