"""Replicator: runs a step function on every replica of a strategy."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jreplicate import _porting
from jreplicate._jax_compat import axis_bound
from jreplicate.context import PerReplica, active_axis_name, check_logical_device
from jreplicate.execution import habits
from jreplicate.execution.base import NOT_RUN
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.iterator import InputIterator
from jreplicate.strategies.base import Strategy


class Replicator:
    """Replicates a step function across the replicas of ``strategy``.

    Args:
      strategy: a :class:`jreplicate.strategies.Strategy`, e.g.
        :class:`jreplicate.MirroredStrategy`.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
      >>> with rep.scope():
      ...     w = jnp.ones(3)
      >>> def step(ctx, w):
      ...     return w + ctx.all_sum(1.0), ctx.replica_id
      >>> w, ids = rep.run(step, None, w)
      >>> w.tolist(), [int(i) for i in ids]
      ([5.0, 5.0, 5.0], [0, 1, 2, 3])
    """

    def __init__(self, strategy: Strategy):
        if not isinstance(strategy, Strategy):
            raise TypeError(
                "Replicator(strategy) needs a jreplicate strategy such as "
                f"jr.MirroredStrategy(), got {type(strategy).__name__}."
            )
        self._strategy = strategy
        self._layout = strategy.layout
        self._executor = strategy.make_executor()
        self._run_again = self._executor.run_again  # the steady-state path of run
        self._steps_per_run = strategy.steps_per_run
        # The leading dimensions of a batch shaped for jax.pmap (see _porting).
        self._pmap_counts = _porting.device_counts(self._layout.num_replicas,
                                                   len(self._layout.local_replica_ids))
        # Iterators finalize() closes; held weakly so a dropped one can be collected.
        self._iterators: weakref.WeakSet[InputIterator] = weakref.WeakSet()

    # -- facts ---------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The strategy's ``(axis_name, "model")`` mesh, whose first axis (the
        strategy's ``axis_name``, ``"replica"`` unless chosen) enumerates the replicas
        and whose ``"model"`` axis the logical devices of each replica."""
        return self._layout.mesh

    @property
    def num_replicas(self) -> int:
        """The total number of replicas."""
        return self._layout.num_replicas

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas training in sync."""
        return self._layout.num_replicas_in_sync

    # -- lifecycle -----------------------------------------------------------------
    def initialize(self) -> list:
        """Runs start-up work now (JAX is eager) and returns ``[]``."""
        return []

    def finalize(self) -> list:
        """Waits for scheduled steps, stops input prefetch threads, and returns ``[]``."""
        self._executor.join()
        for it in list(self._iterators):
            it.close()
        return []

    def join(self) -> None:
        """Waits for every step scheduled so far and re-raises the first error.

        SPMD strategies run each step when :meth:`run` is called, so there is nothing to
        wait for; a strategy that schedules steps asynchronously waits here.
        """
        self._executor.join()

    @contextlib.contextmanager
    def scope(self) -> Iterator[Replicator]:
        """Context in which new arrays are placed replicated on the replicas' devices.

        It is ``jax.set_mesh(mesh)``: arrays, optax states and Flax NNX modules created
        inside it are replicated over the strategy's mesh. Re-entrant; :meth:`run`
        applies it too, and places any argument not yet replicated.
        """
        with self._executor.scope():
            yield self

    def logical_device_for_variables(self, logical_device_id: int
                                     ) -> contextlib.AbstractContextManager:
        """Context placing variables created in it on a logical device of every replica.

        Logical device ``i`` is index ``i`` of the ``"model"`` mesh axis; the strategy's
        ``logical_devices_per_replica`` sets how many there are. Use it inside
        :meth:`scope`. The guide
        :doc:`/guides/model_parallelism` (``docs/guides/model_parallelism.md``) gives
        the mapping and its limits.

        Raises:
          ValueError: ``logical_device_id`` is not in ``[0, logical_devices_per_replica)``.
        """
        i = check_logical_device(logical_device_id, self._layout.logical_devices_per_replica,
                                 "Replicator.logical_device_for_variables")
        return self._executor.logical_device_scope(i)

    # -- input ---------------------------------------------------------------------
    def prepare_input(
        self,
        fn: Callable[[InputContext], Any],
        replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
        prefetch_on_device: bool | None = None,
        enforce_ordering: bool = False,
        *,
        prefetch_buffer_size: int = 1,
        partial_batch: str = "drop",
    ) -> InputIterator:
        """Builds the input pipelines and returns an iterator to pass to :meth:`run`.

        Args:
          fn: ``input_fn(ctx: InputContext)`` returning an iterable of per-replica
            batches (generator, list, Grain dataset or loader, anything with
            ``as_numpy_iterator()``) or a parameter-less callable returning one batch.
            Batch with ``ctx.get_per_replica_batch_size(global_batch_size)``.
          replication_mode: how many pipelines to create; see
            :class:`InputReplicationMode`.
          prefetch_on_device: read and copy the next batch (or the next device loop's
            batches) to the devices on a background thread while the current step runs.
            ``None`` (default): read on the calling thread, timed; once reads take more
            than a tenth of the time from one step to the next, prefetch for a trial of
            a few steps, kept if the steps got more than 10 % faster (a slow source:
            ``bench/prefetch.py``), else reading goes back in line (on a dispatch-bound
            step with a fast source the thread costs more than it hides:
            ``bench/host_overhead.py``). Across processes the default prefetches (each
            read is an agreement round all processes must make alike, a round trip
            worth hiding). See :attr:`InputIterator.prefetching` and
            :mod:`jreplicate.input.auto`.
            ``True``: prefetch from the first step. ``False``: never.
          enforce_ordering: read pipelines strictly in replica-id order (replica 0
            before replica 1). Otherwise per-replica pipelines are read concurrently.
          prefetch_buffer_size: batches kept ready when prefetching (default 1).
          partial_batch: what happens to a step in which some elements are partial
            batches (every batched leaf shorter along its leading axis by the same
            number of rows; leaves that disagree are an error), or some pipelines have
            run out while others have not. ``"drop"`` (default): the final step is
            dropped with a warning and the iteration ends; only a pipeline's final
            element may be partial (one that more elements follow is an error naming
            the replica, pipeline, step and leaf, as dropping it would lose the rest).
            ``"pad"``: the step is padded with zeros to the first step's shapes and
            runs, wherever its partial batches are; the step function reads
            ``ctx.batch_mask`` (1 for real examples, 0 for padding) to weight its loss
            and count examples, so every example counts exactly once, on every sweep,
            without a recompilation. Every leaf needs the batch as its leading axis.
        """
        if not callable(fn):
            raise TypeError(f"prepare_input(fn) must be callable, got {type(fn).__name__}.")
        if isinstance(prefetch_buffer_size, bool) or not isinstance(prefetch_buffer_size, int) \
                or prefetch_buffer_size < 1:
            raise ValueError(
                f"prepare_input(prefetch_buffer_size={prefetch_buffer_size!r}) must be an "
                "int >= 1."
            )
        if prefetch_on_device is not None and not isinstance(prefetch_on_device, bool):
            raise TypeError(
                f"prepare_input(prefetch_on_device={prefetch_on_device!r}) must be None "
                "(prefetch once reads are seen to cost), True or False."
            )
        # An executor that reads input where the steps run (ParameterServerStrategy's
        # workers) builds its own PER_WORKER iterator; the driver reads nothing.
        it = None
        if replication_mode is InputReplicationMode.PER_WORKER:
            it = self._executor.per_worker_input(self, fn, partial_batch=partial_batch)
        if it is None:
            it = InputIterator(
                self, self._strategy, self._executor, fn, replication_mode=replication_mode,
                prefetch_buffer_size=prefetch_buffer_size if prefetch_on_device is not False
                else 0, enforce_ordering=bool(enforce_ordering), partial_batch=partial_batch,
                auto_prefetch=prefetch_on_device is None)
        self._iterators.add(it)
        return it

    # -- running -------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], inputs: Any = None, *args: Any,
            steps: int | None = None, donate_argnums: int | Sequence[int] = (),
            allow: str | Sequence[str] = ()) -> Any:
        """Runs ``fn`` on every replica, compiled once with ``jax.jit`` over ``shard_map``.

        ``run(fn)`` calls ``fn(ctx)``; ``run(fn, inputs, *args)`` calls
        ``fn(ctx, batch, *args)`` with this step's per-replica ``batch`` from an
        :class:`InputIterator` (or a pytree of :class:`PerReplica`); ``run(fn, None,
        *args)`` calls ``fn(ctx, *args)``. ``args`` are replicated state (pytrees of
        arrays, optax states, Flax NNX modules, which are updated in place) or
        :class:`PerReplica` values (each replica gets its own).

        Gradients with respect to replicated arguments are **summed** over the replicas
        automatically (the transpose of replication); scale each replica's loss with
        :func:`jreplicate.compute_average_loss` to get the global-batch mean.

        Random streams of Flax NNX arguments (an ``nnx.Rngs``, the stream an
        ``nnx.Dropout`` keeps) draw per replica, as rows draw independently on one
        device: inside the step each key is ``jax.random.fold_in(key, ctx.replica_id)``
        (with more than one replica), and the module keeps its key, its count advanced
        as on one device. :func:`jreplicate.same_on_every_replica` marks streams that
        should draw alike; a raw ``jax.random`` key argument is the same on every
        replica.

        Args:
          fn: the step function, any callable. Compiled once per input signature
            and function object, by identity: distinct objects are distinct steps even
            when they compare equal, and ``obj.method`` is one step however often it
            is fetched. Build it once, outside the training loop.
          inputs: an :class:`InputIterator`, a pytree of :class:`PerReplica`, or None.
          *args: the step's other arguments.
          steps: run K steps in one compiled device loop (``lax.scan``): K batches are
            taken from ``inputs`` (an :class:`InputIterator`, or None) and placed with
            one transfer. The step must return the new values of its plain arguments
            first, in order (``return params, opt_state, loss``); they are carried from
            step to step, Flax NNX modules are carried in place, and the other outputs
            come back stacked ``[K, ...]``. The result equals K separate calls. A final
            stretch of fewer than K batches runs as a shorter loop (compiled once for
            that length); the iterator then raises StopIteration. Likewise, when
            reading the input raises at step k of the K, the k complete steps run (and
            their results come back) and the next call raises the input's error, as
            the (k+1)-th of K separate calls would. A call that raises (the step fails
            to trace, an argument is rejected, Ctrl-C) consumes no input: its batches
            go back to the iterator, in order, for the next call, a single step or a
            loop of any K. (An error JAX reports only when the results are read, e.g.
            a host callback raising, comes after ``run`` returned: its batches were
            consumed.) Default: the
            strategy's ``steps_per_run`` for an input iterator (None: one step).
          donate_argnums: positions in ``args`` whose buffers the step may reuse for
            its outputs (as ``jax.jit``'s ``donate_argnums``): the arrays passed there
            are deleted, so pass state you replace with the step's result
            (``params, opt = rep.run(step, inputs, params, opt, donate_argnums=(0, 1))``),
            never state you read again (an evaluation step's ``params``). The state of
            Flax NNX arguments, which ``run`` replaces in place, is always donated.
            An array another live object also holds, directly or through any container
            on its way from the argument (``nnx.clone(model)``, a teacher or EMA
            sharing the model's arrays, ``best = params``, ``old = w``,
            ``kept = state["params"]``, ``adam = opt_state[0]``, a dict inside a
            Variable's value), is never destroyed: a copy of it is donated instead (one
            device copy, usually once). NNX modules and Variables are updated in place:
            whoever holds one sees the new state. A step that fails while
            running has consumed the donated state: its error says so; reading the
            module's Variables afterwards raises the step's error.
          allow: the pmap habits the step has on purpose, by name, not to be warned
            about: ``"mean_loss"``, ``"batch_independent_term"``,
            ``"invariant_all_reduce"`` (a name or a tuple of names). At the first call
            of each compiled program, ``run`` reads the step's trace and warns with
            :class:`jreplicate.ReplicationHabitWarning`, naming the line and the fix,
            where the step differentiates a per-replica mean loss (``jnp.mean``: an
            N-times update, since gradients of replicated arguments are summed over
            the replicas), adds a batch-independent term such as an L2 penalty
            unscaled (N-times weight decay), or all-reduces (``lax.psum`` /
            ``lax.pmean`` / ``ctx.all_sum``) a value that is already identical on
            every replica, such as the gradients. See the guide's "Warnings about
            pmap habits" (``docs/guides/getting_started.md``) for what is caught and
            what is not. Read when a program is compiled; later calls of it are not
            checked again.

        Returns:
          ``fn``'s outputs: each leaf identical on all replicas comes back as one
          replicated ``jax.Array``; each leaf that differs comes back as a
          :class:`PerReplica`. With the strategy's ``weight_update_sharding``, the new
          values of state arguments come back as global ``jax.Array`` s sharded over
          the replica axis where the level allows (see :meth:`state_shardings`); passed
          replicated (created in ``scope()``, restored), they are resharded once.

        Raises:
          StopIteration: ``inputs`` is exhausted.
          TypeError: ``fn`` is wrapped in ``jax.jit`` or ``nnx.jit`` (run compiles it).
          ValueError: an argument holds state with a leading device axis
            (``flax.jax_utils.replicate``), or another argument or batch is refused.

        Warns:
          jreplicate.input.PmapShapedBatchWarning: ``inputs`` looks shaped for
          ``jax.pmap`` (every leaf ``[devices, b, ...]``).
        """
        if not callable(fn):
            raise TypeError(f"Replicator.run(fn) must be callable, got {type(fn).__name__}.")
        donate = () if type(donate_argnums) is tuple and not donate_argnums \
            else _check_donate(donate_argnums, len(args))
        allow = habits.check_allow(allow) if allow else _NO_HABITS_ALLOWED
        if type(inputs) is tuple and inputs and all(
                isinstance(x, InputIterator) for x in inputs):
            inputs = self._zip_iterators(inputs)
        if steps is None and not isinstance(inputs, InputIterator):
            # The steady state of a training loop: a call shaped like an earlier one.
            result = self._run_again(fn, inputs is not None, inputs, args, None, donate)
            if result is not NOT_RUN:
                return result
        _porting.check_step(fn)  # (before any input is taken)
        if axis_bound(self._layout.replica_axis) or active_axis_name() is not None:
            raise RuntimeError(
                "Replicator.run was called inside a step that Replicator.run is running. "
                "A step runs on every replica already: call the inner function directly "
                "(passing it the step's ctx for collectives), or call run from outside "
                "the step."
            )
        has_batch = inputs is not None  # before get_next: an element may itself be None
        if steps is not None:
            steps = _check_steps(steps)
        if isinstance(inputs, InputIterator):
            if steps is None:
                steps = self._steps_per_run
            if not inputs.belongs_to(self):
                raise ValueError(
                    "Replicator.run(fn, inputs): `inputs` was prepared by another "
                    "Replicator. Call prepare_input on the Replicator that runs the step."
                )
            iterator = inputs
            inputs, steps = (inputs.get_next(), None) if steps is None \
                else inputs.next_steps(steps)
            try:
                result = self._executor.run_again(fn, has_batch, inputs, args, steps, donate)
                if result is NOT_RUN:
                    result = self._executor.run(fn, has_batch, inputs, args, steps=steps,
                                                donate_argnums=donate, allow=allow)
                return result
            except BaseException:
                # The step raised (or was interrupted): its batch stays for a retry.
                iterator.put_back(inputs if steps is None else (inputs, steps), steps)
                raise
        elif steps is not None and inputs is not None:
            raise TypeError(
                "Replicator.run(fn, inputs, ..., steps=K) takes its K batches from an "
                f"InputIterator (rep.prepare_input(input_fn)), not a {type(inputs).__name__}."
                " Pass the iterator, or inputs=None for a loop without input."
            )
        elif inputs is not None:
            _porting.check_global_batch(inputs, self._pmap_counts, self._layout.num_replicas,
                                        lambda x: isinstance(x, PerReplica))
            inputs = self._executor.split_batch(inputs)
        # No jax.set_mesh here: fn runs inside shard_map over this mesh, which is the
        # scope, and run stays usable under an outer jax.jit (set_mesh is not).
        return self._executor.run(fn, has_batch, inputs, args, steps=steps,
                                  donate_argnums=donate, allow=allow)

    def state_shardings(self, fn: Callable[..., Any], inputs: Any = None, *args: Any,
                        steps: int | None = None) -> tuple:
        """The shardings ``run(fn, inputs, *args)`` gives the new values of ``args``.

        Per argument, a pytree of ``NamedSharding`` (an ``nnx.State`` of them for a Flax
        NNX argument): replicated, split over the model axis, or, with the strategy's
        ``weight_update_sharding``, sharded over the replica axis as ``run`` stores it.
        The step is traced (once; ``run`` reuses the trace), nothing runs. ``inputs``
        and ``args`` may be ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape(init)``),
        so state can be created where ``run`` keeps it without a replicated copy:
        ``jax.jit(init, out_shardings=rep.state_shardings(step, batch, *abstract))``.
        An :class:`InputIterator` is read and its element put back.

        Example:
          >>> import jax, jax.numpy as jnp, optax, jreplicate as jr
          >>> rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="optimizer",
          ...                                         min_weight_shard_size=0))
          >>> tx = optax.adam(1e-2)
          >>> def step(ctx, x, w, opt):
          ...     g = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
          ...     u, opt = tx.update(g, opt, w)
          ...     return optax.apply_updates(w, u), opt
          >>> w = jax.ShapeDtypeStruct((4, 16), jnp.float32)
          >>> batch = jax.ShapeDtypeStruct((8, 4), jnp.float32)
          >>> w_s, opt_s = rep.state_shardings(step, batch, w, jax.eval_shape(tx.init, w))
          >>> w_s.spec, opt_s[0].mu.spec, opt_s[0].count.spec
          (P(), P(None, 'replica'), P())
        """
        return self._inspect("state_shardings", fn, inputs, args, steps)

    def compiled(self, fn: Callable[..., Any], inputs: Any = None, *args: Any,
                 steps: int | None = None, donate_argnums: int | Sequence[int] = ()) -> Any:
        """The ``jax.stages.Compiled`` program ``run(fn, inputs, *args)`` would call, for
        inspection (``.as_text()``, ``.memory_analysis()``, ``.cost_analysis()``); runs
        nothing. Takes what :meth:`run` takes; an :class:`InputIterator` is read and its
        element put back.

        Example:
          >>> import jax.numpy as jnp, jreplicate as jr
          >>> rep = jr.Replicator(jr.MirroredStrategy())
          >>> c = rep.compiled(lambda ctx, x: ctx.all_sum(x.sum()), jnp.ones((8, 2)))
          >>> "all-reduce" in c.as_text()
          True
        """
        donate = _check_donate(donate_argnums, len(args)) if donate_argnums != () else ()
        return self._inspect("compiled", fn, inputs, args, steps, donate_argnums=donate)

    def _inspect(self, what: str, fn: Callable, inputs: Any, args: tuple,
                 steps: int | None, **kw: Any) -> Any:
        method = getattr(self._executor, what, None)
        if method is None:
            raise TypeError(
                f"Replicator.{what} is not available with "
                f"{type(self._strategy).__name__}: its steps run on its workers, not as one "
                "compiled SPMD program.")
        if not callable(fn):
            raise TypeError(f"Replicator.{what}(fn) must be callable, got "
                            f"{type(fn).__name__}.")
        if steps is not None:
            steps = _check_steps(steps)
        has_batch = inputs is not None
        if not isinstance(inputs, InputIterator):
            if what == "compiled" and inputs is not None:
                inputs = self._executor.split_batch(inputs)
            return method(fn, has_batch, inputs, args, steps=steps, **kw)
        taken = inputs.get_next() if steps is None else inputs.next_steps(steps)
        batch, k = (taken, None) if steps is None else taken
        try:
            return method(fn, has_batch, batch, args, steps=k, **kw)
        finally:
            inputs.put_back(taken, k)

    def _zip_iterators(self, iterators: tuple) -> InputIterator:
        """``run(fn, (it1, it2, ...))``: one iterator reading all of them (the step's
        batch is the tuple of their elements), where the strategy supports it."""
        zip_inputs = getattr(self._executor, "zip_inputs", None)
        if zip_inputs is None:
            raise TypeError(
                f"Replicator.run(fn, inputs): a tuple of {len(iterators)} InputIterators "
                f"is read together only under ParameterServerStrategy's per-worker input; "
                f"{type(self._strategy).__name__} reads one. Return the tuple of elements "
                "from one input_fn, and prepare_input that.")
        for i, it in enumerate(iterators):
            if not it.belongs_to(self):
                raise ValueError(
                    f"Replicator.run(fn, inputs): inputs[{i}] was prepared by another "
                    "Replicator. Call prepare_input on the Replicator that runs the step.")
        return zip_inputs(self, iterators)

    # -- results -------------------------------------------------------------------
    def reduce(self, reduce_op: str, value: Any) -> Any:
        """Reduces per-replica values over replicas: ``"sum"`` or ``"mean"``.

        :class:`PerReplica` leaves are reduced along their replica axis; a replicated
        leaf counts as the same value on every replica (``"sum"`` multiplies it by
        ``num_replicas``).
        """
        if reduce_op not in ("sum", "mean"):
            raise ValueError(f"reduce(reduce_op={reduce_op!r}) must be 'sum' or 'mean'.")
        return self._executor.reduce(reduce_op, value)

    def local_results(self, value: Any) -> list[Any]:
        """This process's replicas' values, one pytree per local replica (replica order).

        A :class:`PerReplica` leaf gives the replica's own value; a replicated leaf the
        replica's copy (on its devices, still split over its logical devices when the
        state is model-sharded).
        """
        return self._executor.local_results(value)

    def replicate(self, value: Any) -> Any:
        """Places a pytree of arrays replicated on every replica's device."""
        return self._executor.place(value)


