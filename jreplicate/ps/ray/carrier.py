"""The Ray carrier of :class:`jreplicate.ParameterServerStrategy` (``carrier="ray"``).

The same shard state machine (:class:`jreplicate.ps.shard.PSShard`) and worker
(:class:`jreplicate.ps.worker.PSWorker`) run inside Ray actors; Ray carries the calls
(no home-made transport) and detects failures:

* each shard is a threaded actor with two concurrency groups: ``"tokens"`` for the
  blocking :meth:`PSShard.take_token` and ``"io"`` for pulls and pushes, so token waits
  never block the pushes that would satisfy them;
* each worker is an actor owning ``num_replicas_in_sync`` devices (CPU actors get that
  many simulated devices; with GPUs, ``num_gpus=num_replicas_in_sync``); it calls the
  shard actors directly;
* the coordinator (this process) calls ``worker.run.remote(closure)``: a dead worker
  actor (``RayActorError``) has its step rescheduled elsewhere; a dead shard actor
  (seen by a worker as ``RayActorError`` inside its task) stops training with
  :class:`jreplicate.ps.ParameterServerError`.

Call ``ray.init(...)`` (e.g. ``ray.init(address="auto")`` on a cluster) before creating
the strategy's parameters, or set ``RAY_ADDRESS``; otherwise :func:`ensure_ray` starts a
private local Ray instance that listens on 127.0.0.1 only, without a dashboard (Ray's
processes exchange pickles: keep them off the network). The actors' resources, placement
and runtime environment come from the strategy's ``ray_worker_options`` and
``ray_shard_options`` (:mod:`jreplicate.ps.ray.options`; by default they ask for no
CPUs, so that they fit any cluster, and a worker runs on CPU). A worker actor whose
process dies is restarted by Ray (``max_restarts``) and given steps again
(:meth:`RayCarrier.replace_worker`); a lost shard can be restarted from a saved state
(:mod:`jreplicate.ps.shard_restart`). Limits: token-gated starvation is detected by the
token deadline (``token_timeout``) only, and workers do not hold back to one gradient
per step (the coordinator does not see their token waits).

Per step (asynchronous, unbounded): one call to the worker actor (``run``; the
function and a ``PER_WORKER`` input function are sent once per actor) and one per
shard (``push_pull``: the push, whose reply carries the shard's parameters after it,
from which the worker's next step starts when that step was queued behind it; arrays
over 1 MiB cross the object store in 1 MiB pieces, :mod:`jreplicate.ps.ray.pieces`). Two
steps are in flight per worker, so a worker never waits for the coordinator. The step's
outputs stay on the worker until ``RemoteValue.fetch`` asks (as numpy); a dropped
RemoteValue lets them go (the worker is told with its next step). Bounded staleness
and token-gated mode run one step per worker at a time and pull before each step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import Closure
from jreplicate.ps.config import PSConfig
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.handle import Carrier
from jreplicate.ps.outcome import (
    ApplicationError,
    Completed,
    Failed,
    Outcome,
    ShardLost,
    WorkerLost,
    from_error,
)
from jreplicate.ps.per_worker import PerWorkerArg
from jreplicate.ps.placement import Placement
from jreplicate.ps.ray.options import is_gpu_worker, shard_actor_options, worker_actor_options
from jreplicate.ps.ray.proxy import _Forgotten, _ray, _ShardLost, _ShardProxy
from jreplicate.ps.remote import (
    ParameterServerError,
    StepCancelledError,
    StepOutputsLostError,
    WorkerLostError,
)
from jreplicate.ps.shard import ShardClosedError
from jreplicate.ps.worker_input import InputEnded, WorkerInput, WorkerInputs, markers

_log = logging.getLogger("jreplicate")


def ensure_ray(**options: Any) -> Any:
    """Ray, initialised: as the caller did, at ``RAY_ADDRESS`` if set (other than
    ``local``), else a private local instance (``address="local"``) whose processes
    listen on 127.0.0.1 only, with no dashboard; ``options`` go to that instance's
    ``ray.init`` (e.g. ``object_store_memory``).

    Ray turns a loopback ``_node_ip_address`` into the machine's network address unless
    its clusters are disabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when Ray is
    imported); the flag is lowered around this ``ray.init`` only, so that a later
    ``ray.init(address=...)`` elsewhere in the program behaves as Ray documents.
    """
    ray = _ray()
    if ray.is_initialized():
        return ray
    # The user's cluster, as Ray reads it; RAY_ADDRESS=local asks Ray for a new local
    # instance, which is the private one below.
    if os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local"):
        with _execs_at_once():
            ray.init(include_dashboard=False, log_to_driver=False)
        return ray
    try:
        from ray._private import ray_constants
        saved = ray_constants.ENABLE_RAY_CLUSTER
    except (ImportError, AttributeError):  # another Ray: its own address rules
        ray_constants, saved = None, None
    if ray_constants is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with _execs_at_once():
            ray.init(address="local", _node_ip_address="127.0.0.1",
                     include_dashboard=False, log_to_driver=False, **options)
    finally:
        if ray_constants is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved
    return ray


@contextlib.contextmanager
def _execs_at_once():
    """Keeps JAX's fork warning ("os.fork() was called ... will likely lead to a
    deadlock") off the output while Ray starts its processes: Ray starts them with
    ``subprocess`` (a fork that execs the new program at once), not the fork that the
    warning is about, which goes on running this process's threads' code."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        yield


