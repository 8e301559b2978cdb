"""The steps of :func:`jreplicate.sync_replicas` as pure functions (private).

``transform.py`` validates the options into a :class:`Config` and hands each
``update`` to one of the two drivers here: :func:`host_update` (each call is ONE
replica's push) or :func:`spmd_update` (every replica at once, inside ``shard_map``).
Both reduce the arrivals to a :class:`Push` of counts -- :func:`host_counts` for one
push, :func:`spmd_counts` for a vector of them -- and both completion paths
(:func:`finish`, which applies ``inner`` under ``lax.cond``, and :func:`complete_step`,
for an SPMD step known to complete) count it in with :func:`accumulate`, the one place
the accepted, stale and backup counters are computed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jreplicate.sync import checks, spmd
from jreplicate.sync.state import SyncReplicasState

_I32 = checks.I32


@dataclasses.dataclass(frozen=True)
class Config:
    """The validated options of one :func:`jreplicate.sync_replicas` transformation."""

    inner: optax.GradientTransformationExtraArgs
    k: int  # replicas_to_aggregate
    total: int | None  # total_num_replicas as given (None: k, or the axis size)
    n_tokens: int
    decay: float | None  # variable_averages
    variables_to_average: Any
    axis_name: str | None  # None: the active run's replica axis (resolved per update)

    @property
    def host_total(self) -> int:
        """Replicas pushing gradients to the host driver."""
        return self.k if self.total is None else self.total


class Push(NamedTuple):
    """What one ``update`` call brings to the accumulators (all int32 but ``gsum``)."""

    gsum: Any  # sum of the gradients accepted now, accumulator dtypes (None: counts only)
    n_new: Any  # how many gradients were accepted
    prev_late: Any  # pushes for the step completed last (backup candidates)
    other_stale: Any  # pushes for older (or future) steps
    losers: Any  # fresh gradients that lose the race if this call completes the step


class Counters(NamedTuple):
    """The counting fields of :class:`SyncReplicasState` after one push."""

    num_accumulated: jax.Array
    global_step: jax.Array
    late_this_step: jax.Array
    dropped_stale: jax.Array
    dropped_backup: jax.Array


def accumulate(
    state: SyncReplicasState, push: Push, k: int, quota: int
) -> tuple[jax.Array, Counters]:
    """Counts one push in: whether it completes the step, and the new counters.

    A push for the step completed last is a dropped backup while that step's quota of
    backups (``quota``: ``total_num_replicas - replicas_to_aggregate``, at least 0)
    lasts, stale after; older (or future) pushes are stale. When the push completes
    the step (``k`` accepted gradients), its ``losers`` are the next step's late ones.
    """
    count = state.num_accumulated + push.n_new
    apply = count >= k
    room = jnp.maximum(quota - state.late_this_step, 0)
    backup = jnp.minimum(push.prev_late, room)
    stale = push.prev_late - backup + push.other_stale
    late = state.late_this_step + push.prev_late
    backup_after = jnp.where(apply, jnp.minimum(push.losers, quota), 0)
    stale_after = jnp.where(apply, push.losers, 0) - backup_after
    return apply, Counters(
        num_accumulated=jnp.where(apply, 0, count).astype(_I32),
        global_step=(state.global_step + apply).astype(_I32),
        late_this_step=jnp.where(apply, push.losers, late).astype(_I32),
        dropped_stale=(state.dropped_stale + stale + stale_after).astype(_I32),
        dropped_backup=(state.dropped_backup + backup + backup_after).astype(_I32),
    )


def host_counts(local_step: Any, global_step: Any) -> Push:
    """The counts of ONE push computed at ``local_step`` (``gsum`` left ``None``)."""
    fresh = local_step == global_step
    prev_late = (~fresh & (local_step == global_step - 1)).astype(_I32)
    return Push(
        None, fresh.astype(_I32), prev_late, (~fresh).astype(_I32) - prev_late,
        jnp.zeros((), _I32),
    )


def spmd_counts(
    local_steps: jax.Array, times: jax.Array, global_step: Any, needed: Any
) -> tuple[jax.Array, Push]:
    """Which replicas contribute, and the counts, for every replica's push at once.

    ``local_steps`` and ``times`` are every replica's (identical on all replicas); the
    fastest ``needed`` fresh gradients contribute. A gradient for the step before that
    arrives after the one completing this step is two steps late by then: stale, as
    when the host driver takes the same pushes one by one in arrival order.
    """
    fresh = local_steps == global_step
    # earlier[j, i]: replica i's gradient arrives before replica j's (a total
    # order even with NaN, infinities and ties: exact ranks, exact counts).
    earlier = spmd.arrives_before(times)
    rank = jnp.sum(earlier & fresh[None, :], axis=1)
    contrib = fresh & (rank < needed)
    completer = fresh & (rank == needed - 1)
    after_update = jnp.any(earlier & completer[None, :], axis=1)
    prev_late = jnp.sum(~fresh & (local_steps == global_step - 1) & ~after_update)
    prev_late = prev_late.astype(_I32)
    other_stale = jnp.sum(~fresh).astype(_I32) - prev_late
    return contrib, _race(jnp.sum(fresh).astype(_I32), needed, prev_late, other_stale)


def _race(n_fresh: Any, needed: Any, prev_late: Any, other_stale: Any) -> Push:
    """The counts of ``n_fresh`` fresh gradients racing for ``needed`` places."""
    return Push(
        None,
        jnp.minimum(n_fresh, needed).astype(_I32),
        prev_late,
        other_stale,
        jnp.maximum(n_fresh - needed, 0).astype(_I32),
    )


def _masked(grads: Any, keep: Any, like: Any) -> Any:
    """``grads`` in the dtypes of ``like`` where ``keep``, zeros elsewhere."""
    return jax.tree.map(
        lambda g, a: jnp.where(keep, g.astype(a.dtype), jnp.zeros((), a.dtype)), grads, like
    )


def host_update(
    cfg: Config, grads: Any, state: SyncReplicasState, params: Any, local_step: Any,
    extra_args: dict,
) -> tuple[optax.Updates, SyncReplicasState]:
    """The host driver: ONE replica's push of ``grads`` computed at ``local_step``."""
    gs = state.global_step
    ls = gs if local_step is None else checks.as_scalar(local_step, "local_step", _I32, "int")
    push = host_counts(ls, gs)
    push = push._replace(gsum=_masked(grads, ls == gs, state.accumulators))
    return finish(cfg, push, state, params, max(cfg.host_total - cfg.k, 0), extra_args)