_NO_HABITS_ALLOWED: frozenset = frozenset()


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(
            f"Replicator.run(..., steps={steps!r}): steps must be an int >= 1, the number "
            "of steps one call runs in a device loop (or None for one step)."
        )
    return int(steps)


def _check_donate(donate_argnums: Any, num_args: int) -> tuple[int, ...]:
    if isinstance(donate_argnums, (int, np.integer)) and not isinstance(donate_argnums, bool):
        donate_argnums = (int(donate_argnums),)
    elif isinstance(donate_argnums, np.ndarray) and donate_argnums.ndim == 1:
        donate_argnums = [x for x in donate_argnums]  # np.array([0]) is falsy as a whole
    if isinstance(donate_argnums, (tuple, list)) and not donate_argnums:
        return ()
    try:
        out = tuple(sorted({int(i) for i in donate_argnums}))
        ok = all(not isinstance(i, bool) and isinstance(i, (int, np.integer))
                 for i in donate_argnums)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(not 0 <= i < num_args for i in out):
        raise ValueError(
            f"Replicator.run(..., donate_argnums={donate_argnums!r}): positions must be ints "
            f"indexing the step's {num_args} argument(s) after `inputs` (0 is the first), "
            "e.g. donate_argnums=(0, 1) for run(step, inputs, params, opt_state)."
        )
    return out
