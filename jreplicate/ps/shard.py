"""One parameter-server shard as a plain state machine, used by both carriers.

A shard holds its pieces of the parameters (see :mod:`jreplicate.ps.placement`), the
optax state of the transformation over them, its step and its ledger
(:mod:`jreplicate.ps.fate.ledger`). Only numpy pytrees and ints cross its boundary:
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
  shards (:meth:`PSShard.stage`), then pushes to shard 0, whose
  :class:`jreplicate.ps.fate.decision.Decision`
  (accepted as the ``index``-th gradient of ``step``, stale or backup) is then
  *committed* on the others (:meth:`PSShard.commit`): they feed exactly the pushes
  shard 0 accepted, in shard 0's order, into their own accumulators, so their
  parameters are those a single shard would hold. A worker that dies after shard 0's
  decision leaves its staged pieces behind; the coordinator commits them
  (:meth:`jreplicate.ps.client.ShardClient.settle`). A token of ``global_step`` is
  handed out only after every shard acknowledged that step (:meth:`PSShard.ack`;
  TensorFlow's "only after all variables have been updated"), so no worker pulls a mix
  of steps. What became of each push (the ledger, shard 0's decisions, the staged and
  accepted pieces waiting for their turn) is kept in a pure
  :class:`jreplicate.ps.fate.decision.ShardBook`; the shard is its threaded shell
  (the lock, the jitted updates, the tokens).

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

import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate.ps.fate.decision import Decision, ShardBook, TokenRelease, driver_decision
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.remote import ShardUpdateError, original_error
from jreplicate.ps.shard_update import (
    ShardUpdate,
    _accumulated,
    _counters,
    _deleted,
    _is_sync,
    _own_buffers,
    _sync_state,
    _token_returned,
)


class ShardClosedError(RuntimeError):
    """The shard was closed (training ended, or the strategy shut down)."""


class TokenWaitInterrupted(RuntimeError):
    """A token wait was interrupted (the coordinator cancelled waiting steps)."""


class TokenTimeoutError(TimeoutError):
    """No token of the current step became available before the deadline."""


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
        put = (lambda t: jax.device_put(t, device)) if device is not None else \
            (lambda t: jax.tree.map(jax.numpy.asarray, t))
        self._params = put(params)
        # A shard without parameters (more shards than leaves) keeps only its ledger.
        self.empty = not params
        self._opt_state = None if self.empty else _own_buffers(
            put(opt_state) if opt_state is not None else put(tx.init(self._params)),
            self._params)
        self.token_gated = _is_sync(self._opt_state)
        self._tau = max_staleness
        self._step = int(step)
        self._cond = threading.Condition(threading.Lock())
        self._closed: str | None = None
        self._interrupts = 0
        # Token-gated, shard 0: when a step's tokens may be handed out.
        self.release = TokenRelease(self._step, num_shards)
        # The fate of the pushes (ledger, decisions, staged and accepted pieces).
        self.book = ShardBook(index, ledger, fed=_accumulated(self._opt_state, opt_state))
        self.apply_seconds = 0.0
        #: The jitted update (None: no pieces), compiled now (see :class:`ShardUpdate`).
        self.update = None if self.empty else ShardUpdate(
            tx, self._params, self._opt_state, self.token_gated)
        #: Whether the update can raise once it runs (:attr:`ShardUpdate.may_raise`).
        self.may_raise = self.update is not None and self.update.may_raise

    def _updated(self, push_id: int, *args: Any) -> tuple[Any, Any]:
        """The update of the state by one push (under the lock), not yet applied.

        Raises:
          ShardUpdateError: the update raised; the state is unchanged and the push is
            recorded ``failed``.
          ShardClosedError: it raised after taking the donated optimizer state, which
            is gone: the shard is lost.
        """
        try:
            return self.update(self._params, self._opt_state, *args)
        except Exception as e:  # the user's update may raise anything: the push's error
            if _deleted(self._opt_state):
                raise self._lose("lost: its update raised ({}: {}) after taking its "
                                 "optimizer state".format(*original_error(e))) from e
            self.book.failed(push_id, self._step)
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
            self.update.trial(params, opt, *args)
        except Exception as e:  # the user's update may raise anything: the push's error
            raise ShardUpdateError.of(e, shard=self.index, step_id=push_id) from e

    # -- reading ---------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """The shard's :class:`Ledger` (guarded by its lock)."""
        return self.book.ledger

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
        """The ledger's summary (:meth:`jreplicate.ps.fate.ledger.Ledger.summary`)."""
        with self._cond:
            return self.ledger.summary()

    def state(self) -> dict[str, Any]:
        """The shard's state as numpy: params, opt_state, step, ledger arrays."""
        with self._cond:
            params, opt, step = self._params, self._opt_state, self._step
            ledger = self.ledger.to_arrays()
            params = jax.tree.map(np.asarray, params)
            opt = jax.tree.map(np.asarray, opt) if opt is not None else \
                {"accumulated": np.array(self.book.fed, np.int32)}
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
            d = self.book.duplicate(push_id, self._step)
            if d is not None:
                return d
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
        if (d := self.book.too_stale(push_id, self._step, staleness, self._tau)) is not None:
            return d
        t0 = time.perf_counter()
        self._params, self._opt_state = self._updated(push_id, grads)
        self.apply_seconds += time.perf_counter() - t0
        self._step += 1
        self.ledger.record(push_id, "applied", staleness)
        self._cond.notify_all()
        return Decision("applied", self._step - 1)

    def _push_driver(self, push_id, local_step, grads, attempt):
        before = _counters(self._opt_state)
        self._params, self._opt_state = self._updated(push_id, grads, np.int32(local_step))
        after = _counters(self._opt_state)
        d = driver_decision(before, after, attempt)
        self.release.decided(d)
        self._step = after.global_step
        self.book.decided_by_driver(push_id, d)
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
            self.book.stage(push_id, attempt, grads)

    def commit(self, push_id: int, decision: Decision) -> int:
        """Applies shard 0's ``decision`` for ``push_id``
        (:meth:`jreplicate.ps.fate.decision.ShardBook.commit`): an accepted push's staged
        pieces (of the run shard 0 decided on) are fed to the accumulators in shard 0's
        order; a dropped one is only recorded. Returns this shard's step afterwards.

        Raises:
          RuntimeError: the decided run's pieces were never staged here.
        """
        with self._cond:
            self._check_open()
            if self.book.commit(push_id, decision, self.empty):
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
        gs, book = self._step, self.book
        done = False
        while not done:
            ready, pieces = book.next_piece(gs)
            if not ready:
                return False
            if self.empty:  # only the count: the step ends with shard 0's last push
                book.fed_one(gs)
                done = book.completes(gs)
                continue
            try:
                new = self.update(self._params, self._opt_state, pieces, np.int32(gs))
            except Exception as e:  # shard 0 applied it: the shards would disagree
                raise self._lose(
                    "lost: its update raised for a push shard 0 had accepted ({}: {}), so "
                    "its state can no longer agree with shard 0's".format(
                        *original_error(e))) from e
            book.fed_one(gs)
            self._params, self._opt_state = new
            done = int(_sync_state(self._opt_state).global_step) > gs
        book.step_done(gs)
        self._step = gs + 1
        return True

    # -- tokens (shard 0) ------------------------------------------------------------
    def ack(self, steps: list[int]) -> None:
        """The other shards' steps as a worker saw them after its commits: tokens of a
        step are handed out once every shard reached it."""
        with self._cond:
            self.release.ack(steps)
            self._cond.notify_all()

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
          min_step: with ``skip_stale``, wait until ``global_step >= min_step``, so that
            a fast worker does not take a slower one's token of the same step and turn
            its gradient into a backup (:meth:`TokenRelease.holds_back`).
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
        if not self.release.released(self._step) or self.release.holds_back(
                self._step, min_step, live_workers, skip_stale):
            return None
        while int(self.update.available(self._opt_state)) > 0:
            token, self._opt_state = self.update.take(self._opt_state)
            token = int(token)
            if not skip_stale or token >= self._step:
                return token
        return None

    def takeable(self) -> bool:
        """Whether a token waiter could take a token now (every shard reached
        ``global_step`` and the queue holds one)."""
        with self._cond:
            return self.token_gated and self.release.released(self._step) and \
                int(self.update.available(self._opt_state)) > 0

    def return_token(self, token: int) -> None:
        """Puts back a token a lost worker took but never used (if still current)."""
        with self._cond:
            if not self.token_gated or self._closed:
                return
            new = _token_returned(self._opt_state, token)
            if new is not None:
                self._opt_state = new
                self._cond.notify_all()

    def set_live_workers(self, n: int) -> None:
        """The coordinator's count of live workers (a worker died): token waits that
        held one gradient per worker and step re-check whether enough workers remain."""
        with self._cond:
            self.release.live = int(n)
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Makes every current token wait raise :class:`TokenWaitInterrupted`."""
        with self._cond:
            self._interrupts += 1
            self._cond.notify_all()

    def tokens_available(self) -> int:
        with self._cond:
            return int(self.update.available(self._opt_state)) if self.token_gated else 0

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