def spmd_update(
    cfg: Config, grads: Any, state: SyncReplicasState, params: Any, local_step: Any,
    arrival_time: Any, n: int, extra_args: dict,
) -> tuple[optax.Updates, SyncReplicasState]:
    """The SPMD driver: every one of the ``n`` replicas pushes its own ``grads``."""
    axis = cfg.axis_name
    checks.check_own_gradients(grads, axis)
    checks.check_arrival_time(arrival_time)
    needed = cfg.k - state.num_accumulated
    me = jax.lax.axis_index(axis)
    if local_step is None and arrival_time is None:  # all fresh, ordered by replica id
        contrib = me < needed
        none = jnp.zeros((), _I32)
        push = _race(jnp.asarray(n, _I32), needed, none, none)
    else:
        local_steps, times = _gather_arrivals(cfg, state.global_step, local_step,
                                              arrival_time, n)
        contrib, push = spmd_counts(local_steps, times, state.global_step, needed)
        contrib = contrib[me]
    if local_step is None and n >= cfg.k:
        # Every call completes a step (n fresh gradients >= the needed ones).
        return complete_step(cfg, grads, state, params, contrib, push, n, extra_args)
    push = push._replace(gsum=jax.lax.psum(_masked(grads, contrib, state.accumulators), axis))
    return finish(cfg, push, state, params, max(n - cfg.k, 0), extra_args)


def _gather_arrivals(
    cfg: Config, gs: Any, local_step: Any, arrival_time: Any, n: int
) -> tuple[jax.Array, jax.Array]:
    """Every replica's local step and arrival time, identical on all replicas."""
    axis = cfg.axis_name
    ls = gs if local_step is None else checks.as_scalar(local_step, "local_step", _I32, "int")
    times = spmd.replicated_vector(arrival_time, axis, n, "arrival_time")
    if times is not None:  # every replica already knows every arrival time
        if local_step is None:
            return jnp.full((n,), gs, _I32), times
        return spmd.gather_scalars([ls], axis, n)[0], times
    t = (
        jnp.zeros((), jnp.float32)
        if arrival_time is None
        else checks.as_scalar(arrival_time, "arrival_time", jnp.float32, "a time")
    )
    local_steps, times = spmd.gather_scalars([ls, t], axis, n)
    return local_steps, times


