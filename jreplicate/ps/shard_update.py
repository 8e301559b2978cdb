"""The jitted optax update of one parameter-server shard's pieces (both carriers).

:class:`ShardUpdate` compiles a shard's update once, when the shard is built, so that
no push compiles while holding the shard's lock; :func:`check_transformation` traces it
when the strategy is built, so that a transformation that cannot run on a shard's
pieces fails then, naming the shard. The shard (:class:`jreplicate.ps.shard.PSShard`)
calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jreplicate.ps.fate.decision import Counters
from jreplicate.ps.remote import original_error
from jreplicate.sync.state import SyncReplicasState, take_token, tokens_available


def _is_sync(state: Any) -> bool:
    return any(isinstance(s, SyncReplicasState) for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, SyncReplicasState)))


def _sync_state(state: Any) -> SyncReplicasState:
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, SyncReplicasState)) if isinstance(s, SyncReplicasState))


def _counters(state: Any) -> Counters:
    """The host driver's counters (ints) of ``state``'s ``SyncReplicasState``."""
    s = _sync_state(state)
    return Counters(int(s.global_step), int(s.num_accumulated), int(s.dropped_stale),
                    int(s.dropped_backup))


def _accumulated(state: Any, saved: Any) -> int:
    """The accepted pushes of the current step already fed to a shard's accumulators:
    its ``SyncReplicasState``'s count, or an empty shard's saved count (``saved``, the
    whole optimizer state it keeps), else 0."""
    if _is_sync(state):
        return int(_sync_state(state).num_accumulated)
    if state is None and isinstance(saved, dict) and "accumulated" in saved:
        return int(np.asarray(saved["accumulated"]))
    return 0


def _deleted(state: Any) -> bool:
    """Whether a leaf of ``state`` was deleted (donated to an update that then raised)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


def _token_returned(state: Any, token: int) -> Any:
    """``state`` with ``token`` back in its token queue, if it is of the current step and
    at the queue's head (None: it is not, nothing to put back)."""
    s = _sync_state(state)
    q = s.tokens
    if not int(q.head_step) == token == int(s.global_step):
        return None
    new_q = q._replace(head_count=q.head_count + 1)
    return jax.tree.map(lambda x: s._replace(tokens=new_q) if isinstance(
        x, SyncReplicasState) else x, state, is_leaf=lambda x: isinstance(x, SyncReplicasState))


def check_transformation(index: int, tx: Any, pieces: dict[str, np.ndarray],
                         paths: list[str]) -> None:
    """Traces (abstractly) ``tx``'s ``init`` and ``update`` over shard ``index``'s
    ``pieces``, as the shard will run them, so that a transformation that cannot take
    them fails when the strategy is built, naming the shard (both carriers).

    Raises:
      ValueError: naming the shard, its leaves (``paths``), the original error and the
        fix.
    """
    if not pieces:
        return
    try:
        try:
            state = jax.eval_shape(tx.init, pieces)
        except Exception:  # noqa: BLE001 - an init that reads values: run it (as shards do)
            state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                 tx.init(jax.tree.map(jnp.asarray, pieces)))
        if _is_sync(state):
            jax.eval_shape(lambda p, s: _sync_update(tx, p, s, p, -1), pieces, state)
        else:
            jax.eval_shape(lambda p, s: _apply_update(tx, p, s, p), pieces, state)
    except Exception as e:  # the user's transformation may raise anything: named here
        kind, message = original_error(e)
        raise ValueError(
            f"ParameterServerStrategy: the optimizer cannot run on parameter-server shard "
            f"{index}, which holds the leaves {paths} as a flat dict of pieces keyed "
            f"{sorted(pieces)}: its init or update raised the error below. Each shard "
            "applies the transformation to its own pieces, not to your parameter tree: a "
            "transformation given a tree of the parameters' structure or names (a mask or "
            "labels for optax.masked or optax.multi_transform) cannot run there; give "
            f"it a function of the leaves (e.g. of their ndim or shape) instead.\n"
            f"{kind}: {message}") from e


