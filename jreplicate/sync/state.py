"""State of :func:`jreplicate.sync_replicas` and the token-queue API.

The token queue of TensorFlow's ``SyncReplicasOptimizer`` is a FIFO of ``global_step``
values: the chief fills it with ``num_tokens`` copies of the starting step, and after
every aggregated update it appends ``tokens_per_step = max(total_num_replicas,
replicas_to_aggregate)`` copies of the new step. A replica dequeues one token after each
push and uses it as the ``local_step`` of its next gradient.

Because every block appended after an update holds ``tokens_per_step`` copies of the new
step, the whole queue is determined by the token at its head and how many copies of it
are left: :class:`TokenQueue` stores exactly that, in three int32 scalars, so the queue
lives in the optimizer state, is a fixed-shape pytree and works under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TokenQueue(NamedTuple):
    """A FIFO of ``global_step`` tokens, stored in constant space.

    The queue holds ``head_count`` tokens of value ``head_step``, then
    ``per_step`` tokens of each value ``head_step + 1, ..., global_step``.

    Example (three tokens of step 0 to start, two per later step):
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=2, num_tokens=3)
      >>> q = tx.init(jnp.zeros(2)).tokens
      >>> int(q.head_step), int(q.head_count), int(q.per_step)
      (0, 3, 2)
    """

    head_step: jax.Array
    """The value of the token at the head of the queue (int32)."""
    head_count: jax.Array
    """How many tokens of value ``head_step`` are left (int32)."""
    per_step: jax.Array
    """Tokens appended after each update, ``max(total, replicas_to_aggregate)`` (int32)."""


class SyncReplicasState(NamedTuple):
    """Optimizer state of :func:`jreplicate.sync_replicas`.

    Every field is a pytree of arrays, so the state can be checkpointed, passed through
    ``jax.jit`` and replicated across devices like any optax state.

    Example (two replicas' gradients make one update; a third, late one is dropped):
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=2)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> for g in (1.0, 3.0, 5.0):  # every gradient computed at step 0
      ...     updates, state = tx.update(jnp.full(2, g), state, params, local_step=0)
      >>> int(state.global_step), int(state.num_accumulated), int(state.dropped_stale)
      (1, 0, 1)
    """

    accumulators: optax.Updates
    """Sum of the gradients accepted for the current step (same structure as params).
    Meaningful only while ``num_accumulated > 0``: once a step is applied they are left
    as they are (not zeroed, which would cost a pass over memory every step) and the
    next accepted gradient overwrites them."""
    num_accumulated: jax.Array
    """How many gradients ``accumulators`` holds (int32)."""
    global_step: jax.Array
    """Number of aggregated updates applied so far (int32)."""
    tokens: TokenQueue
    """The token queue of the host driver (see :func:`take_token`)."""
    inner_state: optax.OptState
    """State of the wrapped transformation; advances once per aggregated update."""
    ema: Any
    """Moving averages of the params (``None`` leaves for params not averaged), or
    ``None`` without ``variable_averages``; see :func:`averaged_params`."""
    late_this_step: jax.Array
    """Late gradients seen for the step completed last (int32; used to tell backups
    from stale gradients)."""
    dropped_stale: jax.Array
    """Gradients dropped because they were computed at an old ``local_step`` (int32)."""
    dropped_backup: jax.Array
    """Gradients dropped because ``replicas_to_aggregate`` faster ones of the same step
    had already been aggregated (int32; at most ``total_num_replicas -
    replicas_to_aggregate`` a step)."""


def _is_state(x: Any) -> bool:
    return isinstance(x, SyncReplicasState)


def find_state(opt_state: Any, caller: str) -> SyncReplicasState:
    """Returns the :class:`SyncReplicasState` inside ``opt_state`` (which may be nested).

    Raises:
      ValueError: if ``opt_state`` holds no, or several, ``SyncReplicasState``.
    """
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    if not found:
        raise ValueError(
            f"{caller} needs the optimizer state returned by tx.init(params) for "
            f"tx = jreplicate.sync_replicas(...), but got {type(opt_state).__name__} "
            "holding no SyncReplicasState: the token queue and accumulators do not exist "
            "before the transform is initialised. Call state = tx.init(params) first and "
            "pass that state."
        )
    if len(found) > 1:
        raise ValueError(
            f"{caller}: the optimizer state holds {len(found)} SyncReplicasState; pass "
            "the one of the sync_replicas transform you mean (e.g. state[i] of a chain)."
        )
    return found[0]


def _replace_state(opt_state: Any, new: SyncReplicasState) -> Any:
    return jax.tree.map(lambda s: new if _is_state(s) else s, opt_state, is_leaf=_is_state)


def tokens_available(opt_state: Any) -> jax.Array:
    """Number of tokens a replica can take from the queue without blocking.

    Args:
      opt_state: the state of a ``sync_replicas`` transform, or a state containing one
        (e.g. of an ``optax.chain``).

    Returns:
      An int32 scalar.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas, tokens_available
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=2, num_tokens=3)
      >>> int(tokens_available(tx.init(jnp.zeros(2))))
      3
    """
    s = find_state(opt_state, "tokens_available()")
    q = s.tokens
    return q.head_count + q.per_step * (s.global_step - q.head_step)


def take_token(opt_state: Any) -> tuple[jax.Array, Any]:
    """Dequeues one token: the ``local_step`` at which a replica computes its next gradient.

    This is the replica's half of TensorFlow's barrier: after pushing its gradient with
    ``tx.update(grads, state, params, local_step=s)``, a replica of the host driver takes
    a token and uses its value as the ``local_step`` of its next push. The first tokens
    (``num_tokens`` of them) carry the starting ``global_step``, so right after start-up
    the gradients of the round that follows the first update are dropped as stale, as in
    TensorFlow.

    Args:
      opt_state: the state of a ``sync_replicas`` transform, or a state containing one.

    Returns:
      ``(token, new_opt_state)``: the int32 token and the state without it. Under
      ``jax.jit`` an empty queue cannot raise; ``token`` is then ``-1`` and the queue is
      unchanged.

    Raises:
      ValueError: if ``opt_state`` is not (and holds no) initialised ``sync_replicas``
        state.
      RuntimeError: if the queue is empty (TensorFlow's dequeue would block until the
        next update appends tokens).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas, take_token
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=1)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> step, state = take_token(state)
      >>> updates, state = tx.update(jnp.ones(2), state, params, local_step=step)
      >>> int(state.global_step), int(take_token(state)[0])
      (1, 1)
    """
    s = find_state(opt_state, "take_token()")
    q = s.tokens
    advance = (q.head_count == 0) & (q.head_step < s.global_step)
    head_step = jnp.where(advance, q.head_step + 1, q.head_step)
    head_count = jnp.where(advance, q.per_step, q.head_count)
    available = head_count > 0
    if not isinstance(available, jax.core.Tracer) and not bool(available):
        raise RuntimeError(
            "take_token(): the token queue is empty; TensorFlow's dequeue would block "
            "here until the replicas_to_aggregate-th fresh gradient of step "
            f"{int(s.global_step)} arrives and the update appends new tokens. Push "
            "gradients with tx.update(..., local_step=...) from the other replicas "
            "first, or start with more tokens (sync_replicas(..., num_tokens=...))."
        )
    token = jnp.where(available, head_step, -1).astype(jnp.int32)
    new_q = TokenQueue(
        head_step=head_step.astype(jnp.int32),
        head_count=jnp.where(available, head_count - 1, head_count).astype(jnp.int32),
        per_step=q.per_step,
    )
    return token, _replace_state(opt_state, s._replace(tokens=new_q))


def averaged_params(opt_state: Any, params: optax.Params) -> optax.Params:
    """Returns ``params`` with the averaged leaves replaced by their moving averages.

    The averages (``variable_averages`` of :func:`jreplicate.sync_replicas`) are updated
    only when an aggregated update is applied, from the params after that update. Use
    the result for evaluation, as TensorFlow's ``ExponentialMovingAverage`` shadows are.

    Args:
      opt_state: the state of a ``sync_replicas`` transform, or a state containing one.
      params: the current params; leaves that are not averaged are taken from here.

    Raises:
      ValueError: if the transform was built without ``variable_averages``, or the
        structure of ``params`` differs from the one the state was initialised with.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas, averaged_params
      >>> tx = sync_replicas(optax.sgd(1.0), 1, variable_averages=0.5)
      >>> params = jnp.zeros(2)
      >>> updates, state = tx.update(jnp.ones(2), tx.init(params), params)
      >>> params = optax.apply_updates(params, updates)
      >>> averaged_params(state, params).tolist()
      [-0.5, -0.5]
    """
    s = find_state(opt_state, "averaged_params()")
    if s.ema is None:
        raise ValueError(
            "averaged_params(): this sync_replicas transform keeps no moving averages; "
            "build it with sync_replicas(..., variable_averages=0.999) (a decay)."
        )
    try:
        return jax.tree.map(
            lambda e, p: p if e is None else e, s.ema, params, is_leaf=lambda x: x is None
        )
    except ValueError as err:
        raise ValueError(
            "averaged_params(): params does not have the structure of the params the "
            f"state was initialised with: {err}"
        ) from None
