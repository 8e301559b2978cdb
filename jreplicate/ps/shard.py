"""One parameter-server shard as a plain state machine, used by both carriers.

A shard holds its pieces of the parameters (see :mod:`jreplicate.ps.placement`), the
optax state of the transformation over them, its step and its ledger
(:mod:`jreplicate.ps.ledger`). Only numpy pytrees and ints cross its boundary:
:meth:`PSShard.pull` returns numpy copies, :meth:`PSShard.push` takes numpy gradients.
Each accepted push is applied by one jitted optax update (optimizer state donated;
parameters not, since pulls hand out snapshots) under the shard's lock, in the same
critical section as the ledger entry.

Two modes, chosen by the transformation:

* **asynchronous** (any optax transformation): every push is applied as it arrives;
  its staleness is ``step at apply - fetched_step``.
* **token-gated** (a :func:`jreplicate.sync_replicas` transformation): shard 0 runs the
  transform's host driver (each push is one replica's push with ``local_step``), owns
  ``global_step`` and the token queue (:meth:`PSShard.take_token` blocks with a
  deadline). A push is two-phase: the worker first *stages* its pieces on the other
  shards (:meth:`PSShard.stage`), then pushes to shard 0, whose :class:`Decision`
  (accepted as the ``index``-th gradient of ``step``, stale or backup) is then
  *committed* on the others (:meth:`PSShard.commit`): they feed exactly the pushes
  shard 0 accepted, in shard 0's order, into their own accumulators, so their
  parameters are those a single shard would hold. A worker that dies after shard 0's
  decision leaves its staged pieces behind; the coordinator commits them
  (:meth:`jreplicate.ps.client.ShardClient.settle`). A token of ``global_step`` is
  handed out only after every shard acknowledged that step (:meth:`PSShard.ack`;
  TensorFlow's "only after all variables have been updated"), so no worker pulls a mix
  of steps.

With ``max_staleness=tau`` (asynchronous mode) a push whose staleness would exceed tau
is dropped and counted as ``stale`` (the coordinator's admission keeps this from
happening; the shard is where the bound is guaranteed).

An update that raises (the user's transformation: a host callback's check, a gradient
it cannot trace) leaves the shard's state as it was, records the push as ``failed`` and
raises :class:`jreplicate.ps.ShardUpdateError`. The update donates the optimizer state
only where nothing can raise once it runs (:attr:`PSShard.may_raise`: no host callback
in it); :meth:`PSShard.check` tries a push without applying it, so that a client can
learn that a push fails before any shard applies it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jreplicate.ps.ledger import Ledger
from jreplicate.ps.remote import ShardUpdateError, original_error
from jreplicate.sync.state import SyncReplicasState, take_token, tokens_available


class ShardClosedError(RuntimeError):
    """The shard was closed (training ended, or the strategy shut down)."""


class TokenWaitInterrupted(RuntimeError):
    """A token wait was interrupted (the coordinator cancelled waiting steps)."""


class TokenTimeoutError(TimeoutError):
    """No token of the current step became available before the deadline."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What shard 0 decided for a push in token-gated mode.

    Attributes:
      kind: ``"applied"`` (accepted into step ``step``'s aggregate), ``"stale"``,
        ``"backup"`` or ``"failed"`` (an update raised: no shard applies it); or
        ``"skipped"`` (:data:`SKIPPED`, sent to every shard's :meth:`PSShard.record` by
        the coordinator): the step ended for good without pushing, its id is decided
        without counting (:meth:`jreplicate.ps.ledger.Ledger.skip`); or ``"forget"``
        (:data:`FORGET`, to :meth:`PSShard.record` with a push id ``n``): every step
        with an id below ``n`` ended, so what is kept for their reruns is let go
        (:meth:`jreplicate.ps.ledger.Ledger.forget`).
      step: the global step the gradient counts for (accepted), else the step then.
      index: the push's position among step ``step``'s accepted gradients.
      completes: the push completed step ``step`` (shard 0 applied the aggregate).
      attempt: the run of the step whose gradient shard 0 decided on (the other shards
        feed the pieces that run staged).
      duplicate: returned for a second push of a decided id (the fields are the
        original decision's).
    """

    kind: str
    step: int
    index: int = -1
    completes: bool = False
    attempt: int = 0
    duplicate: bool = False


#: The decision that marks a push id decided without a push (see :class:`Decision`).
SKIPPED = Decision("skipped", -1)
#: The decision that says every step below a push id ended (see :class:`Decision`).
FORGET = Decision("forget", -1)


def _is_sync(state: Any) -> bool:
    return any(isinstance(s, SyncReplicasState) for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, SyncReplicasState)))


def _sync_state(state: Any) -> SyncReplicasState:
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, SyncReplicasState)) if isinstance(s, SyncReplicasState))


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
    except Exception as e:
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


class PSShard:
    """One shard: parameters, optimizer state, step, ledger, and (shard 0 of a
    token-gated job) the token queue.

    Args:
      index: the shard's index (0 owns ``global_step`` in token-gated mode).
      params: ``{key: numpy array}``, this shard's pieces of the parameters.
      tx: the optax transformation applied to them.
      device: where the shard keeps its state (None: JAX's default device).
      opt_state: a restored optimizer state (default ``tx.init(params)``).
      step: the restored step (default 0).
      ledger: a restored :class:`Ledger`.
      num_shards: the shards of the job (token-gated shard 0 hands out a step's tokens
        once the ``num_shards - 1`` others acknowledged the step).
      max_staleness: asynchronous mode: pushes staler than this are dropped (None: no
        bound).
    """

    def __init__(self, index: int, params: dict[str, np.ndarray], tx: Any, *,
                 device: Any = None, opt_state: Any = None, step: int = 0,
                 ledger: Ledger | None = None, num_shards: int = 1,
                 max_staleness: int | None = None):
        self.index = index
        self._tx = tx
        self._device = device
        put = (lambda t: jax.device_put(t, device)) if device is not None else \
            (lambda t: jax.tree.map(jax.numpy.asarray, t))
        self._put = put
        self._params = put(params)
        # A shard without parameters (more shards than leaves) keeps only its ledger.
        self.empty = not params
        self._opt_state = None if self.empty else _own_buffers(
            put(opt_state) if opt_state is not None else put(tx.init(self._params)),
            self._params)
        self.token_gated = _is_sync(self._opt_state)
        self._tau = max_staleness
        self._step = int(step)
        self.ledger = ledger or Ledger()
        self._cond = threading.Condition(threading.Lock())
        self._closed: str | None = None
        self._interrupts = 0
        self._k: int | None = None  # replicas_to_aggregate, learnt at the first update
        self._live: int | None = None  # workers alive, as the coordinator last said
        # Token-gated, shard 0: the step each other shard acknowledged having reached.
        self._acked = [self._step] * max(int(num_shards), 1)
        # Token-gated, shards > 0: pieces staged per push id and run (attempt), and the
        # accepted pushes of a step waiting for their turn (shard 0's order).
        self._staged: dict[int, dict[int, Any]] = {}
        self._pending: dict[int, dict[int, Any]] = {}
        self._need: dict[int, int] = {}
        # Accepted pushes of the current step fed so far (an empty shard keeps the count
        # as its whole optimizer state).
        self._fed = int(_sync_state(self._opt_state).num_accumulated) if self.token_gated \
            else int(np.asarray(opt_state["accumulated"])) if self.empty and \
            isinstance(opt_state, dict) and "accumulated" in opt_state else 0
        self.apply_seconds = 0.0
        self._fn = self._sync_fn if self.token_gated else self._apply_fn
        #: Whether the update can raise once it runs (a host callback in it, or JAX's
        #: NaN/Inf checks): then it does not donate the optimizer state, which an update
        #: that raises after it started would leave deleted.
        self.may_raise = not self.empty and _may_raise(self._fn, self._params,
                                                       self._opt_state, *self._example())
        # The jitted update returns the optimizer state first: jax.jit gives each
        # donated buffer to the first output of its shape and dtype, so with the
        # parameters first the new parameters took mu's buffers, mu nu's, and XLA
        # copied every leaf twice to keep the old values readable (adam on a 4.4 MB
        # model: 12 copies, 1.8 against 1.15 ms of CPU per update).
        self._jitted = jax.jit(_state_first(self._fn),
                               donate_argnums=() if self.may_raise else (1,))
        if self.token_gated:
            self._take = jax.jit(take_token)
            self._available = jax.jit(tokens_available)
        self._compile()

    def _update(self, params: Any, opt_state: Any, *args: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` after one jitted update (the state donated unless
        the update may raise)."""
        opt_state, params = self._jitted(params, opt_state, *args)
        return params, opt_state

    def _apply_fn(self, params, opt_state, grads):
        return _apply_update(self._tx, params, opt_state, grads)

    def _sync_fn(self, params, opt_state, grads, local_step):
        return _sync_update(self._tx, params, opt_state, grads, local_step)

    def _compile(self) -> None:
        """Compiles the update (and the token queue's functions) now, on throwaway
        copies, so that no push or token take compiles while holding the shard's lock."""
        if self.empty:
            return
        copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731
        self._update(self._params, copy(self._opt_state), *self._example())
        if self.token_gated:
            self._take(self._opt_state)
            self._available(self._opt_state)

    def _example(self) -> tuple:
        """The update's arguments after the state, as a push passes them: gradients as
        NumPy (the jitted update transfers them itself: several times cheaper than a
        device_put of the pytree), so that no push compiles again."""
        zeros = {k: np.zeros(v.shape, v.dtype) for k, v in self._params.items()}
        return (zeros, np.int32(-1)) if self.token_gated else (zeros,)

    def _updated(self, push_id: int, *args: Any) -> tuple[Any, Any]:
        """The update of the state by one push (under the lock), not yet applied.

        Raises:
          ShardUpdateError: the update raised; the state is unchanged and the push is
            recorded ``failed``.
          ShardClosedError: it raised after taking the donated optimizer state, which
            is gone: the shard is lost.
        """
        try:
            return self._update(self._params, self._opt_state, *args)
        except Exception as e:
            if any(getattr(x, "is_deleted", lambda: False)()
                   for x in jax.tree.leaves(self._opt_state)):
                raise self._lose("lost: its update raised ({}: {}) after taking its "
                                 "optimizer state".format(*original_error(e))) from e
            self.ledger.record(push_id, "failed")
            self.ledger.decisions[push_id] = Decision("failed", self._step)
            raise ShardUpdateError.of(e, shard=self.index, step_id=push_id) from e

    def check(self, push_id: int, fetched_step: int, grads: dict[str, np.ndarray]) -> None:
        """Tries push ``push_id`` on the current state without applying it (traced only,
        where the update cannot raise once it runs), so that a client learns that a
        push fails before any shard applies it.

        Raises:
          ShardUpdateError: the update raised (nothing is recorded: the client records
            the push ``failed`` on every shard).
        """
        with self._cond:
            self._check_open()
            if self.empty:
                return
            params, opt = self._params, self._opt_state  # (not donated: may_raise)
        args = (grads, np.int32(fetched_step)) if self.token_gated else (grads,)
        try:
            if self.may_raise:
                self._update(params, opt, *args)
            else:
                jax.eval_shape(self._fn, params, opt, *args)
        except Exception as e:
            raise ShardUpdateError.of(e, shard=self.index, step_id=push_id) from e

    # -- reading ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Updates applied (asynchronous) or ``global_step`` (token-gated)."""
        with self._cond:
            return self._step

    def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        """``(step, numpy copy of this shard's parameters)``."""
        with self._cond:
            self._check_open()
            step, params = self._step, self._params
        return step, {k: np.asarray(v) for k, v in params.items()}

    def summary(self) -> dict[str, Any]:
        """The ledger's summary (:meth:`jreplicate.ps.ledger.Ledger.summary`)."""
        with self._cond:
            return self.ledger.summary()

    def state(self) -> dict[str, Any]:
        """The shard's state as numpy: params, opt_state, step, ledger arrays."""
        with self._cond:
            params, opt, step = self._params, self._opt_state, self._step
            ledger = self.ledger.to_arrays()
            params = jax.tree.map(np.asarray, params)
            opt = jax.tree.map(np.asarray, opt) if opt is not None else \
                {"accumulated": np.array(self._fed, np.int32)}
        return {"params": params, "opt_state": opt, "step": np.array(step, np.int32),
                "ledger": ledger}

    # -- pushing ---------------------------------------------------------------------
    def push(self, push_id: int, worker: int, fetched_step: int,
             grads: dict[str, np.ndarray], decision: Decision | None = None,
             attempt: int = 0) -> Decision:
        """Applies (or drops) one worker's gradients for this shard's pieces.

        Args:
          push_id: the scheduled step's id; a second push with one id is a duplicate.
          worker: the pushing worker (for errors and statistics).
          fetched_step: the step of the parameters the gradient was computed from
            (asynchronous), or the worker's ``local_step`` token (token-gated).
          grads: ``{key: numpy array}`` like the shard's parameters.
          decision: token-gated, shards > 0: shard 0's decision for this push (a
            :meth:`stage` and a :meth:`commit` in one call).
          attempt: the run of the step (token-gated shard 0 records it in its decision).

        Returns:
          The push's :class:`Decision` (a duplicate returns the original one, marked
          ``duplicate``).
        """
        if decision is not None:
            self.stage(push_id, decision.attempt, grads)
            self.commit(push_id, decision)
            return decision
        with self._cond:
            self._check_open()
            if self.ledger.seen(push_id):
                self.ledger.record(push_id, "duplicate")
                d = self.ledger.decisions.get(push_id, Decision("applied", self._step))
                return dataclasses.replace(d, duplicate=True)
            if self.empty:
                self.ledger.record(push_id, "applied", 0)
                self._step += 1
                return Decision("applied", self._step - 1)
            if not self.token_gated:
                return self._push_async(push_id, fetched_step, grads)
            if self.index != 0:
                raise ValueError(
                    f"PSShard {self.index}: a token-gated push goes to shard 0; the other "
                    "shards take stage() and commit() with shard 0's decision.")
            return self._push_driver(push_id, fetched_step, grads, attempt)

    def push_pull(self, push_id: int, worker: int, fetched_step: int,
                  grads: dict[str, np.ndarray]
                  ) -> tuple[Decision, int, dict[str, np.ndarray]]:
        """Asynchronous mode: :meth:`push`, then :meth:`pull` (one round trip for a
        remote worker): ``(decision, step, parameters)``, the step and parameters read
        together after the push (other pushes may come between: the step says which)."""
        if self.token_gated:
            raise ValueError(f"PSShard {self.index}: push_pull is for asynchronous mode; "
                             "a token-gated push is staged, decided and committed.")
        decision = self.push(push_id, worker, fetched_step, grads)
        return (decision, *self.pull())

    def _push_async(self, push_id, fetched_step, grads):
        staleness = self._step - int(fetched_step)
        if self._tau is not None and staleness > self._tau:
            self.ledger.record(push_id, "stale")
            return Decision("stale", self._step)
        t0 = time.perf_counter()
        self._params, self._opt_state = self._updated(push_id, grads)
        self.apply_seconds += time.perf_counter() - t0
        self._step += 1
        self.ledger.record(push_id, "applied", staleness)
        self._cond.notify_all()
        return Decision("applied", self._step - 1)

    def _push_driver(self, push_id, local_step, grads, attempt):
        s = _sync_state(self._opt_state)
        gs, acc = int(s.global_step), int(s.num_accumulated)
        stale, backup = int(s.dropped_stale), int(s.dropped_backup)
        self._params, self._opt_state = self._updated(push_id, grads, np.int32(local_step))
        new = _sync_state(self._opt_state)
        new_gs = int(new.global_step)
        if int(new.dropped_stale) > stale:
            d = Decision("stale", gs)
        elif int(new.dropped_backup) > backup:
            d = Decision("backup", gs)
        else:
            d = Decision("applied", gs, acc, completes=new_gs > gs, attempt=attempt)
        if d.completes:
            self._k = d.index + 1
        self._step = new_gs
        self.ledger.record(push_id, d.kind, 0 if d.kind == "applied" else None)
        self.ledger.decisions[push_id] = d
        if d.completes:
            self._cond.notify_all()  # new tokens (once the other shards acknowledge)
        return d

    def decision(self, push_id: int) -> Decision | None:
        """Shard 0's decision for ``push_id`` (None: not pushed here yet)."""
        with self._cond:
            return self.ledger.decisions.get(push_id)

    # -- token-gated, shards > 0 -------------------------------------------------------
    def stage(self, push_id: int, attempt: int, grads: dict[str, np.ndarray]) -> None:
        """Keeps run ``attempt``'s pieces of push ``push_id`` until shard 0's decision
        is committed (ignored for an id already decided)."""
        with self._cond:
            self._check_open()
            if not self.ledger.seen(push_id):
                self._staged.setdefault(push_id, {})[int(attempt)] = grads

    def commit(self, push_id: int, decision: Decision) -> int:
        """Applies shard 0's ``decision`` for ``push_id``: an accepted push's staged
        pieces (of the run shard 0 decided on) are fed to the accumulators in shard 0's
        order; a dropped one is only recorded. Returns this shard's step afterwards.

        Raises:
          RuntimeError: the decided run's pieces were never staged here.
        """
        with self._cond:
            self._check_open()
            if decision.kind == "forget":  # every step below push_id ended
                self.ledger.forget(push_id)
                if any(i < push_id for i in self._staged):
                    self._staged = {i: s for i, s in self._staged.items() if i >= push_id}
                return self._step
            staged = self._staged.pop(push_id, {})
            if decision.kind == "skipped":  # never pushed (a no-op if decided)
                self.ledger.skip(push_id)
                return self._step
            if self.ledger.seen(push_id):
                self.ledger.record(push_id, "duplicate")
                return self._step
            d = decision
            if d.kind != "applied":
                self.ledger.record(push_id, d.kind)
                return self._step
            if d.attempt not in staged and not self.empty:
                raise RuntimeError(
                    f"PSShard {self.index}: push {push_id} (run {d.attempt}) was accepted "
                    "by shard 0 but its pieces were never staged here; stage() every "
                    "shard before pushing to shard 0.")
            self.ledger.record(push_id, "applied", 0)
            self.ledger.decisions[push_id] = d
            self._pending.setdefault(d.step, {})[d.index] = staged.get(d.attempt)
            if d.completes:
                self._need[d.step] = d.index + 1
            self._feed()
            self._cond.notify_all()
            return self._step

    def record(self, push_id: int, decision: Decision) -> None:
        """Records shard 0's drop of a push (:meth:`commit` of a dropped decision),
        (:data:`SKIPPED`) that the push will never come, or (:data:`FORGET`) that every
        step below ``push_id`` ended."""
        self.commit(push_id, decision)

    def decided(self, push_id: int) -> bool:
        """Whether this shard's ledger decided ``push_id`` (applied, dropped, failed or
        skipped; a staged piece is not decided)."""
        with self._cond:
            self._check_open()
            return self.ledger.seen(push_id)

    def _feed(self) -> None:
        """Feeds accepted pushes to the accumulators in shard 0's order, index by index
        as they arrive, so this shard's state agrees with its ledger and with shard 0's
        at every quiescent point; the step advances when the transform completes it."""
        while self._feed_step():
            pass

    def _feed_step(self) -> bool:
        gs = self._step
        got = self._pending.get(gs, {})
        done = False
        while not done and self._fed in got:
            if self.empty:  # only the count: the step ends with shard 0's last push
                got.pop(self._fed)
                self._fed += 1
                done = self._need.get(gs) == self._fed
                continue
            try:
                new = self._update(self._params, self._opt_state, got[self._fed],
                                   np.int32(gs))
            except Exception as e:  # shard 0 applied it: the shards would disagree
                raise self._lose(
                    "lost: its update raised for a push shard 0 had accepted ({}: {}), so "
                    "its state can no longer agree with shard 0's".format(
                        *original_error(e))) from e
            got.pop(self._fed)
            self._fed += 1
            self._params, self._opt_state = new
            done = int(_sync_state(self._opt_state).global_step) > gs
        if not done:
            return False
        need = self._need.pop(gs, self._fed)
        if need != self._fed:
            raise RuntimeError(
                f"PSShard {self.index}: step {gs} took {need} gradients on shard 0 but "
                f"{self._fed} here; shards must be built with the same sync_replicas "
                "transformation.")
        self._pending.pop(gs, None)
        self._step, self._fed = gs + 1, 0
        return True

    # -- tokens (shard 0) ------------------------------------------------------------
    def ack(self, steps: list[int]) -> None:
        """The other shards' steps as a worker saw them after its commits: tokens of a
        step are handed out once every shard reached it."""
        with self._cond:
            for i, st in enumerate(steps, 1):
                if i < len(self._acked):
                    self._acked[i] = max(self._acked[i], int(st))
            self._cond.notify_all()

    def _released(self) -> bool:
        return min(self._acked[1:], default=self._step) >= self._step

    def take_token(self, deadline: float, *, skip_stale: bool = True, min_step: int = 0,
                   live_workers: int = 0,
                   on_wait: Callable[[bool], None] | None = None) -> int:
        """Dequeues a token (shard 0, token-gated): the ``local_step`` of the caller's
        next gradient. Blocks until one is available or ``time.monotonic()`` passes
        ``deadline``. A token of ``global_step`` is available only once every shard
        reached that step (see :meth:`ack`).

        Args:
          deadline: a ``time.monotonic()`` value.
          skip_stale: drop tokens older than ``global_step`` (a gradient computed with
            one would be dropped as stale) and take the next one; False keeps
            TensorFlow's FIFO exactly.
          min_step: with ``skip_stale``, wait until ``global_step >= min_step`` (the
            caller's last gradient was accepted for step ``min_step - 1``: one gradient
            per worker and step, so a fast worker does not take a slower worker's token
            of the same step and turn that worker's gradient into a backup). Applied only
            while ``live_workers`` is at least ``replicas_to_aggregate``.
          live_workers: the workers alive (see ``min_step``).
          on_wait: called with True when the caller starts blocking (no token it may
            take) and with False when it stops; never under the shard's lock.

        Raises:
          TokenTimeoutError: the deadline passed.
          ShardClosedError: the shard was closed while waiting (the end of training).
          TokenWaitInterrupted: :meth:`interrupt` was called.
        """
        with self._cond:
            generation = self._interrupts
        waiting = False
        try:
            while True:
                with self._cond:
                    token = self._try_take(generation, skip_stale, min_step, live_workers)
                    if token is not None:
                        return token
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TokenTimeoutError(
                            f"no token for global step {self._step} before the deadline: "
                            "fewer than replicas_to_aggregate fresh gradients of that step "
                            "arrived (workers lost or out of work). Schedule more steps, "
                            "lower replicas_to_aggregate, or raise token_timeout.")
                    if waiting or on_wait is None:
                        self._cond.wait(left)
                        continue
                on_wait(True)  # outside the lock; the next round re-checks, then waits
                waiting = True
        finally:
            if waiting:
                on_wait(False)

    def _try_take(self, generation, skip_stale, min_step, live_workers) -> int | None:
        self._check_open()
        if self._interrupts != generation:
            raise TokenWaitInterrupted("the token wait was cancelled")
        if not self._released():
            return None
        live = live_workers if self._live is None else min(live_workers, self._live)
        if skip_stale and self._k is not None and live >= self._k and \
                self._step < min_step:
            return None
        while int(self._available(self._opt_state)) > 0:
            token, self._opt_state = self._take(self._opt_state)
            token = int(token)
            if not skip_stale or token >= self._step:
                return token
        return None

    def takeable(self) -> bool:
        """Whether a token waiter could take a token now (every shard reached
        ``global_step`` and the queue holds one)."""
        with self._cond:
            return self.token_gated and self._released() and \
                int(self._available(self._opt_state)) > 0

    def return_token(self, token: int) -> None:
        """Puts back a token a lost worker took but never used (if still current)."""
        with self._cond:
            if not self.token_gated or self._closed:
                return
            s = _sync_state(self._opt_state)
            q = s.tokens
            if int(q.head_step) == token == int(s.global_step):
                new_q = q._replace(head_count=q.head_count + 1)
                self._opt_state = jax.tree.map(
                    lambda x: s._replace(tokens=new_q) if isinstance(x, SyncReplicasState)
                    else x, self._opt_state, is_leaf=lambda x: isinstance(x, SyncReplicasState))
                self._cond.notify_all()

    def set_live_workers(self, n: int) -> None:
        """The coordinator's count of live workers (a worker died): token waits that
        held one gradient per worker and step re-check whether enough workers remain."""
        with self._cond:
            self._live = int(n)
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Makes every current token wait raise :class:`TokenWaitInterrupted`."""
        with self._cond:
            self._interrupts += 1
            self._cond.notify_all()

    def tokens_available(self) -> int:
        with self._cond:
            return int(self._available(self._opt_state)) if self.token_gated else 0

    # -- lifecycle -------------------------------------------------------------------
    def close(self, reason: str = "closed") -> None:
        """Stops the shard: every waiting and later call raises ShardClosedError."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    def _lose(self, reason: str) -> ShardClosedError:
        """Closes the shard as lost (under the lock); returns the error to raise."""
        self._closed = reason
        self._cond.notify_all()
        return ShardClosedError(f"parameter-server shard {self.index} is {reason}.")

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def _check_open(self):
        if self._closed is not None:
            raise ShardClosedError(f"parameter-server shard {self.index} is {self._closed}.")
