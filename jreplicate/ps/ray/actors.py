"""The Ray actors of the Ray carrier (private; imported only when Ray is used).

Defined at module level so that Ray ships them by reference (workers import this
module) rather than pickling class definitions by value.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid

import jax

from jreplicate.context import PerReplica
from jreplicate.layout import REPLICA_AXIS
from jreplicate.ps._malloc import keep_freed_blocks
from jreplicate.ps.client import ShardClient
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.per_worker import PerWorkerArg
from jreplicate.ps.ray import wire
from jreplicate.ps.ray.pieces import in_pieces, in_pieces_leaf
from jreplicate.ps.ray.proxy import _Forgotten, _ShardProxy
from jreplicate.ps.remote import WorkerLostError, to_host
from jreplicate.ps.shard import PSShard
from jreplicate.ps.worker import PSWorker
from jreplicate.ps.worker_input import WorkerInput, WorkerInputs, markers

try:
    import ray
except ImportError:  # only used with Ray; importing the module without it does nothing
    ray = None


_MISSING = object()  # WorkerActor.fetch: no outputs held for that step
#: The most recent steps whose held outputs may alias Ray's object store (a one-device
#: worker's parameters, placed without a copy, and forwarded outputs are those arrays):
#: the outputs of older steps still held are copied into this process's memory, so that
#: a caller keeping many RemoteValues does not fill the object store (every later
#: transfer would then spill: 60 steps of a 4.4 MB model with an 80 MB store took 106 s
#: instead of 1.6 s).
HELD_IN_STORE = 4

if ray is not None:
    @ray.remote(num_cpus=0, concurrency_groups={"io": 8, "tokens": 64})
    class ShardActor:
        """A :class:`PSShard` in its own process: pulls and pushes in the ``"io"`` group,
        blocking token waits in ``"tokens"``, so neither blocks the other."""

        def __init__(self, index, params, tx, restored, num_shards=1, max_staleness=None):
            keep_freed_blocks()  # (see ps/_malloc.py)
            r = restored or {}
            ledger = Ledger.from_arrays(r["ledger"]) if "ledger" in r else None
            self.shard = PSShard(index, params, tx, opt_state=r.get("opt_state"),
                                 step=r.get("step", 0), ledger=ledger,
                                 num_shards=num_shards, max_staleness=max_staleness)

        # The ShardHandle operations (jreplicate.ps.handle) and the driver's queries.
        # Parameters go back with each array over 1 MiB in pieces (ray/pieces.py).
        @ray.method(concurrency_group="io")
        def pull(self):
            step, params = self.shard.pull()
            return step, in_pieces(params)

        @ray.method(concurrency_group="io")
        def push(self, push_id, worker, fetched_step, grads, decision=None, attempt=0):
            return self.shard.push(push_id, worker, fetched_step, grads, decision, attempt)

        @ray.method(concurrency_group="io")
        def push_pull(self, push_id, worker, fetched_step, grads):
            decision, step, params = self.shard.push_pull(push_id, worker, fetched_step,
                                                          grads)
            return decision, step, in_pieces(params)

        @ray.method(concurrency_group="io")
        def push_pull_packed(self, push_id, worker, fetched_step, meta, *chunks):
            """The shard's ``push_pull`` with the pieces and the parameters as
            :mod:`jreplicate.ps.ray.wire` chunks of bytes, ``meta`` encoded (the caller asks
            for ``1 + len(chunks)`` returns: ``(decision, step, meta)``, then the
            chunks)."""
            grads = wire.unpack(wire.decode(meta, f"worker {worker}"), chunks)
            decision, step, params = self.shard.push_pull(push_id, worker, fetched_step,
                                                          grads)
            meta, out = wire.pack(params, chunks=len(chunks))
            return ((decision, step, wire.encode(meta)), *wire.to_bytes(out))

        @ray.method(concurrency_group="io")
        def check(self, push_id, fetched_step, grads):
            return self.shard.check(push_id, fetched_step, grads)

        @ray.method(concurrency_group="io")
        def may_raise(self):
            return self.shard.may_raise

        @ray.method(concurrency_group="io")
        def stage(self, push_id, attempt, grads):
            return self.shard.stage(push_id, attempt, grads)

        @ray.method(concurrency_group="io")
        def commit(self, push_id, decision):
            return self.shard.commit(push_id, decision)

        @ray.method(concurrency_group="io")
        def decision(self, push_id):
            return self.shard.decision(push_id)

        @ray.method(concurrency_group="io")
        def ack(self, steps):
            return self.shard.ack(steps)

        @ray.method(concurrency_group="io")
        def record(self, push_id, decision):
            return self.shard.record(push_id, decision)

        @ray.method(concurrency_group="io")
        def decided(self, push_id):
            return self.shard.decided(push_id)

        @ray.method(concurrency_group="io")
        def return_token(self, token):
            return self.shard.return_token(token)

        @ray.method(concurrency_group="io")
        def set_live_workers(self, n):
            return self.shard.set_live_workers(n)

        @ray.method(concurrency_group="io")
        def interrupt(self):
            return self.shard.interrupt()

        @ray.method(concurrency_group="io")
        def step(self):
            return self.shard.step

        @ray.method(concurrency_group="io")
        def token_gated(self):
            return self.shard.token_gated

        @ray.method(concurrency_group="io")
        def summary(self):
            return self.shard.summary()

        @ray.method(concurrency_group="io")
        def state(self):
            return self.shard.state()

        @ray.method(concurrency_group="tokens")
        def take_token(self, seconds, skip_stale, min_step, live_workers):
            return self.shard.take_token(time.monotonic() + seconds, skip_stale=skip_stale,
                                         min_step=min_step, live_workers=live_workers)


    @ray.remote(num_cpus=0, concurrency_groups={"control": 2})
    class WorkerActor:
        """A :class:`PSWorker` in its own process, calling the shard actors directly.

        Steps (``run``) and the carrier's set-up calls run one at a time, in order, in
        the default group; ``fetch`` and the testing hooks run in ``"control"``, so a
        finished step's outputs (or a fault armed now) never wait behind the steps
        queued on this worker."""

        def __init__(self, index, shards, placement, token_gated, opt_host, g, token_timeout,
                     skip_stale, guarded=False, axis_name=REPLICA_AXIS, faults=None):
            keep_freed_blocks()  # page faults of every step's buffers (ps/_malloc.py)
            proxies = [_ShardProxy(a) for a in shards]
            faults = FaultPlan() if faults is None else faults  # (its part of the plan)
            client = ShardClient(proxies, placement, token_gated, guarded=guarded,
                                 faults=faults)
            self.worker = PSWorker(index, jax.local_devices()[:g], client, opt_host,
                                   token_timeout=token_timeout, skip_stale_tokens=skip_stale,
                                   axis_name=axis_name, faults=faults)
            self.fns = {}
            self.input_fns = {}  # PER_WORKER input_fn by key, sent once
            self.value_fns = {}  # PerWorkerValue fn by key, sent once
            self.held = {}  # step id -> its outputs, until fetched and let go
            self._in_store = collections.deque()  # the latest held steps (HELD_IN_STORE)
            self.lost = None  # why this worker is lost (it then runs no step)
            # Restarted by Ray (its process died): it runs nothing until the carrier has
            # told it again what it told the first one (set_shards, ...).
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

        def run(self, closure, live_workers, let_go=(), forget=(), release=(),
                release_values=()):
            for step_id in let_go:
                self.held.pop(step_id, None)
            for key in forget:  # step functions freed on the driver
                self.fns.pop(key, None)
            self.release_inputs(release)
            for key in release_values:  # PerWorkerValues collected on the driver
                self.value_fns.pop(key, None)
                self.worker.values.release(key)
            if self.lost is not None:  # a lost worker runs nothing (a step queued behind)
                raise WorkerLostError(f"worker {self.worker.index} was lost ({self.lost}); "
                                      f"step {closure.step_id} did not run")
            m = closure.batch
            if self.restarted or closure.fn is None and closure.fn_key not in self.fns or \
                    any(r.input_fn is None and r.key not in self.input_fns and
                        r.key not in self.worker.inputs.released for r in markers(m)) or \
                    any(isinstance(a, PerWorkerArg) and a.fn is None and
                        a.key not in self.value_fns for a in closure.args):
                raise _Forgotten(f"worker {self.worker.index} was restarted")
            if closure.fn is None:  # sent before: one function object, compiled once
                closure = dataclasses.replace(closure, fn=self.fns[closure.fn_key])
            else:
                closure = dataclasses.replace(
                    closure, fn=self.fns.setdefault(closure.fn_key, closure.fn))
            if any(isinstance(a, PerWorkerArg) for a in closure.args):
                closure = dataclasses.replace(closure, args=tuple(
                    dataclasses.replace(a, fn=self.value_fns.setdefault(a.key, a.fn))
                    if isinstance(a, PerWorkerArg) else a for a in closure.args))
            m = closure.batch
            if markers(m):  # input read here, from this actor's pipelines
                read = [r if r.key in self.worker.inputs.released else  # (not run)
                        dataclasses.replace(r, input_fn=self.input_fns.setdefault(
                            r.key, r.input_fn)) for r in markers(m)]
                closure = dataclasses.replace(closure, batch=read[0] if isinstance(
                    m, WorkerInput) else WorkerInputs(tuple(read)))
            self.worker.live_workers = lambda: live_workers
            try:
                out, _ = self.worker.attempt(closure)
            except WorkerLostError as e:
                self.lost = str(e)
                raise
            self.held[closure.step_id] = out  # here until RemoteValue.fetch asks
            self._in_store.append(closure.step_id)
            if len(self._in_store) > HELD_IN_STORE:
                old = self._in_store.popleft()
                if old in self.held:  # still held: copied out of the object store
                    self.held[old] = _host_copy(self.held[old])
            # Where this worker's pipeline is (the carrier restarts a replacement there).
            return {r.key: self.worker.inputs.position(r.key) for r in markers(m)
                    if self.worker.inputs.position(r.key) is not None}

        def release_inputs(self, keys):
            """Frees the PER_WORKER pipelines (and input_fns) of ``keys``: their
            iterators were closed or collected on the driver."""
            for key in keys:
                self.input_fns.pop(key, None)
                self.worker.inputs.release(key)

        @ray.method(concurrency_group="control")
        def pipeline_count(self):
            """How many PER_WORKER pipelines this actor holds (for tests)."""
            return self.worker.inputs.pipeline_count()

        @ray.method(concurrency_group="control")
        def fetch(self, step_id):
            """``(True, outputs as numpy)``, or ``(False, why)`` if not held here (arrays
            over 1 MiB in pieces: ray/pieces.py)."""
            out = self.held.get(step_id, _MISSING)
            if out is _MISSING:
                return False, f"worker {self.worker.index} does not hold them"
            return True, _host(out, lambda x: in_pieces_leaf(to_host(x)))

        @ray.method(concurrency_group="control")
        def read_value(self, key):
            """This worker's per-worker state of ``key`` (NumPy), or None."""
            return self.worker.values.read(key)

        @ray.method(concurrency_group="control")
        def held_steps(self):
            """The ids of the steps whose outputs this worker holds."""
            return sorted(self.held)

        def return_params(self):
            """Pushes return the shards' parameters (pipelined steps start from them)."""
            self.worker.return_params = True

        @ray.method(concurrency_group="control")
        def set_faults(self, faults):
            """This worker's part of the carrier's FaultPlan becomes ``faults``."""
            self.worker.faults.set(self.worker.index, faults)

        def ready(self):
            return len(self.worker.layout.first_devices)

        def set_input_positions(self, positions):
            """Pipelines built here start where the lost process's steps ended."""
            self.worker.inputs.start_at.update(positions)

        def device_platform(self):
            """The platform of this worker's devices (``"cpu"``, ``"gpu"``, ...)."""
            return self.worker.layout.first_devices[0].platform

        def set_shards(self, shards):
            """The shard actors to call (after one was restarted, or this worker)."""
            self.worker.client.shards[:] = [_ShardProxy(a) for a in shards]
            self.restarted = False

        def incarnation(self):
            """This instance's identity: Ray restarting the actor makes a new one."""
            return self.__dict__.setdefault("_incarnation", uuid.uuid4().hex)


def _host(out, convert):
    """``out``'s leaves converted by ``convert`` (a PerReplica as its array)."""
    return jax.tree.map(lambda x: convert(x.array if isinstance(x, PerReplica) else x),
                        out, is_leaf=lambda x: isinstance(x, PerReplica))


def _host_copy(out):
    """``out`` as copies in this process's memory, as ``fetch`` sends them (NumPy
    arrays; a typed PRNG key as a :class:`jreplicate.ps.remote.HostKey`).

    A leaf that cannot be copied so stays as it is: ``fetch`` raises its error when
    asked for it, instead of the later step whose ``run`` copies it failing after its
    push (the worker was then lost)."""
    def copy(x):
        try:
            return to_host(x, copy=True)
        except Exception:  # noqa: BLE001 (fetch raises it to the caller)
            return x
    return _host(out, copy)
