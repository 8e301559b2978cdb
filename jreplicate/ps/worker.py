"""One parameter-server worker: runs a scheduled step on its own device(s) (both carriers).

A worker with ``num_replicas_in_sync = g`` devices is one SPMD mesh of g replicas run
by :class:`jreplicate.execution.spmd.SPMDExecutor`: inside the step gradients are
summed over the group as under MirroredStrategy, and the group pushes once per step.

Per step (:meth:`PSWorker.run`):

1. token-gated mode: take a token from shard 0 (its value is this step's
   ``local_step``; a worker's first step uses ``global_step``, as TF's
   ``local_step_init_op``), with a deadline;
2. pull the parameters from every shard (numpy);
3. run the step, compiled once per signature, with the pulled parameters; the
   :func:`jreplicate.ps.pushable` transformation records the gradients (see
   :mod:`jreplicate.ps.capture`);
4. push the gradients to every shard with the step's id.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate._jax_compat import alias_host_arrays, producing_equation, varying_axes
from jreplicate.context import PerReplica
from jreplicate.execution.base import NOT_RUN
from jreplicate.execution.cache import FunctionMap, weak_callable
from jreplicate.execution.habits import step_name
from jreplicate.execution.spmd import SPMDExecutor
from jreplicate.layout import REPLICA_AXIS, mesh_layout, replica_mesh
from jreplicate.ps.capture import capturing
from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import Closure, HostBatch, check_cancelled
from jreplicate.ps.nnx_state import NnxArg, check_nothing_lost
from jreplicate.ps.per_worker import PerWorkerArg, WorkerValues
from jreplicate.ps.remote import ShardUpdateError, StepCancelledError, WorkerLostError
from jreplicate.ps.shard import Decision, TokenTimeoutError, TokenWaitInterrupted
from jreplicate.ps.worker_input import (
    InputEnded,
    WorkerInput,
    WorkerInputs,
    WorkerPipelines,
)


class ApplicationError(Exception):
    """The step function itself raised (not retried: TF's application errors)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error

    def __reduce__(self):  # crosses Ray with the original error
        return (ApplicationError, (self.error,))


class PSWorker:
    """Runs closures on ``devices`` (one sync group) against the shards of ``client``.

    Args:
      index: the worker's index.
      devices: its devices (a sync group of ``len(devices)`` replicas).
      client: a :class:`ShardClient` over the shards.
      opt_state: a numpy copy of the optimizer state (passed to the step, unchanged).
      token_timeout: seconds a token wait may last (token-gated mode).
      skip_stale_tokens: see :meth:`jreplicate.ps.shard.PSShard.take_token`.
      axis_name: the replica mesh axis of the sync group (the strategy's ``axis_name``).
    """

    def __init__(self, index: int, devices: list, client: ShardClient, opt_state: Any, *,
                 token_timeout: float = 60.0, skip_stale_tokens: bool = True,
                 axis_name: str = REPLICA_AXIS):
        self.index = index
        self.layout = mesh_layout(
            replica_mesh(devices, 1, "ParameterServerStrategy", axis_name),
            num_replicas_in_sync=len(devices))
        self.executor = SPMDExecutor(self.layout)
        self.client = client
        self._opt_host = opt_state
        self._opt = None
        self._wrapped = FunctionMap()
        self._plans: dict = {}  # output structure -> where its leaves come from
        self.token_timeout = token_timeout
        self.skip_stale_tokens = skip_stale_tokens
        self.local_step: int | None = None
        self.delay = 0.0  # simulated extra seconds per step (stragglers in tests/benchmarks)
        self.kill_at: str | None = None  # "compute" or "push": die there on the next step
        self.steps_done = 0
        #: ``(WorkerInput, HostBatch, whether a shard decided its push)`` of the step
        #: this worker was lost in, if that step read per-worker input (see :meth:`run`).
        self.lost_read: tuple[WorkerInput, HostBatch, bool] | None = None
        self._min_step = 0  # after an accepted push for step s: s + 1 (token-gated)
        self.live_workers: Callable[[], int] = lambda: 1
        #: Asynchronous mode: pushes return the shards' steps and parameters after them
        #: (:meth:`ShardClient.push_pull`), kept for the next step if it ``reuse``-s them.
        self.return_params = False
        self._returned: tuple[list[int], Any] | None = None
        self.inputs = WorkerPipelines(index, len(devices))  # PER_WORKER input, read here
        self.values = WorkerValues(index, len(devices))  # PerWorkerValues, built here
        # The pulled parameters (replicated) and a host batch (per replica) placed over
        # the mesh. On one device the parameters alias the read-only NumPy arrays a
        # pull returns (Ray's object store, the embedded shards' own buffers: 64-byte
        # aligned, so no copy; alias_host_arrays), and the step forwards the parameters
        # it returns unchanged (_forward): a 4.4 MB model is never copied on the worker.
        # Otherwise (and every batch) by a jitted identity of the NumPy values: on CPU
        # several times cheaper than device_put or make_array_from_callback (0.14
        # against 0.9 ms for an MLP of 6 leaves and 338 KB, 1.4 against 2.4 ms at 4.4
        # MB).
        self._alias = len(devices) == 1
        self._place_jit = jax.jit(lambda tree: tree, out_shardings=self.layout.replicated)
        self._place_batch = jax.jit(lambda b: b, out_shardings=self.layout.per_replica)
        self._place_both_jit = jax.jit(lambda p, b: (p, b), out_shardings=(
            self.layout.replicated, self.layout.per_replica))
        self._first_runs: set = set()  # step functions run here before (compiled)
        self._nnx_checked: set = set()  # step functions whose NNX state was checked
        client.between_shards = self._between_shards

    def _between_shards(self, i: int) -> None:
        if self.kill_at == "push":
            raise WorkerLostError(f"worker {self.index} died after pushing to shard {i - 1}")

    def run(self, c: Closure, on_token_wait: Callable[[bool], None] | None = None
            ) -> tuple[Any, Decision]:
        """Runs one closure; returns its outputs (on this worker's devices) and shard 0's
        decision. Raises :class:`ApplicationError` for the step's own errors (reading
        its input included, and a shard's update raising for its push),
        :class:`InputEnded` when its input (read here, before any token) is exhausted,
        and :class:`WorkerLostError` (or any other exception) for worker failures."""
        self.lost_read = None
        if isinstance(c.batch, WorkerInputs):
            return self._run_zipped(c, on_token_wait)
        if not isinstance(c.batch, WorkerInput):
            return self._run_read(c, on_token_wait)
        m = c.batch
        c = dataclasses.replace(c, batch=self._read_input(m))
        try:
            return self._run_read(c, on_token_wait)
        except (ApplicationError, StepCancelledError):
            # Not applied by any shard: the next step of the sweep here takes the batch.
            self.inputs.put_back(m, c.batch.elements, c.batch.treedef)
            raise
        except BaseException:
            # A worker failure (or a lost shard): what the step read, and whether a shard
            # decided its push (asked now, before the step can run again elsewhere), for
            # a worker that replaces this one (EmbeddedCarrier.replace_worker).
            self.lost_read = (m, c.batch, any(self.client.decided(c.step_id)))
            raise

    def _run_zipped(self, c: Closure, on_token_wait: Callable[[bool], None] | None
                    ) -> tuple[Any, Decision]:
        """:meth:`run` of a step reading several per-worker iterators: its batch is the
        tuple of their elements. Where one of them ends (or fails), the elements read
        from the others are put back for their next step here."""
        parts: list[tuple[WorkerInput, HostBatch]] = []
        try:
            for m in c.batch.markers:
                parts.append((m, self._read_input(m)))
        except BaseException:
            for m, b in parts:
                self.inputs.put_back(m, b.elements, b.treedef)
            raise
        g = len(parts[0][1].elements)
        batch = HostBatch([[x for _, b in parts for x in b.elements[r]] for r in range(g)],
                          jax.tree_util.treedef_tuple([b.treedef for _, b in parts]))
        try:
            return self._run_read(dataclasses.replace(c, batch=batch), on_token_wait)
        except (ApplicationError, StepCancelledError):
            for m, b in parts:
                self.inputs.put_back(m, b.elements, b.treedef)
            raise

    def _run_read(self, c: Closure, on_token_wait: Callable[[bool], None] | None
                  ) -> tuple[Any, Decision]:
        """:meth:`run` once the step's input is read (a :class:`HostBatch`)."""
        check_cancelled(c)
        token = None
        if self.client.token_gated and self.local_step is not None:
            # The coordinator counts this worker as waiting only while it blocks on an
            # empty queue (on_wait), not while it takes a token that is there. A step
            # cancelled before it blocks is refused there (the coordinator's interrupt
            # wakes one cancelled while it waits).
            def on_wait(waiting: bool) -> None:
                if waiting:
                    check_cancelled(c)
                if on_token_wait is not None:
                    on_token_wait(waiting)

            kw = {"on_wait": on_wait}
            try:
                token = self.client.shards[0].take_token(
                    time.monotonic() + self.token_timeout, skip_stale=self.skip_stale_tokens,
                    min_step=self._min_step, live_workers=self.live_workers(), **kw)
            except TokenWaitInterrupted as e:
                raise StepCancelledError(str(e)) from None
            except TokenTimeoutError as e:
                raise ApplicationError(e) from e
        try:
            out, decision = self._run(c, token)
        except BaseException:
            if token is not None:
                self.client.shards[0].return_token(token)
            raise
        if decision.duplicate and token is not None:  # a rerun of a decided push
            self.client.shards[0].return_token(token)
        self.steps_done += 1
        return out, decision

    def _read_input(self, m: WorkerInput) -> HostBatch:
        """This step's elements from this worker's own pipeline (PER_WORKER input)."""
        try:
            elements, treedef = self.inputs.read(m)
        except InputEnded:
            raise
        except Exception as e:  # input_fn or the source raised: the step's error
            raise ApplicationError(e) from e
        return HostBatch(elements, treedef)

    def _worker_value(self, a: PerWorkerArg) -> Any:
        """This worker's value of a PerWorkerValue argument (built on first use)."""
        try:
            return self.values.get(a)
        except Exception as e:  # fn raised: the step's error
            raise ApplicationError(e) from e

    def _run(self, c: Closure, token: int | None) -> tuple[Any, Decision]:
        returned, self._returned = self._returned, None
        # A step queued behind this worker's previous one starts from the parameters that
        # push returned, as fresh as a pull when the step could first start (their steps
        # are the shards' then: staleness is counted from them, exactly).
        steps, params = returned if c.reuse and returned is not None else self.client.pull()
        if self.client.token_gated:
            if token is None:
                token = steps[0]
            # A shard behind the token's step (never, once tokens wait for every shard;
            # a worker's first step takes none) makes the gradient stale, not mixed.
            fetched = [min(token, *steps)]
        else:
            fetched = steps
        args = [a.build(c.step_id) if isinstance(a, NnxArg) else
                self._worker_value(a) if isinstance(a, PerWorkerArg) else a for a in c.args]
        nnx_model = isinstance(c.args[c.param_index], NnxArg)
        if nnx_model:  # an NNX model: its params pulled
            from flax import nnx
            nnx.update(args[c.param_index], params)
        if c.opt_index is not None:
            if self._opt is None:
                self._opt = self.executor.place(self._opt_host)
            args[c.opt_index] = self._opt
        # Outputs that are inputs unchanged (the optimizer state a pushable update
        # returns) are not copied out of the step: taken from the inputs (not with NNX
        # arguments, whose state the executor splits and writes back itself).
        first = None if any(isinstance(a, NnxArg) for a in c.args) else int(c.has_batch)
        # Over several devices the placed parameters are this step's own copy: donated,
        # the step writes an output into them (the parameters it returns, which the
        # pushable update leaves unchanged, or its gradients) instead of a new
        # model-sized buffer. On one device they alias the pulled arrays (not donated).
        donate = () if first is None or self._alias else (c.param_index,)
        fn = self._capturing(c.fn, first, c.param_index if donate else None)
        try:  # a batch the step cannot take (placed here) is the step's error too
            # Placed for the mesh, so that the step takes the steady-state path (held
            # by args alone, so that the executor donates them without a copy).
            placed, batch = self._place_inputs(None if nnx_model else params, c.batch)
            if not nnx_model:
                args[c.param_index] = placed
            args, placed = tuple(args), None
            got, full = self._execute(fn, c.has_batch, batch, args, donate, c.allow)
            if full and not (nnx_model or c.reuse or self.client.token_gated
                             or c.fn_key in self._first_runs):
                self._first_runs.add(c.fn_key)
                # That first run compiled (seconds, while other workers apply updates):
                # its gradient would be that stale. Pull again and run the compiled
                # step on the fresh parameters (asynchronous modes).
                fetched, params = self.client.pull()
                args = list(args)
                args[c.param_index], batch = self._place_inputs(params, c.batch)
                args = tuple(args)
                got, _ = self._execute(fn, c.has_batch, batch, args, donate, c.allow)
            out, grads, _ = got
            if first is None and c.fn_key not in self._nnx_checked:
                check_nothing_lost(c.args, args)  # (once per step function here)
                self._nnx_checked.add(c.fn_key)
            if first is not None:
                out = _unforward(out, args, self._plans, self.layout.replicated)
            grads = jax.tree.map(np.asarray, grads)
        except WorkerLostError:
            raise
        except Exception as e:
            raise ApplicationError(e) from e
        if self.delay:
            time.sleep(self.delay)
        if self.kill_at == "compute":
            raise WorkerLostError(f"worker {self.index} died computing step {c.step_id}")
        check_cancelled(c)  # (a step cancelled while computing: its push refused)
        self.client.ordered = self.kill_at == "push"
        try:
            if self.return_params and not self.client.token_gated and \
                    not self.client.ordered:
                decision, *returned = self.client.push_pull(c.step_id, self.index,
                                                            fetched, grads)
                self._returned = tuple(returned)
            else:
                decision = self.client.push(c.step_id, self.index, fetched, grads,
                                            c.attempt)
        except ShardUpdateError as e:  # a shard's update raised: the step's error
            raise ApplicationError(e) from e
        self.local_step = token
        self._min_step = decision.step + 1 if decision.kind == "applied" else 0
        return out, decision

    def _execute(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
                 donate: tuple[int, ...], allow: frozenset = frozenset()
                 ) -> tuple[Any, bool]:
        """The step's outputs by the steady-state path, else by the full one (which may
        compile), and whether the full path ran."""
        got = self.executor.run_again(fn, has_batch, batch, args, None, donate)
        if got is not NOT_RUN:
            return got, False
        return self.executor.run(fn, has_batch, batch, args, steps=None,
                                 donate_argnums=donate, allow=allow), True

    def _place(self, params: Any) -> Any:
        """``params`` (numpy) placed replicated over this worker's mesh."""
        if not self._alias:
            return self._place_jit(params)
        leaves, treedef = jax.tree.flatten(params)
        return jax.tree.unflatten(treedef, alias_host_arrays(
            leaves, self.layout.replicated, self.layout.first_devices[0]))

    def _place_both(self, params: Any, leaves: list) -> tuple[Any, Any]:
        """``params`` placed replicated and the stacked batch ``leaves`` per replica."""
        if not self._alias:
            return self._place_both_jit(params, leaves)
        placed = None if params is None else self._place(params)
        return placed, self._place_batch(leaves)

    def _place_inputs(self, params: Any, batch: Any) -> tuple[Any, Any]:
        """``params`` (or None) placed replicated, and ``batch`` as the step takes it: a
        :class:`HostBatch`'s elements stacked per leaf and placed per replica, in the
        same call."""
        if not isinstance(batch, HostBatch):
            return (None if params is None else self._place(params)), batch
        els = batch.elements
        leaves = [np.asarray(els[0][j])[None] if len(els) == 1 else
                  np.stack([e[j] for e in els]) for j in range(len(els[0]))]
        placed, leaves = self._place_both(params, leaves)
        mesh, axis = self.layout.mesh, self.layout.replica_axis
        return placed, jax.tree.unflatten(batch.treedef,
                                          [PerReplica(x, mesh, axis) for x in leaves])

    def _capturing(self, fn: Callable, first: int | None, donated: int | None
                   ) -> Callable:
        """``fn`` tracing its pushable update's gradients, returning ``(outputs,
        gradients, kept)``. With ``first`` (where the arguments after the batch start),
        outputs that are replicated arguments unchanged are returned as
        :class:`_Forwarded`, except those of argument ``donated`` (after the batch),
        whose leaves are donated: ``kept`` returns those that no output of theirs
        takes (see :func:`_unclaimed`), so that every donated buffer is used."""
        wrapped = self._wrapped.setdefault(fn, {}).get((first, donated))
        if wrapped is None:
            step = weak_callable(fn)  # the map's value must not keep its key alive

            def wrapped(ctx, *args):
                with capturing() as sink:
                    out = step(ctx, *args)
                if first is not None:
                    own = () if donated is None else args[first + donated]
                    out = _forward(out, args[first:], ctx._axis, own, sink.zeros)
                if len(sink) != 1:
                    raise ValueError(
                        f"ParameterServerStrategy: the step called a jr.ps.pushable "
                        f"transformation's update {len(sink)} times; it must call it once "
                        "per step (its gradients are what the worker pushes). Create the "
                        "optimizer as tx = jr.ps.pushable(optax...) inside rep.scope() and call "
                        "tx.update(grads, opt_state, params) in the step.")
                axis, n = ctx._axis, ctx.num_replicas
                grads = jax.tree.map(
                    lambda g: jax.lax.psum(g, axis) / n if axis in varying_axes(g) else g,
                    sink[0])
                kept = () if donated is None else _unclaimed(
                    args[first + donated], (out, grads), axis)
                return out, grads, kept
            # The cache's warning about recompiled code counts the step's code, not
            # this wrapper's (one code object for every step function).
            wrapped.__wrapped__ = step
            wrapped.__qualname__ = step_name(fn)  # (warnings name the step)
            self._wrapped[fn][(first, donated)] = wrapped
        return wrapped


@jax.tree_util.register_pytree_node_class
class _Forwarded:
    """An output of a step that is its input leaf ``index`` (of the arguments after
    the batch) unchanged: a pytree without leaves, so the compiled step does not copy
    it out; :func:`_unforward` puts the input back."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def tree_flatten(self):
        return (), self.index

    @classmethod
    def tree_unflatten(cls, index, _):
        return cls(index)


def _forward(out: Any, inputs: tuple, axis: str, donated: Any = (),
             zeros: dict | None = None) -> Any:
    """At trace time: ``out`` with each output that is a replicated input tracer itself,
    or one plus a pushable update's zero updates (``zeros``, by id: the parameters
    ``optax.apply_updates`` returns, equal to them bit for bit), replaced by a
    :class:`_Forwarded` naming it, except the leaves of ``donated`` (a donated input
    returned unchanged is its own buffer, with no copy)."""
    leaves = jax.tree.leaves(inputs)
    own = {id(x) for x in jax.tree.leaves(donated)}
    index = {id(x): i for i, x in enumerate(leaves)
             if isinstance(x, jax.core.Tracer) and axis not in varying_axes(x)
             and id(x) not in own}

    def forward(x):
        i = index.get(id(_plus_zero_of(x, zeros) if zeros else x))
        return x if i is None else _Forwarded(i)

    return jax.tree.map(forward, out)


def _plus_zero_of(x: Any, zeros: dict) -> Any:
    """At trace time: ``p`` if ``x`` was traced as ``p + z`` (or ``z + p``) with ``z``
    one of ``zeros`` and ``p`` of ``x``'s type, else ``x`` (also where JAX does not
    say how ``x`` was made: then nothing is forwarded, and the output is computed)."""
    made = producing_equation(x)
    if made is None or made[0] != "add" or len(made[1]) != 2:
        return x
    for p, z in (made[1], made[1][::-1]):
        if zeros.get(id(z)) is z and getattr(p, "aval", None) == x.aval:
            return p
    return x


def _unclaimed(donated: Any, outputs: Any, axis: str) -> list:
    """At trace time: the leaves of ``donated`` (inputs whose buffers the step may
    reuse) for which ``outputs`` hold too few replicated arrays of their shape and
    dtype (jax.jit gives a donated buffer to an output of its shape and dtype, and
    warns about one none takes). Returned as extra outputs, they take them: a donated
    input returned unchanged is its own buffer, with no copy."""
    def key(x):
        return (tuple(x.shape), np.dtype(x.dtype))

    free: dict = {}
    for x in jax.tree.leaves(outputs):
        if hasattr(x, "shape") and axis not in varying_axes(x):
            free[key(x)] = free.get(key(x), 0) + 1
    kept = []
    for x in jax.tree.leaves(donated):
        if free.get(key(x), 0):
            free[key(x)] -= 1
        else:
            kept.append(x)
    return kept


def _unforward(out: Any, args: tuple, plans: dict, sharding: Any) -> Any:
    """After the step: each :class:`_Forwarded` output replaced by its input (a leaf of
    ``args``, the step's arguments after the batch, as traced), placed with
    ``sharding`` as the step took it where it is not a ``jax.Array`` (a Python scalar
    or a float64 NumPy argument comes back as the step's float32, as under every
    strategy). ``plans`` caches, per structure of ``out``, where each output comes from
    (:func:`_unforward_plan`)."""
    leaves, treedef = jax.tree.flatten(out)  # (a _Forwarded has no leaves)
    if treedef not in plans:
        if len(plans) >= 64:  # (steps of many output structures: start again)
            plans.clear()
        plans[treedef] = _unforward_plan(treedef)
    plan = plans[treedef]
    if plan is None:
        return out
    full, sources = plan
    inputs = jax.tree.leaves(args)
    return jax.tree.unflatten(full, [(x if isinstance(x := inputs[i], jax.Array) else
                                      jax.device_put(x, sharding)) if fwd else leaves[i]
                                     for fwd, i in sources])


def _unforward_plan(treedef: Any) -> tuple[Any, list[tuple[bool, int]]] | None:
    """For outputs of structure ``treedef``: None if none is forwarded, else the
    structure with each :class:`_Forwarded` as a leaf, and per leaf of it ``(True, input
    leaf index)`` or ``(False, output leaf index)``."""
    marked = jax.tree.unflatten(treedef, [_Output(i) for i in range(treedef.num_leaves)])
    items, full = jax.tree.flatten(marked, is_leaf=lambda x: isinstance(x, _Forwarded))
    sources = [(True, x.index) if isinstance(x, _Forwarded) else (False, x.index)
               for x in items]
    return (full, sources) if any(fwd for fwd, _ in sources) else None


class _Output:
    """A marker leaf: output leaf ``index`` (see :func:`_unforward_plan`)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index