def _actor_classes():
    """The actor classes (their module imports Ray, so it is imported only here)."""
    from jreplicate.ps.ray import actors as _ray_actors
    return _ray_actors.ShardActor, _ray_actors.WorkerActor


class HeldOutputs:
    """A step's outputs, held by the worker actor that ran it until
    :meth:`RemoteValue.fetch` asks for them (``resolve``). When this object is dropped
    (its RemoteValue is), the worker is told with its next step to let them go, so a
    loop that keeps no RemoteValue keeps no outputs."""

    def __init__(self, actor: Any, worker: int, step_id: int, drops: collections.deque,
                 closed: list[str] | None = None):
        self.actor, self.worker, self.step_id, self._drops = actor, worker, step_id, drops
        self._closed = closed  # why the carrier closed (its actors killed), once it did

    def resolve(self, timeout: float | None = None) -> Any:
        ray = _ray()
        wait = 300.0 if timeout is None else max(timeout, 0.0)
        try:
            if self._closed:
                # (ray.kill is asynchronous: the actor might still answer for a moment)
                found, out = False, self._closed[0]
            else:
                found, out = ray.get(self.actor.fetch.remote(self.step_id), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"RemoteValue.fetch: the outputs of step {self.step_id} (finished) did not "
                f"come back from worker {self.worker} within {wait} s; call fetch again "
                "with a longer timeout.") from None
        except ray.exceptions.RayActorError as e:
            found, out = False, e
        if not found:
            raise StepOutputsLostError(
                f"the outputs of step {self.step_id} were held by worker {self.worker}, "
                f"which was lost before they were fetched ({out}); fetch the outputs you "
                "need before a worker may fail (strategy.parameters() reads the shards).")
        return out

    def __del__(self):
        self._drops.append(self.step_id)


