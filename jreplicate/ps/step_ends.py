"""How a scheduled step ends, by the outcome of its run (for the Coordinator).

:class:`StepEnds` holds what the :class:`~jreplicate.ps.coordinator.Coordinator` knows
of its steps' ends: each step's :class:`RemoteValue`, which workers are alive, the
first error, and whether a step's error stopped training. Its methods run on the
coordinator's worker threads (and ``join``) under the queue's lock unless they say
otherwise; :meth:`StepEnds.by_outcome` dispatches on the outcome's type
(:mod:`jreplicate.ps.outcome`):

* :class:`Completed`: the RemoteValue gets the outputs;
* :class:`Failed` (the step raised, or a shard's optimizer update raised for its push:
  :class:`~jreplicate.ps.ShardUpdateError`, which no shard applied): the RemoteValue
  gets the error (not retried, as in TF; the worker stays alive) and, as TF's
  ``mark_failed``, training stops: the queued steps end with
  :class:`StepCancelledError` (not run), the running ones are flagged
  (``Closure.cancel``: the worker refuses the push of one that has not pushed yet), and
  the next schedule or join raises the first error, once, after the running steps
  ended (TF's ``_raise_if_error``);
* :class:`WorkerLost`: the worker is marked dead and the closure goes back to the front
  of the queue with its id, so its push is applied at most once (the shards' ledgers
  drop a second push of the id as a duplicate); after ``max_attempts`` the step fails.
  A carrier that replaces workers is asked to (:meth:`StepEnds.revive`);
* :class:`ShardLost` (while not shutting down): :class:`ParameterServerError` for this
  and every pending step;
* :class:`EndOfInput`: the step goes back to the queue, uncounted, for a worker that
  still has input of its sweep (:class:`~jreplicate.ps.input_sweeps.InputSweeps`).

A step that ends for good without pushing is *skipped* on every shard
(``carrier.skip``) and recorded in the :class:`StepRecord`; one that ends with its push
on some shards only fails with :class:`ParameterServerError` (:meth:`StepRecord.ended`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jreplicate.ps.admission import AdmissionGate, StarvationDetector, StatsRecorder
from jreplicate.ps.closure import Closure
from jreplicate.ps.closure_queue import ClosureQueue
from jreplicate.ps.fate.reconcile import shard_lost_error
from jreplicate.ps.fate.record import StepRecord
from jreplicate.ps.handle import StepCarrier
from jreplicate.ps.input_sweeps import InputSweeps, input_sweep
from jreplicate.ps.outcome import (
    Cancelled,
    Completed,
    EndOfInput,
    Failed,
    Outcome,
    ShardLost,
    WorkerLost,
)
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    StepCancelledError,
    StepOutputsLostError,
    WorkerLostError,
)
from jreplicate.ps.shard import ShardClosedError

_log = logging.getLogger("jreplicate")


class StepEnds:
    """Ends the steps of a coordinator by their outcomes.

    Args:
      queue: the coordinator's queue (its lock guards this object too).
      carrier: the shard calls a step's end needs (see :class:`StepCarrier`).
      record: the record of ended steps.
      sweeps: the per-worker inputs' sweeps ended on which workers.
      stats, gate, starvation: the coordinator's counters, admission gate and
        token-starvation detector.
      max_attempts: runs of one closure before its step fails.
      relax: called (without the lock) after a step finished: token-gated waiters may
        take a second token when nothing else can run.
    """

    def __init__(self, queue: ClosureQueue, carrier: StepCarrier, record: StepRecord,
                 sweeps: InputSweeps, stats: StatsRecorder, gate: AdmissionGate,
                 starvation: StarvationDetector, *, max_attempts: int,
                 relax: Callable[[], None]):
        self.queue, self._carrier, self.record, self.sweeps = queue, carrier, record, sweeps
        self._stats, self._gate, self._starvation = stats, gate, starvation
        self._max_attempts = max_attempts
        self._relax = relax
        self.values: dict[int, RemoteValue] = {}
        self.alive = [True] * carrier.num_workers
        self.replacing: set[int] = set()  # lost workers the carrier is replacing
        self.first_error: BaseException | None = None
        #: A step raised its own error (TF's ``mark_failed``): the steps behind it were
        #: cancelled, and the next schedule or join raises ``first_error``, once.
        self.stopped_by_error = False

    def by_outcome(self, w: int, c: Closure, outcome: Outcome, lost: bool) -> bool:
        """(Without the lock.) Ends ``c``'s run on ``w`` by its outcome; True: ``w``
        was lost (``lost``: it was lost before, so ``c`` never ran there)."""
        match outcome:
            case Completed(value):
                self.values[c.step_id].worker = w
                self.finish(w, c, value=value)
            case EndOfInput():  # the step's own sweep (see WorkerPipelines.read)
                self.end_of_input(w, c)
            case Failed(error):
                self.finish(w, c, error=error, stops=True)
            case Cancelled(error):
                self.finish(w, c, error=self.queue.error or error)
            # A shard lost (or closed) in the step: its push may be on some shards only,
            # and the shards cannot all tell; its id is left undecided (resolved=False).
            case ShardLost(error, closed=True) if self.queue.stopped:
                self.finish(w, c, error=_shut_down_while_running(c, error), resolved=False)
            case ShardLost(error):
                self.finish(w, c, error=self.shard_lost(error), resolved=False)
            case WorkerLost(error) if lost:
                self.not_run(c, error)
            case WorkerLost(error):  # a worker failure: retry elsewhere
                self.worker_lost(w, c, error)
                return True
            case _:  # a carrier's bug: the step fails (raised, no step would end)
                self.finish(w, c, error=TypeError(
                    f"step {c.step_id}: the carrier's wait returned {outcome!r}, not an "
                    "outcome of jreplicate.ps.outcome"), stops=True)
        return False

    def finish(self, w: int, c: Closure, value: Any = None,
                error: BaseException | None = None, resolved: bool = True,
                stops: bool = False) -> None:
        """Records ``c``'s outcome on ``w``. ``stops``: ``error`` is the step's own (it
        raised): the steps behind it are cancelled (:meth:`_cancel_behind`)."""
        interrupt = False
        with self.queue.lock:
            if error is not None:
                raw, error = error, self.ended(c, error, resolved, own=stops)
                if stops and error is raw and self.queue.error is None:
                    interrupt = self.cancel_behind(c, error)
            self.queue.finish(w, c)  # its clock ticks before the takers are woken
            rv = self.values.pop(c.step_id)
            if error is None:
                self.record.completed(c.step_id)  # pushed by this run to every shard
                self._stats.completed(w)
                self.forget_ended()
            elif self.first_error is None and self.queue.error is None:
                self.first_error = error
            rv._set(value, error)
        if interrupt:
            self._carrier.interrupt()  # token waits of the cancelled steps end
        self._relax()

    def cancel_behind(self, c: Closure, error: BaseException) -> bool:
        """(Under the lock.) Step ``c`` raised ``error``: as TensorFlow's coordinator,
        the queued steps end with StepCancelledError, not run (skipped on every shard);
        the running ones are flagged, so that their workers refuse their pushes (each
        ends with StepCancelledError once its worker sees the flag, or completes if it
        was pushing already); the next schedule or join raises the first error. Returns
        whether any step is running (its token wait, if any, is to be interrupted)."""
        self.stopped_by_error = True
        if self.first_error is None:
            self.first_error = error
        why = f"step {c.step_id} raised first ({type(error).__name__}: {error})"
        for q in self.queue.drain():
            self.values.pop(q.step_id)._set(error=self.ended(q, StepCancelledError(
                f"step {q.step_id} was cancelled before it ran: {why}")))
        running = self.queue.in_flight()
        for r in running:
            r.cancel.set(f"step {r.step_id} was cancelled while it ran, before it "
                         f"pushed: {why}; its push was not applied")
        return bool(running)

    def raise_stopping_error(self) -> None:
        """(Under the lock.) Raises the first error of a stopped training, once (TF's
        ``_raise_if_error``), after the steps that were running when it stopped ended
        (their pushes refused, or applied if they were pushing already), so that the
        shards' parameters and ledgers no longer change for them."""
        q = self.queue
        q.lock.release()
        try:
            self._carrier.interrupt()  # (a token wait that began after the first interrupt)
        finally:
            q.lock.acquire()
        q.wait_inflight(None)
        err, self.first_error, self.stopped_by_error = self.first_error, None, False
        if err is not None:
            raise err

    def ended(self, c: Closure, error: BaseException, resolved: bool = True,
              own: bool = False) -> BaseException:
        """(Under the lock.) Step ``c`` ends for good without success; returns the error
        its RemoteValue gets (see :meth:`StepRecord.ended`): its id skipped on every
        shard, or, with its push on some shards only, a ParameterServerError with which
        training stops (queued steps fail with it). A step that an earlier, lost run
        pushed to every shard was applied: unless this run raised its own error
        (``own``), its RemoteValue says so (:class:`StepOutputsLostError`), whatever
        ended it (cancelled behind another step's error, shut down, given up)."""
        applied = self.record.pushed_everywhere(c.step_id)
        got = self.record.ended(c.step_id, error, resolved)
        if isinstance(got, ParameterServerError):
            self.first_error = self.first_error or got
            self.fail(self.queue.mark_failed(got), got)
            return got
        if got:
            try:
                self._carrier.skip(c.step_id)
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                _log.debug("coordinator: a lost shard: its loss is raised elsewhere", exc_info=True)
        self.forget_ended()
        if applied and not own:
            return _outputs_lost(c, error)
        return error

    def forget_ended(self) -> None:
        """(Under the lock.) Now and then, tells the shards below which id every step
        ended (:meth:`StepRecord.forget_due`)."""
        below = self.record.forget_due()
        if below is not None:
            try:
                self._carrier.forget(below)
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                _log.debug("coordinator: a lost shard: its loss is raised elsewhere", exc_info=True)

    def end_of_input(self, w: int, c: Closure) -> None:
        """``w``'s pipeline of ``c``'s input sweep is exhausted (or restarted for a later
        sweep): ``c`` goes back to the front of the queue (this run uncounted) for a
        worker that still has input of that sweep; if none has, it is not run
        (StopIteration)."""
        sweep = input_sweep(c)
        with self.queue.lock:
            self._starvation.moved()
            self.values[c.step_id].attempts -= 1
            self.sweeps.ended(sweep, w)
            if c.cancel.is_set():
                self.end_cancelled(c)
                return
            if self.queue.stopped:
                self.give_up(c, StepCancelledError(
                    "the strategy shut down before this step ran"))
                return
            if self.sweeps.exhausted(sweep):  # ended everywhere while c ran
                self.queue.mark_finished(c)
                self.end_not_run(c)
                return
            self.queue.put_back(c)
            self.end_exhausted_inputs()

    def end_exhausted_inputs(self) -> None:
        """Inputs ended on every live worker: their queued steps end with
        StopIteration (not run; no error for join)."""
        for sweep in self.sweeps.newly_exhausted(self.alive):
            for c in self.queue.remove_where(
                    lambda c, sweep=sweep: input_sweep(c) == sweep):
                self.end_not_run(c)

    def end_not_run(self, c: Closure) -> None:
        """(Under the lock.) Step ``c``, out of the queue, is not run: its input sweep
        ended on every live worker (StopIteration, no error for join)."""
        self._stats.count("not_run_end_of_input")
        self.values.pop(c.step_id)._set(error=self.ended(c, _not_run(c)))

    def shard_lost(self, e: BaseException) -> BaseException:
        with self.queue.lock:
            err = shard_lost_error(e)
            self.fail(self.queue.mark_failed(err), err)
            return self.queue.error

    def worker_lost(self, w: int, c: Closure, e: BaseException) -> None:
        # Its push, if shard 0 decided it, is committed on the other shards first (the
        # rerun's push is then a duplicate everywhere); a lost shard shows up on the next
        # push or pull. Then the shards say which decided it (a step given up with its
        # push on some shards only is named).
        answers: list = [None]

        def ask() -> None:
            answers[0] = self._carrier.decided(c.step_id)

        for call in (lambda: self._carrier.settle(c.step_id), ask,
                     lambda: self._carrier.workers_alive(sum(self.alive) - self.alive[w])):
            try:
                call()
            except Exception:  # noqa: BLE001 - a carrier call failing here must not stop
                # the loss being recorded: the shards are then told at the next push
                _log.warning("parameter server: worker %d's loss: a shard call failed; "
                             "its loss is recorded regardless", w, exc_info=True)
        with self.queue.lock:
            self.record.note_fate(c.step_id, answers[0])
            self.alive[w] = False
            self._gate.lose(w)
            if self._carrier.replaces_workers and not self.queue.stopped:
                self.replacing.add(w)
            rv = self.values[c.step_id]
            if c.cancel.is_set():  # another step raised first: not run again
                self.end_cancelled(c)
            elif self.queue.stopped:  # shut down: nothing takes it again
                self.give_up(c, StepCancelledError(
                    f"the strategy shut down while step {c.step_id} ran; its worker was "
                    f"lost ({type(e).__name__}: {e}) and it was not run again"))
            elif rv.attempts >= self._max_attempts:
                self.give_up(c, WorkerLostError(
                    f"step {c.step_id} failed on {rv.attempts} workers; the last error: "
                    f"{type(e).__name__}: {e}"))
            elif not self.any_live():
                self.give_up(c, ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
                self.fail(self.queue.drain(), ParameterServerError("every worker died"))
            else:
                self._stats.count("rescheduled")
                self.queue.put_back(c)
            self.end_exhausted_inputs()  # the dead worker's input no longer counts
            self.notify_all()

    def give_up(self, c: Closure, error: BaseException) -> None:
        """``c``'s step fails with ``error`` (the first error for join, if none)."""
        error = self.ended(c, error)
        self.queue.mark_finished(c)
        self.values.pop(c.step_id)._set(error=error)
        self.first_error = self.first_error or error

    def end_cancelled(self, c: Closure) -> None:
        """(Under the lock.) Cancelled step ``c`` (another step raised first), out of
        flight without a push, ends with StepCancelledError (not run again; its id
        skipped on every shard; not an error for join)."""
        self.queue.mark_finished(c)
        self.values.pop(c.step_id)._set(error=self.ended(c, StepCancelledError(
            c.cancel.reason)))

    def any_live(self) -> bool:
        """Whether a worker is alive or being replaced (called under the lock)."""
        return any(self.alive) or bool(self.replacing)

    def revive(self, w: int) -> bool:
        """Lost worker ``w`` replaced by the carrier (``replace``)? If so it is alive
        again and True; if not, it is lost for good (with the steps, when it was the
        last one)."""
        if not self._carrier.replaces_workers:
            return False
        ok = False
        if not self.queue.stopped:
            try:
                ok = bool(self._carrier.replace_worker(w))
            except Exception:  # noqa: BLE001 - whatever the carrier's replacement
                # raised (Ray's errors, a device's), the worker stays lost
                _log.warning("parameter server: worker %d could not be replaced; it "
                             "stays lost", w, exc_info=True)
        with self.queue.lock:
            self.replacing.discard(w)
            if ok and not self.queue.stopped:
                self.alive[w] = True
                self._gate.rejoin(w)
                self._stats.count("replaced")
            elif not self.any_live() and self.queue.queued:
                self.fail_all(ParameterServerError(
                    f"every worker died (worker {w} could not be replaced)"))
            self.end_exhausted_inputs()
            self.notify_all()
            alive, n = self.alive[w], sum(self.alive)
        if alive:
            try:
                self._carrier.workers_alive(n)  # the shards count it again
            except Exception:  # noqa: BLE001 - the replacement stands; the shards learn
                # the live count at the next push
                _log.warning("parameter server: worker %d replaced, but telling the shards "
                             "the live workers failed", w, exc_info=True)
        return alive

    def not_run(self, c: Closure, e: BaseException) -> None:
        """``c`` was started on a worker after a step that the worker was lost in: it
        never ran there (a worker runs its steps in order), so it goes back to the queue
        (behind the lost step) without counting as an attempt."""
        with self.queue.lock:
            self.values[c.step_id].attempts -= 1
            if c.cancel.is_set():
                self.end_cancelled(c)
            elif self.queue.stopped:
                self.give_up(c, StepCancelledError(
                    "the strategy shut down before this step ran"))
            elif not self.any_live():
                self.give_up(c, ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
            else:
                self._stats.count("rescheduled")
                self.queue.put_back(c, position=1)

    def notify_all(self) -> None:
        """Worker liveness changed: both the takers' and join's predicates read it."""
        self.queue.notify_takers()
        self.queue.notify_waiters()

    def fail(self, closures: list[Closure], error: BaseException) -> None:
        """The steps of ``closures`` (removed from the queue) fail with ``error``."""
        for c in closures:
            rv = self.values.pop(c.step_id, None)
            if rv is not None:
                rv._set(error=self.ended(c, error))

    def fail_all(self, error: BaseException) -> None:
        self.first_error = self.first_error or error
        self.fail(self.queue.drain(), error)

def _shut_down_while_running(c: Closure, e: ShardClosedError) -> StepCancelledError:
    """The error of step ``c``, running when the strategy shut down (its shards closed):
    a public one (``jr.ps.StepCancelledError``), the shard's as its cause."""
    err = StepCancelledError(f"the strategy shut down while step {c.step_id} ran (its "
                             "shards closed before it pushed or pulled); nothing ran it "
                             "again")
    err.__cause__ = e
    return err


def _outputs_lost(c: Closure, error: BaseException) -> StepOutputsLostError:
    """The error of step ``c``, applied on every shard by a run whose worker was lost
    after pushing, that ended without a later run returning its outputs (``error``)."""
    err = StepOutputsLostError(
        f"step {c.step_id}'s update was applied on every shard, but its worker was lost "
        "after pushing, so its outputs are lost, and no later run recomputed them "
        f"({type(error).__name__}: {error}). Count it as applied; read the parameters "
        "from the shards (strategy.parameters()).")
    err.__cause__ = error
    return err


def _not_run(c: Closure) -> StopIteration:
    return StopIteration(f"step {c.step_id} was not run: every worker's input pipeline "
                         "is exhausted")