def complete_step(
    cfg: Config, grads: Any, state: SyncReplicasState, params: Any, contrib: Any,
    push: Push, n: int, extra_args: dict,
) -> tuple[optax.Updates, SyncReplicasState]:
    """SPMD step known to complete: no branch around ``inner``, so XLA can fuse it.

    The accumulators are read only when a previous call left gradients in them
    (``num_accumulated > 0``, e.g. from the host driver), and are left as they are
    (they are only read while ``num_accumulated > 0``): neither copied nor written.
    They are read after the sum over the replicas, never inside a branch holding it, so
    that only the update (identical on every replica) reads them: with
    ``weight_update_sharding`` they stay sharded like the optimizer state.
    """
    axis, acc = cfg.axis_name, state.accumulators
    first = state.num_accumulated == 0
    if cfg.k == n:  # all n replicas contribute unless earlier pushes were accumulated
        mine = jax.lax.cond(first, lambda g: jax.tree.map(checks.cast_like, g, acc),
                            lambda g: _masked(g, contrib, acc), grads)
    else:
        mine = _masked(grads, contrib, acc)
    summed = jax.lax.psum(mine, axis)
    total = jax.lax.cond(first, lambda s, a: s, lambda s, a: jax.tree.map(jnp.add, s, a),
                         summed, acc)
    avg = jax.tree.map(lambda a: a / cfg.k, total)
    upd, inner_state = cfg.inner.update(avg, state.inner_state, params, **extra_args)
    _, counters = accumulate(state, push, cfg.k, n - cfg.k)
    return upd, state._replace(
        inner_state=inner_state, ema=averaged(cfg.decay, state.ema, params, upd),
        **counters._asdict(),
    )


def finish(
    cfg: Config, push: Push, state: SyncReplicasState, params: Any, quota: int,
    extra_args: dict,
) -> tuple[optax.Updates, SyncReplicasState]:
    """Adds a push to the accumulators; applies ``inner`` (under ``lax.cond``) when
    the step is complete."""
    apply, counters = accumulate(state, push, cfg.k, quota)
    count = state.num_accumulated + push.n_new
    # Accumulators hold garbage while num_accumulated == 0 (see SyncReplicasState).
    first = state.num_accumulated == 0
    acc = jax.tree.map(lambda a, g: jnp.where(first, g, a + g), state.accumulators, push.gsum)

    def do_apply(acc, inner_state, ema):
        avg = jax.tree.map(lambda a: a / count.astype(a.dtype), acc)
        upd, inner_state = cfg.inner.update(avg, inner_state, params, **extra_args)
        return upd, inner_state, averaged(cfg.decay, ema, params, upd)

    operands = (acc, state.inner_state, state.ema)
    applied = jax.eval_shape(do_apply, *operands)

    def applied_branch(acc, inner_state, ema):
        out = do_apply(acc, inner_state, ema)
        return spmd.match_varying(out, (applied[0], inner_state, ema))

    def skipped_branch(acc, inner_state, ema):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), applied[0])
        return spmd.match_varying((zeros, inner_state, ema), applied)

    upd, inner_state, ema = jax.lax.cond(apply, applied_branch, skipped_branch, *operands)
    return upd, SyncReplicasState(
        accumulators=acc, tokens=state.tokens, inner_state=inner_state, ema=ema,
        **counters._asdict(),
    )


def averaged(decay: float | None, ema: Any, params: Any, upd: Any) -> Any:
    """The moving averages after the update ``upd`` of ``params`` (``None``: none kept)."""
    if ema is None:
        return None
    new_params = optax.apply_updates(params, upd)
    return jax.tree.map(
        lambda e, p: None if e is None else e - (1.0 - decay) * (e - p),
        ema,
        new_params,
        is_leaf=checks.is_none,
    )