class RayCarrier(Carrier):
    """Shards and workers as Ray actors (see the module docstring)."""

    def __init__(self, s: PSConfig, tx: Any, placement: Placement, pieces: list, opt_host: Any,
                 restored: list | None, *, faults: FaultPlan | None = None):
        ray = ensure_ray()
        # The faults to inject (tests, benchmarks): each worker actor holds its part,
        # sent again on every change (set_faults) and after Ray restarts it.
        self.faults = FaultPlan() if faults is None else faults
        ShardActor, WorkerActor = _actor_classes()
        g = s.num_replicas_in_sync
        self._config, self._tx = s, tx
        self.shards = [self._new_shard(i, pieces[i], _host_restored(restored, i))
                       for i in range(s.num_ps)]
        gated = bool(ray.get(self.shards[0].token_gated.remote(), timeout=300))
        # Whether a shard's update can raise once it runs (see ShardClient).
        guarded = any(ray.get([a.may_raise.remote() for a in self.shards], timeout=300))
        # The workers' constructor arguments as objects this carrier holds: Ray restarts
        # a worker with them (arguments Ray stored itself may be gone by then).
        self._worker_args = [ray.put(self.shards), ray.put(placement), ray.put(opt_host)]
        shards_ref, placement_ref, opt_ref = self._worker_args
        self.workers = [WorkerActor.options(**worker_actor_options(
            _opts(s.ray_worker_options, w), g)).remote(
            w, shards_ref, placement_ref, gated, opt_ref, g, s.token_timeout,
            s.skip_stale_tokens, guarded, s.layout.replica_axis,
            FaultPlan({w: self.faults.get(w)})) for w in range(s.num_workers)]
        self._check_ready(ray.get([w.ready.remote() for w in self.workers], timeout=300))
        self._check_gpus()
        self.client = ShardClient([_ShardProxy(a) for a in self.shards], placement, gated,
                                  guarded=guarded)
        self._live = lambda: len(self.workers)
        # Asynchronous unbounded training keeps two steps in flight per worker actor, so
        # its task queue never runs dry; the second starts from the parameters its
        # worker's previous push returned (see PSWorker). Bounded staleness admits one
        # step per worker (either form); token-gated steps take a token each.
        self.depth = 2 if not gated and s.max_staleness is None \
            and s.max_clock_lead is None else 1
        if self.depth > 1:
            ray.get([w.return_params.remote() for w in self.workers], timeout=300)
        self._drops = [collections.deque() for _ in self.workers]  # step ids let go
        self._closed: list[str] = []  # why close() ran, once it did: held outputs gone
        #: Per worker: keys of step functions freed here, which its actor lets go.
        self._freed = [collections.deque() for _ in self.workers]
        self._incarnations = ray.get([w.incarnation.remote() for w in self.workers],
                                     timeout=300)
        self._forget: dict[int, Any] = {}  # worker -> forget what its actor held
        # Per worker, input key -> (generation, elements its completed steps read).
        self._positions: list[dict] = [{} for _ in self.workers]
        #: PER_WORKER inputs whose iterator was closed or collected on the driver, and
        #: per worker those its actor has not been told of yet (sent with its next call).
        self._released: set[int] = set()
        self._release = [collections.deque() for _ in self.workers]
        self._release_values = [collections.deque() for _ in self.workers]  # (the same)
        self.num_workers = len(self.workers)
        self.replaces_workers = True  # Ray restarts a worker actor (max_restarts)
        self._starts = [self._runner(w) for w in range(len(self.workers))]

    def start(self, w: int, closure: Closure, on_token_wait: Callable[[bool], None]
              ) -> Callable[[], Outcome]:
        """Sends ``closure`` to worker ``w``'s actor; the wait returns its outcome
        (``on_token_wait`` is not called: live_workers=0 below)."""
        return self._starts[w](closure, on_token_wait)

    def _runner(self, w: int):
        ray = _ray()

        sent: set = set()
        sent_inputs: set = set()  # PER_WORKER input_fns this actor holds (by key)
        sent_values: set = set()  # PerWorkerValue fns this actor holds (by key)
        running = [0]  # steps started on this actor and not yet waited for
        drops, freed, release = self._drops[w], self._freed[w], self._release[w]
        release_values = self._release_values[w]
        self._forget[w] = lambda: (sent.clear(), sent_inputs.clear(), sent_values.clear(),
                                   drops.clear())

        def start(closure, on_token_wait):
            send = closure
            if closure.fn_key in sent:
                send = dataclasses.replace(closure, fn=None)
            read = markers(closure.batch)  # the per-worker inputs it reads (if any)
            for m in read:
                if m.key in self._released:  # closed: not run
                    return functools.partial(from_error, InputEnded(m.key, w, m.generation))
            if any(m.key in sent_inputs for m in read):  # (input_fns sent once)
                sent_read = [dataclasses.replace(m, input_fn=None) if m.key in sent_inputs
                             else m for m in read]
                send = dataclasses.replace(send, batch=sent_read[0] if isinstance(
                    closure.batch, WorkerInput) else WorkerInputs(tuple(sent_read)))
            if running[0]:  # queued behind a step of this actor: it reuses that push's
                send = dataclasses.replace(send, reuse=True)  # returned parameters
            let_go = [drops.popleft() for _ in range(len(drops))]
            forget = [freed.popleft() for _ in range(len(freed))]
            sent.difference_update(forget)
            freeing = [release.popleft() for _ in range(len(release))]
            sent_inputs.difference_update(freeing)
            values = [release_values.popleft() for _ in range(len(release_values))]
            sent_values.difference_update(values)
            if any(isinstance(a, PerWorkerArg) and a.key in sent_values
                   for a in closure.args):  # (each fn sent once, as step functions)
                send = dataclasses.replace(send, args=tuple(
                    dataclasses.replace(a, fn=None) if isinstance(a, PerWorkerArg) and
                    a.key in sent_values else a for a in closure.args))
            # live_workers=0: no "one gradient per worker and step" wait on Ray, where
            # the coordinator does not see token waits to relax it.
            try:
                done = self.workers[w].run.remote(send, 0, let_go, forget, freeing, values)
            except Exception as e:  # nothing was sent: Ray could not serialize the step
                drops.extend(let_go)
                freed.extend(forget)
                release.extend(freeing)
                release_values.extend(values)
                return functools.partial(Failed, TypeError(
                    f"step {closure.step_id} cannot be sent to worker {w}: Ray failed to "
                    f"serialize it ({type(e).__name__}: {e}); its function, arguments and "
                    "input must be picklable (a lock or an open file is not)."))
            running[0] += 1
            keys = [a.key for a in closure.args if isinstance(a, PerWorkerArg)]
            return functools.partial(wait, closure, read, done, keys)

        def wait(closure, read, done, keys=()) -> Outcome:
            """The step's outcome: Ray's errors become outcomes here, in one place."""
            try:
                position = ray.get(done)
                sent_values.update(keys)
                sent.add(closure.fn_key)
                for m in read:
                    sent_inputs.add(m.key)
                for key, at in (position or {}).items():
                    self._positions[w][key] = tuple(at)
                return Completed(HeldOutputs(self.workers[w], w, closure.step_id, drops,
                                             self._closed))
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, _Forgotten):  # restarted while idle: did not run
                    self._refresh(w)
                    self._forget[w]()
                    running[0] += 1  # the resent closure carries its functions
                    return wait(closure, read, self.workers[w].run.remote(closure, 0, []))
                for m in read:  # the actor built the pipeline (or failed to)
                    sent_inputs.add(m.key)
                sent_values.update(keys)  # (it holds their fns)
                if isinstance(cause, _ShardLost):  # a worker found a shard actor dead
                    return ShardLost(cause)
                if isinstance(cause, (ApplicationError, StepCancelledError, InputEnded,
                                      ShardClosedError, ParameterServerError)):
                    cause.__suppress_context__ = True
                    return from_error(cause)
                err = WorkerLostError(f"worker {w}: {type(cause).__name__}: {cause}")
                err.__cause__ = e
                return WorkerLost(err)
            except Exception as e:  # noqa: BLE001 - broad on purpose: RayActorError (the
                # worker's process died) and any other failure of Ray's call are the
                # worker's failure: its step runs again elsewhere
                return WorkerLost(e)
            finally:
                running[0] -= 1

        return start

    def starved(self) -> bool:
        """True: the driver does not see shard 0's token queue (the token deadline,
        ``token_timeout``, detects starvation on Ray)."""
        return True

    def forget_function(self, key: int) -> None:
        """Each worker actor lets the step function of ``key`` go with its next step
        (freed here: no step of it is scheduled, and its key is never used again)."""
        for freed in self._freed:
            freed.append(key)

    def release_input(self, key: int, *, now: bool = False) -> None:
        """Every worker actor frees its pipeline of input ``key``: with its next step,
        or (``now``, from ``close()`` on the driver's thread) by a call of its own, run
        after the steps already sent to it. Never a Ray call unless ``now``: this also
        runs as a finalizer, on whatever thread the garbage collector runs."""
        self._released.add(key)
        for w, queue in enumerate(self._release):
            self._positions[w].pop(key, None)  # (a restarted actor never rebuilds it)
            queue.append(key)
        if now and not self._closed:
            for w, queue in enumerate(self._release):
                keys = [queue.popleft() for _ in range(len(queue))]
                try:  # not waited for: ordered after the steps sent before
                    self.workers[w].release_inputs.remote(keys)
                except Exception as e:  # noqa: BLE001 - sent with its next step instead
                    queue.extend(keys)
                    _log.debug("worker %d: release of inputs %s deferred: %r", w, keys, e)

    def release_value(self, key: int) -> None:
        """Every worker actor lets its per-worker value of ``key`` (and its fn) go, with
        its next step (a finalizer: no Ray call here)."""
        for queue in self._release_values:
            queue.append(key)

    def read_value(self, key: int) -> list:
        """Each worker actor's per-worker state of ``key`` (NumPy), None where it holds
        none or cannot be reached now (a lost or restarting actor: logged)."""
        ray = _ray()
        refs = [w.read_value.remote(key) for w in self.workers]
        states = []
        for w, ref in enumerate(refs):
            try:
                states.append(ray.get(ref, timeout=60))
            except Exception as e:  # noqa: BLE001 - any Ray failure of one actor: that
                # worker's state is unknown (None), the others are still read
                _log.warning("worker %d: its per-worker state could not be read (%s: %s)",
                             w, type(e).__name__, e)
                states.append(None)
        return states

    def set_live_workers(self, fn) -> None:
        self._live = fn

    def workers_alive(self, n: int) -> None:
        _ray().get(self.shards[0].set_live_workers.remote(n), timeout=60)

    def interrupt(self) -> None:
        try:
            self.shards[0].interrupt.remote()
        except Exception:  # the actor is gone: nothing waits on it
            _log.debug("ray_carrier: the actor is gone: nothing waits on it", exc_info=True)

    def _ask_shard(self, i: int, call: Any) -> Any:
        """Shard ``i``'s answer to ``call(actor)`` (a ref); a lost shard is a
        ParameterServerError."""
        ray = _ray()
        try:
            return ray.get(call(self.shards[i]), timeout=60)
        except ray.exceptions.RayActorError as e:
            raise ParameterServerError(
                f"parameter-server shard {i} is lost ({type(e).__name__}); restart it from a "
                f"saved state (strategy.restart_shard({i}, state)) or restore every shard "
                "(strategy.restore(state)).") from None

    def shard_step(self, i: int) -> int:
        return int(self._ask_shard(i, lambda a: a.step.remote()))

    def shard_summary(self, i: int) -> dict[str, Any]:
        return self._ask_shard(i, lambda a: a.summary.remote())

    def shard_state(self, i: int) -> dict[str, Any]:
        return self._ask_shard(i, lambda a: a.state.remote())

    def kill_worker(self, w: int, when: str) -> None:
        ray = _ray()
        if when in ("process", "crash"):  # crash: Ray restarts it (max_restarts)
            ray.kill(self.workers[w], no_restart=when == "process")
            return
        self.faults.kill(w, when)
        self._send_faults(w)

    def set_worker_delay(self, w: int, seconds: float) -> None:
        self.faults.set_delay(w, seconds)
        self._send_faults(w)

    def _send_faults(self, w: int) -> None:
        """Worker ``w``'s actor holds its part of the plan as it is now."""
        _ray().get(self.workers[w].set_faults.remote(self.faults.get(w)), timeout=60)

    def kill_shard(self, i: int) -> None:
        _ray().kill(self.shards[i], no_restart=True)

    # -- actors: created with their options, checked, restarted ----------------------------
    def _new_shard(self, i: int, params: Any, restored: dict | None) -> Any:
        s = self._config
        ShardActor, _ = _actor_classes()
        return ShardActor.options(**shard_actor_options(_opts(s.ray_shard_options, i))).remote(
            i, params, self._tx, restored, s.num_ps, s.max_staleness)

    def shard_lost(self, i: int) -> bool:
        """Whether shard ``i``'s actor is dead (it does not answer)."""
        try:
            self.shard_step(i)
        except ParameterServerError:
            return True
        return False

    def restart_shard(self, i: int, saved: dict[str, Any]) -> None:
        """Shard ``i`` as a new actor from ``saved`` (``host_shard_state``), which the
        driver and every live worker call from now on."""
        ray = _ray()
        try:
            ray.kill(self.shards[i], no_restart=True)
        except Exception:  # already gone
            _log.debug("ray_carrier: already gone", exc_info=True)
        actor = self._new_shard(i, saved["params"], _host_restored([saved], 0))
        ray.get(actor.step.remote(), timeout=300)
        self.shards[i] = actor
        self.client.shards[i] = _ShardProxy(actor)
        for w in self.workers:
            try:
                ray.get(w.set_shards.remote(self.shards), timeout=60)
            except ray.exceptions.RayActorError:  # a lost worker: told if it comes back
                pass

    #: Seconds a lost worker actor has to come back (restarted by Ray, which takes a few
    #: seconds: a new process importing JAX) before it is lost for good.
    RESTART_TIMEOUT = 120.0

    def replace_worker(self, w: int) -> bool:
        """Worker ``w`` was lost: True once Ray restarted its actor in a new process
        (``max_restarts``), which is then sent the step functions, inputs and settings
        again; False if its process did not die (a step's own loss), it may not
        restart, or it is not back within ``RESTART_TIMEOUT`` seconds (e.g. no node
        has the resources it asks for)."""
        ray = _ray()
        g = self._config.num_replicas_in_sync
        opts = worker_actor_options(_opts(self._config.ray_worker_options, w), g)
        if opts["max_restarts"] == 0:
            return False
        actor = self.workers[w]
        try:
            now = _when_back(actor, time.monotonic() + self.RESTART_TIMEOUT)
            if now == self._incarnations[w]:
                return False  # the same process: not a restart
            if ray.get(actor.ready.remote(), timeout=60) < g:
                return False
            self._refresh(w)
        except Exception:  # dead for good, or not back in time
            return False
        self._forget[w]()
        return True

    def _refresh(self, w: int) -> None:
        """Worker ``w``'s actor, restarted afresh by Ray, is told what the carrier told
        it before: pushes return parameters (pipelined steps), the shards (restarted
        ones), its faults (its delay; no kill armed, as a new process); its incarnation
        is recorded."""
        ray = _ray()
        actor = self.workers[w]
        self.faults.disarm(w)
        refs = [actor.set_shards.remote(self.shards),
                actor.set_faults.remote(self.faults.get(w)),
                actor.set_input_positions.remote(dict(self._positions[w]))]
        if self.depth > 1:
            refs.append(actor.return_params.remote())
        ray.get(refs, timeout=60)
        self._incarnations[w] = ray.get(actor.incarnation.remote(), timeout=60)

    def _check_gpus(self) -> None:
        """Each worker that asked for GPUs runs on them (not silently on CPU)."""
        ray, s = _ray(), self._config
        asked = [w for w in range(len(self.workers))
                 if is_gpu_worker(_opts(s.ray_worker_options, w))]
        found = ray.get([self.workers[w].device_platform.remote() for w in asked],
                        timeout=60)
        for w, platform in zip(asked, found):
            if platform != "gpu":
                raise ValueError(
                    f"ParameterServerStrategy(ray_worker_options={{'num_gpus': ...}}): worker "
                    f"actor {w} got GPUs from Ray but JAX in its process runs on "
                    f"{platform!r}: install JAX with GPU support on its node (pip install "
                    "'jax[cuda12]'), or do not set JAX_PLATFORMS in its runtime_env.")

    def _check_ready(self, counts: list[int]) -> None:
        """Each worker actor found its ``num_replicas_in_sync`` devices."""
        g = self._config.num_replicas_in_sync
        for w, n in enumerate(counts):
            if n < g:
                raise ValueError(
                    f"ParameterServerStrategy(num_replicas_in_sync={g}, carrier='ray'): "
                    f"worker actor {w} sees {n} device(s). A GPU worker needs "
                    f"ray_worker_options={{'num_gpus': {g}}}; a CPU worker gets {g} "
                    "simulated devices unless its runtime_env sets XLA_FLAGS or "
                    "JAX_PLATFORMS otherwise.")

    def close(self, *, why: str = "the strategy was shut down") -> None:
        ray = _ray()
        self._closed.append(why)
        for a in self.workers + self.shards:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                _log.debug("ray_carrier: already gone", exc_info=True)


def _when_back(actor: Any, deadline: float) -> str:
    """The incarnation of a worker actor once it answers (while Ray restarts it, calls
    fail as unavailable: asked again until ``deadline``)."""
    ray = _ray()
    while True:
        try:
            return ray.get(actor.incarnation.remote(),
                           timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _opts(options: tuple, i: int) -> dict:
    """Actor ``i``'s checked options (none: the defaults)."""
    return options[i] if i < len(options) else {}


def _host_restored(restored: list | None, i: int) -> dict | None:
    if not restored:
        return None
    r = restored[i]
    return {"opt_state": r["opt_state"], "step": r["step"], "ledger": r["ledger"].to_arrays()}