def _apply_update(tx: Any, params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _sync_update(tx: Any, params: Any, opt_state: Any, grads: Any,
                 local_step: Any) -> tuple[Any, Any]:
    # Updates are zero until the step completes: params + 0 leaves them unchanged.
    updates, opt_state = tx.update(grads, opt_state, params, local_step=local_step)
    return optax.apply_updates(params, updates), opt_state


def _state_first(fn: Callable) -> Callable:
    """``fn`` returning ``(opt_state, params)`` for its ``(params, opt_state)``: see
    where the shard jits it."""
    def update(*args: Any) -> tuple[Any, Any]:
        params, opt_state = fn(*args)
        return opt_state, params

    return update


def _may_raise(fn: Callable, *args: Any) -> bool:
    """Whether ``fn(*args)`` jitted can raise once it runs: it calls back into Python
    (``jax.debug.callback``, ``pure_callback``, ``io_callback``), or JAX checks every
    result for NaNs or Infs."""
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
        return True
    return _calls_back(jax.make_jaxpr(fn)(*args).jaxpr)


def _calls_back(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns") and _calls_back(inner):
                    return True
    return False


def _own_buffers(state: Any, params: Any) -> Any:
    """``state`` with each leaf whose buffer is that of a leaf of ``params`` or of an
    earlier leaf of its own copied: the update donates the state, and XLA donates no
    buffer that the same call also takes (a transformation whose ``init`` keeps the
    params themselves, as the same or another array object)."""
    def buffer(x: Any) -> int:
        try:
            return x.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - not one buffer (or not an array): itself
            return id(x)

    seen = {buffer(x) for x in jax.tree.leaves(params)}

    def own(x: Any) -> Any:
        b = buffer(x)
        if b in seen:
            return jax.numpy.array(x, copy=True)
        seen.add(b)
        return x

    return jax.tree.map(own, state)


class ShardUpdate:
    """The jitted update of one shard's non-empty pieces and, token-gated, the token
    queue's functions, compiled at construction.

    Args:
      tx: the optax transformation.
      params: the shard's pieces (on its device).
      opt_state: its optimizer state (on its device).
      token_gated: a ``sync_replicas`` transformation (the update takes ``local_step``).

    Attributes:
      may_raise: whether the update can raise once it runs (a host callback in it, or
        JAX's NaN/Inf checks): then it does not donate the optimizer state, which an
        update that raises after it started would leave deleted.
    """

    def __init__(self, tx: Any, params: Any, opt_state: Any, token_gated: bool):
        self.token_gated = token_gated
        self.fn = partial(_sync_update if token_gated else _apply_update, tx)
        self.may_raise = _may_raise(self.fn, params, opt_state, *self.example(params))
        # The jitted update returns the optimizer state first: jax.jit gives each
        # donated buffer to the first output of its shape and dtype, so with the
        # parameters first the new parameters took mu's buffers, mu nu's, and XLA
        # copied every leaf twice to keep the old values readable (adam on a 4.4 MB
        # model: 12 copies, 1.8 against 1.15 ms of CPU per update).
        self.jitted = jax.jit(_state_first(self.fn),
                              donate_argnums=() if self.may_raise else (1,))
        if token_gated:
            self.take = jax.jit(take_token)
            self.available = jax.jit(tokens_available)
        # Compiled now, on throwaway copies, so that no push or token take compiles
        # while holding the shard's lock.
        self(params, jax.tree.map(jnp.copy, opt_state), *self.example(params))
        if token_gated:
            self.take(opt_state)
            self.available(opt_state)

    def __call__(self, params: Any, opt_state: Any, *args: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` after one jitted update (the state donated unless
        the update may raise)."""
        opt_state, params = self.jitted(params, opt_state, *args)
        return params, opt_state

    def example(self, params: Any) -> tuple:
        """The update's arguments after the state, as a push passes them: gradients as
        NumPy (the jitted update transfers them itself: several times cheaper than a
        device_put of the pytree), so that no push compiles again."""
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in params.items()}
        return (zeros, np.int32(-1)) if self.token_gated else (zeros,)

    def trial(self, params: Any, opt_state: Any, *args: Any) -> None:
        """Runs the update without keeping its result (traced only where it cannot
        raise once it runs: then the state, which it would donate, is untouched)."""
        if self.may_raise:
            self(params, opt_state, *args)
        else:
            jax.eval_shape(self.fn, params, opt_state, *args)
