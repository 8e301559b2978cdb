"""The ``sync_replicas`` optax transformation (TensorFlow's ``SyncReplicasOptimizer``)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jreplicate.sync import checks, spmd
from jreplicate.sync.state import SyncReplicasState, TokenQueue

_I32 = checks.I32


class _Push(NamedTuple):
    """What one ``update`` call brings to the accumulators (all int32 but ``gsum``)."""

    gsum: Any  # sum of the gradients accepted now, accumulator dtypes
    n_new: Any  # how many gradients were accepted
    prev_late: Any  # pushes for the step completed last (backup candidates)
    other_stale: Any  # pushes for older (or future) steps
    losers: Any  # fresh gradients that lose the race if this call completes the step


def sync_replicas(
    inner: optax.GradientTransformation,
    replicas_to_aggregate: int,
    total_num_replicas: int | None = None,
    variable_averages: float | None = None,
    *,
    variables_to_average: Any | Callable[[optax.Params], Any] | None = None,
    num_tokens: int | None = None,
    axis_name: str = "replica",
) -> optax.GradientTransformationExtraArgs:
    """Synchronous replica training with backup replicas: TF's ``SyncReplicasOptimizer``.

    Gradients are collected in accumulators until ``replicas_to_aggregate`` fresh ones
    of the current step arrived; their average then goes through ``inner`` in one shot
    and ``global_step`` increments once. A gradient computed at ``local_step !=
    global_step`` is stale and dropped. With ``total_num_replicas >
    replicas_to_aggregate`` the surplus replicas are backups: the slowest gradients of
    each step are dropped. With ``total_num_replicas < replicas_to_aggregate`` replicas
    contribute several batches per update. Unlike TensorFlow, drops are counted:
    ``state.dropped_stale`` and ``state.dropped_backup``.

    ``update(grads, state, params, *, local_step=None, arrival_time=None)`` has two
    drivers, chosen by whether mesh axis ``axis_name`` is bound in the current trace:

    * **SPMD driver** (inside ``jax.shard_map`` over ``axis_name``, e.g. in
      ``jreplicate.Replicator.run``): every replica calls ``update`` together with ITS
      OWN gradient (see :func:`replica_value_and_grad`; plain ``jax.grad`` of replicated
      params is already summed over replicas and is rejected). ``arrival_time`` (a
      per-replica scalar, default equal for all, ties broken by replica id; or a vector
      of every replica's time, identical on all replicas, which saves an all-reduce)
      orders the replicas: the fastest ``replicas_to_aggregate - state.num_accumulated`` fresh
      gradients are aggregated (one ``psum``) and the rest count as dropped backups, so
      stragglers are simulated deterministically in one compiled step. Every replica
      leaves ``update`` with the same state and the same updates; the step itself is
      the token barrier, so replicas are always fresh unless ``local_step`` says
      otherwise. With ``replicas_to_aggregate == total`` this is plain synchronous
      data-parallel training. The arrival order is a total order whatever the times
      (compared as float32): ``-inf`` first, then finite times (``-0.0`` equals
      ``0.0``), ``+inf`` after every finite time, NaN after ``+inf`` (the last to
      arrive, still averaged in if needed), and equal times (NaN among them) by
      replica id; so exactly ``min(replicas_to_aggregate - state.num_accumulated,
      fresh)`` gradients are averaged in, never more. Times known when ``update`` is
      traced (a constant, a NumPy array) must not be NaN: ``ValueError``.
    * **Host driver** (outside a replica context): each call is ONE replica's push of a
      gradient computed at ``local_step`` (default: the current ``global_step``). The
      updates are zero until the ``replicas_to_aggregate``-th fresh push of the step,
      which returns ``inner``'s update of the average; ``state.global_step`` has then
      incremented. Replicas take their next ``local_step`` with :func:`take_token`. With
      one replica and no ``local_step`` this equals ``optax.MultiSteps(inner,
      replicas_to_aggregate, use_grad_mean=True)``.

    Args:
      inner: the transformation applied to each averaged gradient, e.g. ``optax.sgd``.
      replicas_to_aggregate: gradients averaged into each update (>= 1).
      total_num_replicas: replicas pushing gradients (>= 1); default
        ``replicas_to_aggregate`` (host driver) or the replica axis size (SPMD driver,
        which requires the two to be equal when given).
      variable_averages: decay of exponential moving averages of the params, updated
        after each aggregated update (TF's ``ExponentialMovingAverage``); read them with
        :func:`averaged_params` or ``state.ema``.
      variables_to_average: which params to average: a pytree of bools like params, or
        a function of params returning one; default all.
      num_tokens: initial tokens of the queue, all carrying the starting
        ``global_step``; default ``replicas_to_aggregate``. Must be ``>=
        replicas_to_aggregate - total_num_replicas``.
      axis_name: the replica mesh axis of the SPMD driver.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SyncReplicasState`. Extra keyword arguments other than ``local_step`` and
      ``arrival_time`` are passed on to ``inner``.

    Raises:
      ValueError / TypeError: for invalid arguments, at construction, ``init`` or
        ``update`` (empty or mismatched gradients, too few tokens, a NaN arrival time
        known at trace time, ...).

    Example (host driver, TensorFlow's two-worker test):
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas, take_token
      >>> tx = sync_replicas(optax.sgd(2.0), replicas_to_aggregate=2)
      >>> params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
      >>> state = tx.init(params)
      >>> for w in (0, 1):  # both workers push at local_step 0
      ...     g = {"v0": jnp.array(0.1 + 0.2 * w), "v1": jnp.array(0.9 + 0.2 * w)}
      ...     updates, state = tx.update(g, state, params, local_step=0)
      ...     params = optax.apply_updates(params, updates)
      >>> int(state.global_step), round(float(params["v0"]), 6)
      (1, -0.4)

    Example (SPMD driver, 4 replicas, the slowest one is a dropped backup):
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jreplicate.sync import replica_grad
      >>> mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=3)
      >>> def step(w, state, x, t):
      ...     g = replica_grad(lambda w: jnp.sum(w * x))(w)
      ...     updates, state = tx.update(g, state, w, arrival_time=t[0])
      ...     return optax.apply_updates(w, updates), state
      >>> shard = lambda a: jax.device_put(jnp.array(a), jax.NamedSharding(mesh, P("replica")))
      >>> x, t = shard([1.0, 2.0, 3.0, 100.0]), shard([0.3, 0.1, 0.2, 9.0])
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica"),
      ...               P("replica")), out_specs=(P(), P())))
      >>> w, state = run(jnp.array(0.0), tx.init(jnp.array(0.0)), x, t)
      >>> float(w), int(state.dropped_backup)
      (-2.0, 1)
    """
    k = checks.check_count(
        "replicas_to_aggregate", replicas_to_aggregate, "gradients averaged per update"
    )
    total = None
    if total_num_replicas is not None:
        total = checks.check_count(
            "total_num_replicas",
            total_num_replicas,
            "replicas pushing gradients; None means replicas_to_aggregate",
        )
    host_total = k if total is None else total
    n_tokens = checks.check_num_tokens(num_tokens, k, host_total)
    decay = None
    if variable_averages is not None:
        if isinstance(variable_averages, bool) or not isinstance(variable_averages, numbers.Real):
            raise TypeError(
                "variable_averages must be a moving-average decay (a float in [0, 1], "
                f"e.g. 0.999) or None, got {variable_averages!r}."
            )
        if not 0.0 <= float(variable_averages) <= 1.0:
            raise ValueError(
                f"variable_averages must be a decay in [0, 1], got {variable_averages}."
            )
        decay = float(variable_averages)
    elif variables_to_average is not None:
        raise ValueError(
            "variables_to_average is only used with variable_averages; pass "
            "variable_averages=<decay>, e.g. 0.999."
        )
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            "inner must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), got "
            f"{type(inner).__name__}."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SyncReplicasState:
        if not jax.tree.leaves(params):
            raise ValueError(
                "sync_replicas: Must supply at least one variable, but params "
                f"{params!r} has no arrays. Pass the pytree of trainable arrays."
            )
        ema = None
        if decay is not None:
            mask = checks.resolve_mask(variables_to_average, params)
            ema = jax.tree.map(lambda p, m: jnp.array(p) if m else None, params, mask)
        return SyncReplicasState(
            accumulators=jax.tree.map(jnp.zeros_like, params),
            num_accumulated=checks.zero(),
            global_step=checks.zero(),
            tokens=TokenQueue(
                head_step=checks.zero(),
                head_count=jnp.full((), n_tokens, _I32),
                per_step=jnp.full((), max(host_total, k), _I32),
            ),
            inner_state=inner.init(params),
            ema=ema,
            late_this_step=checks.zero(),
            dropped_stale=checks.zero(),
            dropped_backup=checks.zero(),
        )

    def host_push(grads: Any, state: SyncReplicasState, local_step: Any) -> _Push:
        gs = state.global_step
        ls = gs if local_step is None else checks.as_scalar(local_step, "local_step", _I32, "int")
        fresh = ls == gs
        gsum = jax.tree.map(
            lambda g, a: jnp.where(fresh, g.astype(a.dtype), jnp.zeros((), a.dtype)),
            grads,
            state.accumulators,
        )
        prev_late = (~fresh & (ls == gs - 1)).astype(_I32)
        return _Push(
            gsum,
            fresh.astype(_I32),
            prev_late,
            (~fresh).astype(_I32) - prev_late,
            jnp.zeros((), _I32),
        )

    def spmd_update(
        grads: Any,
        state: SyncReplicasState,
        params: Any,
        local_step: Any,
        arrival_time: Any,
        n: int,
        extra_args: dict,
    ) -> tuple[optax.Updates, SyncReplicasState]:
        checks.check_own_gradients(grads, axis_name)
        checks.check_arrival_time(arrival_time)
        gs = state.global_step
        me = jax.lax.axis_index(axis_name)
        needed = k - state.num_accumulated
        if local_step is None and arrival_time is None:
            contrib = me < needed
            n_fresh = jnp.asarray(n, _I32)
            prev_late = other_stale = jnp.zeros((), _I32)
        else:
            ls = (
                gs
                if local_step is None
                else checks.as_scalar(local_step, "local_step", _I32, "int")
            )
            t_vec = spmd.replicated_vector(arrival_time, axis_name, n, "arrival_time")
            if t_vec is not None:  # every replica already knows every arrival time
                ls_vec = (jnp.full((n,), gs, _I32) if local_step is None
                          else spmd.gather_scalars([ls], axis_name, n)[0])
            else:
                t = (
                    jnp.zeros((), jnp.float32)
                    if arrival_time is None
                    else checks.as_scalar(arrival_time, "arrival_time", jnp.float32, "a time")
                )
                ls_vec, t_vec = spmd.gather_scalars([ls, t], axis_name, n)
            fresh = ls_vec == gs
            # earlier[j, i]: replica i's gradient arrives before replica j's (a total
            # order even with NaN, infinities and ties: exact ranks, exact counts).
            earlier = spmd.arrives_before(t_vec)
            rank = jnp.sum(earlier & fresh[None, :], axis=1)
            contrib = (fresh & (rank < needed))[me]
            n_fresh = jnp.sum(fresh).astype(_I32)
            # A gradient for the step before arriving after the one that completes this
            # step is two steps late by then: stale, as in the host driver.
            completer = fresh & (rank == needed - 1)
            after_update = jnp.any(earlier & completer[None, :], axis=1)
            prev_late = jnp.sum(~fresh & (ls_vec == gs - 1) & ~after_update).astype(_I32)
            other_stale = jnp.sum(~fresh).astype(_I32) - prev_late
        if local_step is None and n >= k:
            # Every call completes a step (n fresh gradients >= the needed ones).
            return _complete_step(
                grads, state, params, contrib, needed, n, extra_args, everyone_if_first=k == n
            )
        gsum = _masked_psum(grads, contrib, state.accumulators)
        push = _Push(
            gsum,
            jnp.minimum(n_fresh, needed).astype(_I32),
            prev_late,
            other_stale,
            jnp.maximum(n_fresh - needed, 0).astype(_I32),
        )
        return _finish(push, state, params, max(n - k, 0), extra_args)

    def _masked_psum(grads: Any, contrib: Any, like: Any) -> Any:
        return jax.lax.psum(
            jax.tree.map(
                lambda g, a: jnp.where(contrib, g.astype(a.dtype), jnp.zeros((), a.dtype)),
                grads,
                like,
            ),
            axis_name,
        )

    def _complete_step(
        grads: Any,
        state: SyncReplicasState,
        params: Any,
        contrib: Any,
        needed: Any,
        n: int,
        extra_args: dict,
        everyone_if_first: bool,
    ) -> tuple[optax.Updates, SyncReplicasState]:
        """SPMD step known to complete: no branch around ``inner``, so XLA can fuse it.

        The accumulators are read only when a previous call left gradients in them
        (``num_accumulated > 0``, e.g. from the host driver).
        """
        acc = state.accumulators
        first = state.num_accumulated == 0

        def fresh_start(grads, acc):
            if everyone_if_first:  # all n replicas contribute: no masking pass
                return jax.lax.psum(jax.tree.map(checks.cast_like, grads, acc), axis_name)
            return _masked_psum(grads, contrib, acc)

        def continued(grads, acc):
            return jax.tree.map(jnp.add, _masked_psum(grads, contrib, acc), acc)

        # The accumulators are left as they are (they are only read while
        # num_accumulated > 0), so they are neither copied nor written here.
        total = jax.lax.cond(first, fresh_start, continued, grads, acc)
        avg = jax.tree.map(lambda a: a / k, total)
        upd, inner_state = inner.update(avg, state.inner_state, params, **extra_args)
        losers = n - needed
        backup = jnp.minimum(losers, n - k)
        return upd, state._replace(
            accumulators=acc,
            num_accumulated=jnp.zeros_like(state.num_accumulated),
            global_step=state.global_step + 1,
            inner_state=inner_state,
            ema=_averaged(state.ema, params, upd),
            late_this_step=losers.astype(_I32),
            dropped_stale=(state.dropped_stale + losers - backup).astype(_I32),
            dropped_backup=(state.dropped_backup + backup).astype(_I32),
        )

    def _averaged(ema: Any, params: Any, upd: Any) -> Any:
        if ema is None:
            return None
        new_params = optax.apply_updates(params, upd)
        return jax.tree.map(
            lambda e, p: None if e is None else e - (1.0 - decay) * (e - p),
            ema,
            new_params,
            is_leaf=checks.is_none,
        )

    def update_fn(
        updates: optax.Updates,
        state: SyncReplicasState,
        params: optax.Params | None = None,
        *,
        local_step: Any = None,
        arrival_time: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SyncReplicasState]:
        if not isinstance(state, SyncReplicasState):
            raise ValueError(
                "sync_replicas: update() needs the state returned by tx.init(params), got "
                f"{type(state).__name__}."
            )
        checks.check_grads(updates, state, params)
        if decay is not None and params is None:
            raise ValueError(
                "sync_replicas(variable_averages=...) needs the params: call "
                "tx.update(grads, state, params)."
            )
        n = spmd.bound_axis_size(axis_name)
        if n is None:
            if arrival_time is not None:
                raise ValueError(
                    "arrival_time is only used inside a replica context (shard_map over "
                    f"axis {axis_name!r}); the host driver takes pushes in call order."
                )
            if local_step is not None:
                local_step = checks.as_scalar(local_step, "local_step", _I32, "int")
            args = (updates, state, params, local_step, extra_args)
            if checks.compilable(args):  # eager call: run one cached compiled program
                return host_update_jit(*args)
            return host_update(*args)
        else:
            if total is not None and total != n:
                raise ValueError(
                    f"total_num_replicas={total} but the {axis_name!r} mesh axis has {n} "
                    f"replicas; pass total_num_replicas={n} or None."
                )
            return spmd_update(updates, state, params, local_step, arrival_time, n, extra_args)

    def host_update(grads, state, params, local_step, extra_args):
        push = host_push(grads, state, local_step)
        return _finish(push, state, params, max(host_total - k, 0), extra_args)

    host_update_jit = jax.jit(host_update)

    def _finish(
        push: _Push, state: SyncReplicasState, params: Any, quota: int, extra_args: dict
    ) -> tuple[optax.Updates, SyncReplicasState]:
        """Adds a push to the accumulators; applies ``inner`` (under ``lax.cond``) when
        the step is complete."""
        count = state.num_accumulated + push.n_new
        apply = count >= k
        room = jnp.maximum(quota - state.late_this_step, 0)
        backup = jnp.minimum(push.prev_late, room)
        stale = push.prev_late - backup + push.other_stale
        late = state.late_this_step + push.prev_late
        # Accumulators hold garbage while num_accumulated == 0 (see SyncReplicasState).
        first = state.num_accumulated == 0
        acc = jax.tree.map(lambda a, g: jnp.where(first, g, a + g), state.accumulators, push.gsum)

        def do_apply(acc, inner_state, ema):
            avg = jax.tree.map(lambda a: a / count.astype(a.dtype), acc)
            upd, inner_state = inner.update(avg, inner_state, params, **extra_args)
            return upd, inner_state, _averaged(ema, params, upd)

        operands = (acc, state.inner_state, state.ema)
        applied = jax.eval_shape(do_apply, *operands)

        def applied_branch(acc, inner_state, ema):
            out = do_apply(acc, inner_state, ema)
            return spmd.match_varying(out, (applied[0], inner_state, ema))

        def skipped_branch(acc, inner_state, ema):
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), applied[0])
            return spmd.match_varying((zeros, inner_state, ema), applied)

        upd, inner_state, ema = jax.lax.cond(apply, applied_branch, skipped_branch, *operands)
        backup_after = jnp.where(apply, jnp.minimum(push.losers, quota), 0)
        stale_after = jnp.where(apply, push.losers, 0) - backup_after
        return upd, SyncReplicasState(
            accumulators=acc,
            num_accumulated=jnp.where(apply, 0, count).astype(_I32),
            global_step=(state.global_step + apply).astype(_I32),
            tokens=state.tokens,
            inner_state=inner_state,
            ema=ema,
            late_this_step=jnp.where(apply, push.losers, late).astype(_I32),
            dropped_stale=(state.dropped_stale + stale + stale_after).astype(_I32),
            dropped_backup=(state.dropped_backup + backup + backup_after).astype(_I32),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
