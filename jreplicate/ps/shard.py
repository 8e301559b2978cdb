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
  deadline). Its :class:`Decision` for each push (accepted as the ``index``-th gradient
  of ``step``, stale or backup) travels with the push to the other shards, which apply
  exactly the pushes shard 0 accepted, in shard 0's order: their parameters are those a
  single shard would hold.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np
import optax

from jreplicate.ps.ledger import Ledger
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
      kind: ``"applied"`` (accepted into step ``step``'s aggregate), ``"stale"`` or
        ``"backup"``.
      step: the global step the gradient counts for (accepted), else the step then.
      index: the push's position among step ``step``'s accepted gradients.
      completes: the push completed step ``step`` (shard 0 applied the aggregate).
    """

    kind: str
    step: int
    index: int = -1
    completes: bool = False


def _is_sync(state: Any) -> bool:
    return any(isinstance(s, SyncReplicasState) for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, SyncReplicasState)))


def _sync_state(state: Any) -> SyncReplicasState:
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, SyncReplicasState)) if isinstance(s, SyncReplicasState))


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
    """

    def __init__(self, index: int, params: dict[str, np.ndarray], tx: Any, *,
                 device: Any = None, opt_state: Any = None, step: int = 0,
                 ledger: Ledger | None = None):
        self.index = index
        self._tx = tx
        self._device = device
        put = (lambda t: jax.device_put(t, device)) if device is not None else \
            (lambda t: jax.tree.map(jax.numpy.asarray, t))
        self._put = put
        self._params = put(params)
        # A shard without parameters (more shards than leaves) keeps only its ledger.
        self.empty = not params
        self._opt_state = None if self.empty else put(opt_state) if opt_state is not None \
            else put(tx.init(self._params))
        self.token_gated = _is_sync(self._opt_state)
        self._step = int(step)
        self.ledger = ledger or Ledger()
        self._cond = threading.Condition(threading.Lock())
        self._closed: str | None = None
        self._interrupts = 0
        self._k: int | None = None  # replicas_to_aggregate, learnt at the first update
        self._live: int | None = None  # workers alive, as the coordinator last said
        # Token-gated, shards > 0: accepted pushes waiting for their step's turn.
        self._pending: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        self._complete_count: dict[int, int] = {}
        self._apply = jax.jit(self._apply_fn, donate_argnums=(1,))
        self.apply_seconds = 0.0

    def _apply_fn(self, params, opt_state, grads):
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

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

    def state(self) -> dict[str, Any]:
        """The shard's state as numpy: params, opt_state, step, ledger arrays."""
        with self._cond:
            params, opt, step = self._params, self._opt_state, self._step
            ledger = self.ledger.to_arrays()
        return {"params": jax.tree.map(np.asarray, params),
                "opt_state": jax.tree.map(np.asarray, opt) if opt is not None else {},
                "step": np.array(step, np.int32), "ledger": ledger}

    # -- pushing ---------------------------------------------------------------------
    def push(self, push_id: int, worker: int, fetched_step: int,
             grads: dict[str, np.ndarray], decision: Decision | None = None) -> Decision:
        """Applies (or drops) one worker's gradients for this shard's pieces.

        Args:
          push_id: the scheduled step's id; a second push with one id is a duplicate.
          worker: the pushing worker (for errors and statistics).
          fetched_step: the step of the parameters the gradient was computed from
            (asynchronous), or the worker's ``local_step`` token (token-gated).
          grads: ``{key: numpy array}`` like the shard's parameters; ``None`` when
            shard 0 dropped the push (only its ledger entry travels).
          decision: token-gated, shards > 0: shard 0's decision for this push.

        Returns:
          The push's :class:`Decision` (a duplicate returns the original one).
        """
        with self._cond:
            self._check_open()
            if self.ledger.seen(push_id):
                self.ledger.record(push_id, "duplicate")
                return self.ledger.decisions.get(push_id, Decision("duplicate", self._step))
            if self.empty:
                self.ledger.record(push_id, "applied", None if decision else 0)
                if decision is None or decision.completes:
                    self._step += 1
                return decision or Decision("applied", self._step - 1)
            if not self.token_gated:
                return self._push_async(push_id, fetched_step, grads)
            if self.index == 0:
                return self._push_driver(push_id, fetched_step, grads)
            return self._push_follower(push_id, grads, decision)

    def record(self, push_id: int, decision: Decision) -> None:
        """Records shard 0's drop of a push (its gradient is never sent here)."""
        with self._cond:
            self._check_open()
            kind = "duplicate" if self.ledger.seen(push_id) else decision.kind
            self.ledger.record(push_id, kind)

    def _push_async(self, push_id, fetched_step, grads):
        staleness = self._step - int(fetched_step)
        t0 = time.perf_counter()
        self._params, self._opt_state = self._apply(self._params, self._opt_state,
                                                    self._put(grads))
        self.apply_seconds += time.perf_counter() - t0
        self._step += 1
        self.ledger.record(push_id, "applied", staleness)
        self._cond.notify_all()
        return Decision("applied", self._step - 1)

    def _push_driver(self, push_id, local_step, grads):
        s = _sync_state(self._opt_state)
        before = (int(s.global_step), int(s.num_accumulated), int(s.dropped_stale),
                  int(s.dropped_backup))
        updates, opt = self._tx.update(self._put(grads), self._opt_state, self._params,
                                       local_step=int(local_step))
        new = _sync_state(opt)
        gs = int(new.global_step)
        if int(new.dropped_stale) > before[2]:
            d = Decision("stale", before[0])
        elif int(new.dropped_backup) > before[3]:
            d = Decision("backup", before[0])
        else:
            d = Decision("applied", before[0], before[1], completes=gs > before[0])
        if d.completes:
            self._k = d.index + 1
            self._params = optax.apply_updates(self._params, updates)
        self._opt_state = opt
        self._step = gs
        self.ledger.record(push_id, d.kind, 0 if d.kind == "applied" else None)
        self.ledger.decisions[push_id] = d
        if d.completes:
            self._cond.notify_all()  # new tokens
        return d

    def _push_follower(self, push_id, grads, d):
        if d is None or d.kind != "applied":
            raise ValueError(
                f"PSShard {self.index}: a token-gated push needs shard 0's decision "
                "(Decision('applied', step, index)); dropped pushes go through record().")
        self.ledger.record(push_id, "applied", 0)
        self._pending.setdefault(d.step, {})[d.index] = grads
        if d.completes:
            self._complete_count[d.step] = d.index + 1
        self._drain()
        return d

    def _drain(self):
        """Feeds the pending steps, in order, once all their accepted pushes arrived."""
        while True:
            gs = self._step
            need = self._complete_count.get(gs)
            got = self._pending.get(gs, {})
            if need is None or len(got) < need:
                return
            for i in range(need):
                updates, self._opt_state = self._tx.update(
                    self._put(got[i]), self._opt_state, self._params, local_step=gs)
            new_gs = int(_sync_state(self._opt_state).global_step)
            if new_gs != gs + 1:
                raise RuntimeError(
                    f"PSShard {self.index}: step {gs} took {need} gradients on shard 0 but "
                    "did not complete here; shards must be built with the same "
                    "sync_replicas transformation.")
            self._params = optax.apply_updates(self._params, updates)
            self._step = new_gs
            del self._pending[gs], self._complete_count[gs]

    # -- tokens ----------------------------------------------------------------------
    def take_token(self, deadline: float, *, skip_stale: bool = True, min_step: int = 0,
                   live_workers: int = 0) -> int:
        """Dequeues a token (shard 0, token-gated): the ``local_step`` of the caller's
        next gradient. Blocks until one is available or ``time.monotonic()`` passes
        ``deadline``.

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

        Raises:
          TokenTimeoutError: the deadline passed.
          ShardClosedError: the shard was closed while waiting (the end of training).
          TokenWaitInterrupted: :meth:`interrupt` was called.
        """
        with self._cond:
            generation = self._interrupts
            while True:
                self._check_open()
                if self._interrupts != generation:
                    raise TokenWaitInterrupted("the token wait was cancelled")
                live = live_workers if self._live is None else min(live_workers, self._live)
                wait_step = skip_stale and self._k is not None and live >= self._k \
                    and self._step < min_step
                while not wait_step and int(tokens_available(self._opt_state)) > 0:
                    token, self._opt_state = take_token(self._opt_state)
                    token = int(token)
                    if not skip_stale or token >= self._step:
                        return token
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TokenTimeoutError(
                        f"no token for global step {self._step} before the deadline: fewer "
                        "than replicas_to_aggregate fresh gradients of that step arrived "
                        "(workers lost or out of work). Schedule more steps, lower "
                        "replicas_to_aggregate, or raise token_timeout.")
                self._cond.wait(min(left, 1.0))

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
            return int(tokens_available(self._opt_state)) if self.token_gated else 0

    # -- lifecycle -------------------------------------------------------------------
    def close(self, reason: str = "closed") -> None:
        """Stops the shard: every waiting and later call raises ShardClosedError."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def _check_open(self):
        if self._closed is not None:
            raise ShardClosedError(f"parameter-server shard {self.index} is {self._closed}.")
