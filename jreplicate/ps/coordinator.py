"""Scheduling with TF2 ``ClusterCoordinator`` semantics, for both carriers.

``schedule`` puts a closure in a :class:`~jreplicate.ps.closure_queue.ClosureQueue` and
returns a :class:`RemoteValue` at once; one thread per worker takes closures as the
worker becomes free and runs them through a *runner* (the embedded carrier calls
:meth:`PSWorker.run` in-process; the Ray carrier calls a worker actor). Outcomes:

* success: the RemoteValue gets the outputs;
* :class:`ApplicationError` (the step raised, or a shard's optimizer update raised for
  its push: :class:`~jreplicate.ps.ShardUpdateError`, which no shard applied): the
  RemoteValue gets the error (not retried, as in TF; the worker stays alive) and, as
  TF's ``mark_failed``, training stops: the queued steps end with
  :class:`StepCancelledError` (not run), the running ones are flagged
  (``Closure.cancel``: the worker refuses the push of one that has not pushed yet), and
  the next :meth:`Coordinator.schedule` or :meth:`Coordinator.join` raises the first
  error, once, after the running steps ended (TF's ``_raise_if_error``);
* a worker failure (:class:`WorkerLostError`, Ray's ``ActorDiedError``, any other
  exception of the carrier): the worker is marked dead and the closure goes back to the
  front of the queue with its id, so its push is applied at most once (the shards'
  ledgers drop a second push of the id as a duplicate); after ``max_attempts`` the
  step fails. A carrier that can replace the worker (Ray restarts a dead worker
  actor, ``max_restarts``; the embedded carrier makes a new worker with its index,
  ``max_worker_restarts``) is asked to (``replace``); the replaced worker takes steps
  again, on a new thread;
* a lost shard (:class:`ShardClosedError` while not shutting down, or the Ray actor of a
  shard dead): :class:`ParameterServerError` for this and every pending step.

A step that ends for good without pushing (its function raised, its token wait was
cancelled, it was not run: cancelled at shutdown, given up, or at the end of its input)
is *skipped* on every shard (``skip``: each ledger decides its id without a push, so the
ledgers' watermarks move past it; a no-op where a shard decided it) and recorded in
:attr:`Coordinator.skipped`. A step re-queued (a lost worker's, or one handed back at the
end of a worker's input) keeps its id and is not skipped: it may still push.

A worker lost in a step may have pushed to some shards only (asynchronous mode pushes to
each shard on its own). The coordinator asks the shards (``decided``) which decided the
id; a step that then ends for good (``max_attempts``, shutdown, ...) with its push on
some shards and not on others fails with :class:`ParameterServerError` naming the step
and the shards, and training stops (the shards disagree: restore the last checkpoint);
:attr:`Coordinator.half_applied` keeps them, so that ``state()`` refuses to save them.

Bounded staleness (``max_staleness=tau``): a worker starts a step only while the
:class:`~jreplicate.ps.admission.StalenessGate` admits it. The shards drop a push staler
than tau all the same (``stale`` in the ledger), which only a step outliving its worker
can cause. Stale-synchronous parallel (``max_clock_lead=s``): the
:class:`~jreplicate.ps.admission.ClockGate` admits a worker only while its clock (steps
ended on it) is at most s ahead of the slowest live worker's; a lost worker leaves the
minimum, a replaced one rejoins at the slowest live clock.

Token-gated mode: when every running step waits for a token, none is queued and shard 0
has none to give, ``join`` cancels the waits (:class:`StepCancelledError`; see
:class:`~jreplicate.ps.admission.StarvationDetector`). A worker lost mid-push has its
decided push committed on the other shards (``settle``) before its step runs again.

Input read on the workers (``PER_WORKER``, :mod:`jreplicate.ps.worker_input`): a worker
whose pipeline of an iterator is exhausted (:class:`InputEnded`) hands its step back,
uncounted, and takes no more steps of that iterator; once every live worker's is, the
queued steps of that iterator end with ``StopIteration`` (not run, not an error for
``join``) and scheduling another raises ``StopIteration``.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from jreplicate.ps.admission import (
    AdmissionGate,
    ClockGate,
    CoordinatorStats,
    StalenessGate,
    StarvationDetector,
    StatsRecorder,
)
from jreplicate.ps.closure import Closure
from jreplicate.ps.closure_queue import ClosureQueue
from jreplicate.ps.ledger import Ledger
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    StepCancelledError,
    WorkerLostError,
)
from jreplicate.ps.shard import ShardClosedError
from jreplicate.ps.step_record import StepRecord
from jreplicate.ps.worker import ApplicationError
from jreplicate.ps.worker_input import InputEnded, WorkerInput, WorkerInputs

_log = logging.getLogger("jreplicate")

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, stops every coordinator's threads before Python finalises
    (a daemon thread inside a JAX call during finalisation aborts the process)."""
    for c in list(_LIVE):
        c.shutdown(wait=2.0)


def _ignore(*args: Any) -> None:
    del args


class Coordinator:
    """Runs closures on workers through ``runners[i](closure, on_token_wait)``.

    Args:
      runners: one callable per worker that starts a step and returns a callable
        waiting for it (returning its outputs, or raising its error).
      depth: steps in flight per worker (> 1: the next steps are started while the
        worker runs one, so that it never waits for the coordinator; asynchronous
        unbounded training only). A worker runs its steps in the order started, so
        when it is lost, the steps started after the lost one never ran: they go back
        to the queue without counting as an attempt.
      max_staleness: the bounded delay tau, or None (fully asynchronous).
      max_clock_lead: stale-synchronous parallel's s, or None (exclusive with
        ``max_staleness``).
      max_attempts: runs of one closure before its step fails.
      is_shard_failure: tells a shard's failure from a worker's (Ray's errors).
      interrupt: makes every token wait raise (join cancels them).
      on_worker_lost: ``on_worker_lost(n)``: ``n`` workers are alive now.
      on_relax: token-gated, ``on_relax(True)`` when every running step waits for a
        token and nothing is queued (the waiters may take a second token of the
        current step); ``on_relax(False)`` when new steps are scheduled.
      settle: ``settle(step_id)`` commits a lost worker's decided push on every shard.
      starved: whether shard 0 has no token a waiting worker could take.
      replace: ``replace(w)`` after worker ``w`` was lost: True when the carrier replaced
        it (Ray restarted its actor; the embedded carrier made a new worker), so ``w``
        takes steps again, on a new thread; called on ``w``'s
        thread once its steps are ended (the lost step already rescheduled), and ``w``
        counts as coming back meanwhile (the steps wait for it rather than fail when no
        other worker is alive).
      decided: ``decided(step_id)``: whether each shard decided the step's push (None
        for a shard that did not answer); asked after a worker was lost in the step.
        Without it such a step's push is of unknown fate (never skipped).
      skip: ``skip(step_id)``: every shard decides the id without a push (called under
        the coordinator's lock: it must not block; errors are ignored).
      forget: ``forget(n)``: every step with an id below ``n`` ended, so the shards may
        let go of what they keep for those steps' reruns (called now and then, under the
        lock, like ``skip``).
      record: the record of the steps before the first one this coordinator runs (a
        restored state's: :meth:`StepRecord.from_arrays`); default: a new job's.
    """

    #: Seconds every running step must wait for a token, none queued and no progress,
    #: before shard 0 is asked whether a token is there and, if none, join cancels (a
    #: token_timeout below it gives its own error first).
    STARVED_AFTER = 1.0
    IDLE_EXIT = 5.0  # seconds a worker thread waits for work before it exits

    def __init__(self, runners: list[Callable], *, depth: int = 1,
                 max_staleness: int | None = None, max_clock_lead: int | None = None,
                 max_attempts: int = 4,
                 is_shard_failure: Callable[[BaseException], bool] | None = None,
                 interrupt: Callable[[], None] | None = None,
                 on_worker_lost: Callable[[int], None] | None = None,
                 on_relax: Callable[[bool], None] | None = None,
                 settle: Callable[[int], None] | None = None,
                 starved: Callable[[], bool] | None = None,
                 replace: Callable[[int], bool] | None = None,
                 decided: Callable[[int], list[bool | None]] | None = None,
                 skip: Callable[[int], None] | None = None,
                 forget: Callable[[int], None] | None = None,
                 record: StepRecord | None = None):
        if depth > 1 and (max_staleness is not None or max_clock_lead is not None):
            raise ValueError("Coordinator(depth > 1): bounded staleness admits one step "
                             "per worker at a time.")
        if max_staleness is not None and max_clock_lead is not None:
            raise ValueError("Coordinator: pass max_staleness (bounded delay) or "
                             "max_clock_lead (stale-synchronous), not both.")
        self._runners = runners
        self._depth = depth
        self._max_attempts = max_attempts
        self._is_shard_failure = is_shard_failure or (lambda e: False)
        self._interrupt = interrupt or _ignore
        self._on_worker_lost = on_worker_lost or _ignore
        self._on_relax = on_relax or _ignore
        self._settle = settle or _ignore
        self._starved = starved or (lambda: True)
        self._replace = replace
        self._decided = decided or (lambda step_id: None)
        self._skip = skip or _ignore
        self._forget = forget or _ignore
        self._stats = StatsRecorder(len(runners))
        self._gate: AdmissionGate = (
            StalenessGate(max_staleness, self._stats) if max_clock_lead is None
            else ClockGate(max_clock_lead, len(runners), self._stats))
        self._starvation = StarvationDetector(self.STARVED_AFTER)
        self._queue = ClosureQueue(on_start=lambda c: self._gate.start(c.step_id),
                                   on_stop=lambda c: self._gate.stop(c.step_id))
        self._values: dict[int, RemoteValue] = {}
        self._alive = [True] * len(runners)
        self._replacing: set[int] = set()  # lost workers the carrier is replacing
        self._first_error: BaseException | None = None
        #: A step raised its own error (TF's ``mark_failed``): the steps behind it were
        #: cancelled, and the next schedule or join raises ``_first_error``, once.
        self._stopped_by_error = False
        self._threads: list[threading.Thread | None] = [None] * len(runners)
        # Per sweep of a per-worker input, (key, generation): the workers at its end,
        # and the sweeps ended on every live worker. A sweep is a generation of the
        # input (reinitialize() starts the next); each step reads the sweep it was
        # scheduled in, so the end of one sweep never ends another.
        self._input_ended: dict[tuple[int, int], set[int]] = {}
        self._input_exhausted: set[tuple[int, int]] = set()
        #: The record of ended steps (completed, skipped, half applied) and of the
        #: job's history: see :mod:`jreplicate.ps.step_record`.
        self.record = record if record is not None else StepRecord()
        _LIVE.add(self)
        with self._queue.lock:
            self._start_threads()

    def _start_threads(self) -> None:
        """(Re)starts the thread of every live worker that has none (threads exit after
        ``IDLE_EXIT`` seconds without work, so an unused strategy holds no threads)."""
        for w, t in enumerate(self._threads):
            if self._alive[w] and (t is None or not t.is_alive()):
                t = threading.Thread(target=self._loop, args=(w,), daemon=True,
                                     name=f"jreplicate-ps-worker-{w}")
                self._threads[w] = t
                t.start()

    # -- the driver's calls --------------------------------------------------------------
    def schedule(self, closure: Closure) -> RemoteValue:
        q = self._queue
        with q.lock:
            if q.error is not None:
                raise q.error
            if self._stopped_by_error:
                self._raise_stopping_error()
            if q.stopped:
                raise RuntimeError("ParameterServerStrategy was shut down; create a new one.")
            if not self._any_live():
                raise ParameterServerError(
                    "every worker of the ParameterServerStrategy is dead; nothing can run "
                    "the step. Restart the job (restore the last checkpoint).")
            if _input_sweep(closure) in self._input_exhausted:
                raise StopIteration
            rv = RemoteValue(closure.step_id)
            self._values[closure.step_id] = rv
            q.put(closure)
            self._stats.count("scheduled")
            self._start_threads()
            restore = self._starvation.unrelax()
        if restore:
            self._on_relax(False)
        return rv

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled step finished (cancelled ones are not waited for:
        they ended); re-raises the first error, once (a step's error raised by the
        next ``schedule`` first is not raised again).

        Raises:
          TimeoutError: ``timeout`` seconds passed with steps still pending.
          ParameterServerError: a shard was lost.
          StepCancelledError: steps wait for tokens no running step can produce.
        """
        end = None if timeout is None else time.monotonic() + timeout
        q = self._queue
        with q.lock:
            self._starvation.asked()  # a new join looks at starvation afresh
            while q.pending and q.error is None:
                if not self._any_live() and q.queued:
                    self._fail_all(ParameterServerError(
                        "every worker died; the remaining steps cannot run."))
                    break
                recheck = self._check_starved()
                if q.error is not None:
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"join: {q.pending} steps still pending after "
                                       f"{timeout} s.")
                q.wait_for_change(min((t for t in (recheck, left) if t is not None), default=None))
            fatal = q.error
            if fatal is not None:
                q.lock.release()
                try:
                    self._interrupt()  # wake token waits
                finally:
                    q.lock.acquire()
                q.wait_inflight(60.0)
            if fatal is None and self._stopped_by_error:
                self._raise_stopping_error()
            err = fatal or self._first_error
            self._first_error = None
            if isinstance(fatal, StepCancelledError):
                q.clear_error()  # starved token waits: later steps may run again
        if err is not None:
            raise err

    @property
    def completed_ids(self) -> Ledger:
        """:attr:`StepRecord.completed_ids` of :attr:`record`."""
        return self.record.completed_ids

    @property
    def skipped(self) -> set[int]:
        """:attr:`StepRecord.skipped` of :attr:`record` (the skipped ids of its history,
        a copy)."""
        return self.record.skipped

    @property
    def half_applied(self) -> dict[int, str]:
        """:attr:`StepRecord.half_applied` of :attr:`record`."""
        return self.record.half_applied

    @property
    def pending(self) -> int:
        """Steps scheduled and not finished (queued or running)."""
        return self._queue.pending

    @property
    def _inflight(self) -> dict[int, int]:
        """``{step id: worker}`` of the running steps."""
        return self._queue.running()

    def stats(self) -> CoordinatorStats:
        """A snapshot of the counters."""
        return self._stats.snapshot()

    @property
    def rescheduled(self) -> int:
        return self._stats.snapshot().rescheduled

    def _check_starved(self) -> float | None:
        """Cancels the running steps if every one of them waits for a token, none is
        queued, nothing progressed for ``STARVED_AFTER`` seconds and shard 0 has no
        token to give. Returns when to look again (None: not waiting on tokens)."""
        q, det = self._queue, self._starvation
        due = det.due(det.stuck(q.running_workers(), q.queued))
        if due is None or due > 0:
            return due
        progress = det.progress
        q.lock.release()  # shard 0 is asked outside the coordinator's lock
        try:
            none_to_give = self._starved()
        finally:
            q.lock.acquire()
        if none_to_give and progress == det.progress and \
                det.stuck(q.running_workers(), q.queued):
            q.mark_failed(StepCancelledError(
                f"token-gated training cannot go on: steps {sorted(q.running())} wait "
                "for a token of the next global step, but no other step is scheduled or "
                "running to push the gradients that step needs. Schedule steps in "
                "multiples of the number of workers, or lower replicas_to_aggregate."))
        det.asked()
        return det.grace

    def shutdown(self, wait: float = 0.0) -> None:
        """Cancels queued steps and stops the threads (waiting up to ``wait`` seconds
        for running steps to end)."""
        with self._queue.lock:
            self._fail(self._queue.stop(),
                       StepCancelledError("the strategy shut down before this step ran"))
            threads = [t for t in self._threads if t is not None]
        self._interrupt()
        end = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def kill(self, worker: int) -> None:
        with self._queue.lock:
            self._alive[worker] = False
            self._gate.lose(worker)
            self._notify_all()

    @property
    def alive(self) -> list[bool]:
        return list(self._alive)

    def input_exhausted(self, key: int, generation: int) -> bool:
        """Whether sweep ``generation`` of input ``key`` is exhausted on every live
        worker."""
        return self.sweep_exhausted((key, generation))

    def sweep_exhausted(self, sweep: tuple) -> bool:
        """Whether ``sweep`` (of one input, or several read together) is exhausted on
        every live worker."""
        with self._queue.lock:
            return sweep in self._input_exhausted

    def resume(self) -> None:
        """Training goes on after a lost shard was restarted: the loss no longer stops
        new steps (nothing may be pending)."""
        with self._queue.lock:
            if self._queue.pending:
                raise RuntimeError("resume: steps are pending; join first.")
            self._first_error = None
            self._queue.clear_error()

    def reset_input(self, key: int, generation: int) -> None:
        """Input ``key`` was restarted (``reinitialize``) for its sweep ``generation``:
        every worker may read it (the sweep's ends are counted afresh)."""
        with self._queue.lock:
            self._input_ended.pop((key, generation), None)
            self._input_exhausted.discard((key, generation))
            self._start_threads()
            self._queue.notify_takers()

    # -- the worker threads ------------------------------------------------------------
    def _take(self, w: int, wait: bool = True) -> Closure | None:
        """The next closure ``w`` may run, marked running (None: stop, or none now when
        not ``wait``-ing)."""
        q, gate = self._queue, self._gate
        kw = {} if not gate.bounded else {"admit": lambda c: gate.admits(
            w, lambda v: self._can_run(v, c), q.running())}
        with q.lock:
            gate.arrive(w)
            try:
                c = q.get(w, lambda c: self._can_run(w, c), stop=lambda: not self._alive[w],
                          idle_timeout=self.IDLE_EXIT if wait else 0, **kw)
            finally:
                gate.leave(w)
                if kw:
                    q.notify_takers()  # the next idle worker may be first now
            if c is None and wait and self._alive[w] and not q.stopped:
                self._threads[w] = None  # idle: restarted by the next schedule
            return c

    def _can_run(self, w: int, c: Closure) -> bool:
        """Whether ``w`` can run ``c``: not if ``c`` reads an input sweep ended on ``w``."""
        sweep = _input_sweep(c)
        return sweep is None or w not in self._input_ended.get(sweep, ())

    def _token_wait(self, w: int, waiting: bool) -> None:
        with self._queue.lock:
            self._starvation.token_wait(w, waiting)
            self._queue.notify_waiters()  # join's starvation check
        self._maybe_relax()

    def _maybe_relax(self) -> None:
        q, det = self._queue, self._starvation
        with q.lock:
            relax = det.relax(det.stuck(q.running_workers(), q.queued))
        if relax:
            self._on_relax(True)

    def _loop(self, w: int) -> None:
        """Worker ``w``'s thread: keeps up to ``depth`` steps started on it and ends
        them in the order started; after ``w`` is lost, ends the rest and exits."""
        started: collections.deque = collections.deque()  # (closure, wait for it)
        lost = False
        while True:
            if not lost and len(started) < self._depth:
                c = self._take(w, wait=not started)
                if c is not None:
                    started.append((c, self._begin(w, c)))
                    continue
            if not started:
                if lost and self._revive(w):
                    with self._queue.lock:  # a new thread runs the replaced worker
                        self._threads[w] = None
                        self._start_threads()
                return
            c, wait = started.popleft()
            lost = self._end(w, c, wait, lost) or lost
            # Not kept while this thread waits for the next step: a finished step's
            # function and outputs are freed when the caller lets them go.
            c = wait = None

    def _begin(self, w: int, c: Closure) -> Callable[[], Any]:
        """Starts ``c`` on ``w`` (one more attempt); returns the wait for its outputs."""
        rv = self._values[c.step_id]
        rv.attempts += 1
        c.attempt = rv.attempts
        try:
            return self._runners[w](c, lambda waiting, w=w: self._token_wait(w, waiting))
        except BaseException as e:  # ended like an error of the step's run
            def failed(e=e):
                raise e
            return failed

    def _end(self, w: int, c: Closure, wait: Callable[[], Any], lost: bool) -> bool:
        """Waits for ``c``'s run on ``w`` and records its outcome; True: ``w`` was lost
        (``lost``: it was lost before, so ``c`` never ran there)."""
        try:
            out = wait()
        except InputEnded:  # the step's own sweep (see WorkerPipelines.read)
            self._end_of_input(w, c)
        except ApplicationError as e:
            self._finish(w, c, error=e.error, stops=True)
        except StepCancelledError as e:
            self._finish(w, c, error=self._queue.error or e)
        # A shard lost (or closed) in the step: its push may be on some shards only, and
        # the shards cannot all tell; its id is left undecided (resolved=False).
        except ShardClosedError as e:
            self._finish(w, c, error=_shut_down_while_running(c, e) if self._queue.stopped
                         else self._shard_lost(e), resolved=False)
        except ParameterServerError as e:  # the shards disagree (see ShardClient)
            self._finish(w, c, error=self._shard_lost(e), resolved=False)
        except BaseException as e:  # a worker failure: retry elsewhere
            if self._is_shard_failure(e):
                self._finish(w, c, error=self._shard_lost(e), resolved=False)
            elif lost:
                self._not_run(c, e)
            else:
                self._worker_lost(w, c, e)
                return True
        else:
            self._values[c.step_id].worker = w
            self._finish(w, c, value=out)
        return False

    # -- outcomes (each in one critical section with the queue) --------------------------
    def _finish(self, w: int, c: Closure, value: Any = None,
                error: BaseException | None = None, resolved: bool = True,
                stops: bool = False) -> None:
        """Records ``c``'s outcome on ``w``. ``stops``: ``error`` is the step's own (it
        raised): the steps behind it are cancelled (:meth:`_cancel_behind`)."""
        interrupt = False
        with self._queue.lock:
            if error is not None:
                raw, error = error, self._ended(c, error, resolved)
                if stops and error is raw and self._queue.error is None:
                    interrupt = self._cancel_behind(c, error)
            self._gate.tick(w)  # before mark_finished wakes the takers
            self._queue.mark_finished(c)
            self._starvation.moved()
            rv = self._values.pop(c.step_id)
            if error is None:
                self.record.completed(c.step_id)  # pushed by this run to every shard
                self._stats.completed(w)
                self._forget_ended()
            elif self._first_error is None and self._queue.error is None:
                self._first_error = error
            rv._set(value, error)
        if interrupt:
            self._interrupt()  # token waits of the cancelled steps end
        self._maybe_relax()

    def _cancel_behind(self, c: Closure, error: BaseException) -> bool:
        """(Under the lock.) Step ``c`` raised ``error``: as TensorFlow's coordinator,
        the queued steps end with StepCancelledError, not run (skipped on every shard);
        the running ones are flagged, so that their workers refuse their pushes (each
        ends with StepCancelledError once its worker sees the flag, or completes if it
        was pushing already); the next schedule or join raises the first error. Returns
        whether any step is running (its token wait, if any, is to be interrupted)."""
        self._stopped_by_error = True
        if self._first_error is None:
            self._first_error = error
        why = f"step {c.step_id} raised first ({type(error).__name__}: {error})"
        for q in self._queue.drain():
            self._values.pop(q.step_id)._set(error=self._ended(q, StepCancelledError(
                f"step {q.step_id} was cancelled before it ran: {why}")))
        running = self._queue.in_flight()
        for r in running:
            r.cancel.set(f"step {r.step_id} was cancelled while it ran, before it "
                         f"pushed: {why}; its push was not applied")
        return bool(running)

    def _raise_stopping_error(self) -> None:
        """(Under the lock.) Raises the first error of a stopped training, once (TF's
        ``_raise_if_error``), after the steps that were running when it stopped ended
        (their pushes refused, or applied if they were pushing already), so that the
        shards' parameters and ledgers no longer change for them."""
        q = self._queue
        q.lock.release()
        try:
            self._interrupt()  # (a token wait that began after the first interrupt)
        finally:
            q.lock.acquire()
        q.wait_inflight(None)
        err, self._first_error, self._stopped_by_error = self._first_error, None, False
        if err is not None:
            raise err

    def _ended(self, c: Closure, error: BaseException, resolved: bool = True
               ) -> BaseException:
        """(Under the lock.) Step ``c`` ends for good without success; returns the error
        its RemoteValue gets (see :meth:`StepRecord.ended`): its id skipped on every
        shard, or, with its push on some shards only, a ParameterServerError with which
        training stops (queued steps fail with it)."""
        got = self.record.ended(c.step_id, error, resolved)
        if isinstance(got, ParameterServerError):
            self._first_error = self._first_error or got
            self._fail(self._queue.mark_failed(got), got)
            return got
        if got:
            try:
                self._skip(c.step_id)
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                _log.debug("coordinator: a lost shard: its loss is raised elsewhere", exc_info=True)
        self._forget_ended()
        return error

    def _forget_ended(self) -> None:
        """(Under the lock.) Now and then, tells the shards below which id every step
        ended (:meth:`StepRecord.forget_due`)."""
        below = self.record.forget_due()
        if below is not None:
            try:
                self._forget(below)
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                _log.debug("coordinator: a lost shard: its loss is raised elsewhere", exc_info=True)

    def _end_of_input(self, w: int, c: Closure) -> None:
        """``w``'s pipeline of ``c``'s input sweep is exhausted (or restarted for a later
        sweep): ``c`` goes back to the front of the queue (this run uncounted) for a
        worker that still has input of that sweep; if none has, it is not run
        (StopIteration)."""
        sweep = _input_sweep(c)
        with self._queue.lock:
            self._starvation.moved()
            self._values[c.step_id].attempts -= 1
            self._input_ended.setdefault(sweep, set()).add(w)
            if c.cancel.is_set():
                self._end_cancelled(c)
                return
            if self._queue.stopped:
                self._give_up(c, StepCancelledError(
                    "the strategy shut down before this step ran"))
                return
            if sweep in self._input_exhausted:  # ended everywhere while c ran
                self._queue.mark_finished(c)
                self._end_not_run(c)
                return
            self._queue.put_back(c)
            self._end_exhausted_inputs()

    def _end_exhausted_inputs(self) -> None:
        """Inputs ended on every live worker: their queued steps end with
        StopIteration (not run; no error for join)."""
        for sweep, ended in self._input_ended.items():
            if sweep in self._input_exhausted or not all(
                    v in ended for v, alive in enumerate(self._alive) if alive):
                continue
            self._input_exhausted.add(sweep)
            for c in self._queue.remove_where(
                    lambda c, sweep=sweep: _input_sweep(c) == sweep):
                self._end_not_run(c)

    def _end_not_run(self, c: Closure) -> None:
        """(Under the lock.) Step ``c``, out of the queue, is not run: its input sweep
        ended on every live worker (StopIteration, no error for join)."""
        self._stats.count("not_run_end_of_input")
        self._values.pop(c.step_id)._set(error=self._ended(c, _not_run(c)))

    def _shard_lost(self, e: BaseException) -> BaseException:
        with self._queue.lock:
            err = ParameterServerError(
                f"a parameter-server shard failed ({type(e).__name__}: {e}); the "
                "parameters it held are gone, so training stops. Restore the last "
                "checkpoint (strategy.restore(...)), or restart the lost shard from "
                "it (strategy.restart_shard(i, state)).")
            err.__cause__ = e
            self._fail(self._queue.mark_failed(err), err)
            return self._queue.error

    def _worker_lost(self, w: int, c: Closure, e: BaseException) -> None:
        # Its push, if shard 0 decided it, is committed on the other shards first (the
        # rerun's push is then a duplicate everywhere); a lost shard shows up on the next
        # push or pull. Then the shards say which decided it (a step given up with its
        # push on some shards only is named).
        answers: list = [None]

        def ask() -> None:
            answers[0] = self._decided(c.step_id)

        for call in (lambda: self._settle(c.step_id), ask,
                     lambda: self._on_worker_lost(sum(self._alive) - self._alive[w])):
            try:
                call()
            except Exception:  # noqa: BLE001 - a carrier call failing here must not stop
                # the loss being recorded: the shards are then told at the next push
                _log.warning("parameter server: worker %d's loss: a shard call failed; "
                             "its loss is recorded regardless", w, exc_info=True)
        with self._queue.lock:
            self.record.note_fate(c.step_id, answers[0])
            self._alive[w] = False
            self._gate.lose(w)
            if self._replace is not None and not self._queue.stopped:
                self._replacing.add(w)
            rv = self._values[c.step_id]
            if c.cancel.is_set():  # another step raised first: not run again
                self._end_cancelled(c)
            elif self._queue.stopped:  # shut down: nothing takes it again
                self._give_up(c, StepCancelledError(
                    f"the strategy shut down while step {c.step_id} ran; its worker was "
                    f"lost ({type(e).__name__}: {e}) and it was not run again"))
            elif rv.attempts >= self._max_attempts:
                self._give_up(c, WorkerLostError(
                    f"step {c.step_id} failed on {rv.attempts} workers; the last error: "
                    f"{type(e).__name__}: {e}"))
            elif not self._any_live():
                self._give_up(c, ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
                self._fail(self._queue.drain(), ParameterServerError("every worker died"))
            else:
                self._stats.count("rescheduled")
                self._queue.put_back(c)
            self._end_exhausted_inputs()  # the dead worker's input no longer counts
            self._notify_all()

    def _give_up(self, c: Closure, error: BaseException) -> None:
        """``c``'s step fails with ``error`` (the first error for join, if none)."""
        error = self._ended(c, error)
        self._queue.mark_finished(c)
        self._values.pop(c.step_id)._set(error=error)
        self._first_error = self._first_error or error

    def _end_cancelled(self, c: Closure) -> None:
        """(Under the lock.) Cancelled step ``c`` (another step raised first), out of
        flight without a push, ends with StepCancelledError (not run again; its id
        skipped on every shard; not an error for join)."""
        self._queue.mark_finished(c)
        self._values.pop(c.step_id)._set(error=self._ended(c, StepCancelledError(
            c.cancel.reason)))

    def _any_live(self) -> bool:
        """Whether a worker is alive or being replaced (called under the lock)."""
        return any(self._alive) or bool(self._replacing)

    def _revive(self, w: int) -> bool:
        """Lost worker ``w`` replaced by the carrier (``replace``)? If so it is alive
        again and True; if not, it is lost for good (with the steps, when it was the
        last one)."""
        if self._replace is None:
            return False
        ok = False
        if not self._queue.stopped:
            try:
                ok = bool(self._replace(w))
            except Exception:  # the carrier could not: the worker stays lost
                ok = False
        with self._queue.lock:
            self._replacing.discard(w)
            if ok and not self._queue.stopped:
                self._alive[w] = True
                self._gate.rejoin(w)
                self._stats.count("replaced")
            elif not self._any_live() and self._queue.queued:
                self._fail_all(ParameterServerError(
                    f"every worker died (worker {w} could not be replaced)"))
            self._end_exhausted_inputs()
            self._notify_all()
            alive, n = self._alive[w], sum(self._alive)
        if alive:
            try:
                self._on_worker_lost(n)  # the shards count it again
            except Exception:  # noqa: BLE001 - the replacement stands; the shards learn
                # the live count at the next push
                _log.warning("parameter server: worker %d replaced, but telling the shards "
                             "the live workers failed", w, exc_info=True)
        return alive

    def _not_run(self, c: Closure, e: BaseException) -> None:
        """``c`` was started on a worker after a step that the worker was lost in: it
        never ran there (a worker runs its steps in order), so it goes back to the queue
        (behind the lost step) without counting as an attempt."""
        with self._queue.lock:
            self._values[c.step_id].attempts -= 1
            if c.cancel.is_set():
                self._end_cancelled(c)
            elif self._queue.stopped:
                self._give_up(c, StepCancelledError(
                    "the strategy shut down before this step ran"))
            elif not self._any_live():
                self._give_up(c, ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
            else:
                self._stats.count("rescheduled")
                self._queue.put_back(c, position=1)

    def _notify_all(self) -> None:
        """Worker liveness changed: both the takers' and join's predicates read it."""
        self._queue.notify_takers()
        self._queue.notify_waiters()

    def _fail(self, closures: list[Closure], error: BaseException) -> None:
        """The steps of ``closures`` (removed from the queue) fail with ``error``."""
        for c in closures:
            rv = self._values.pop(c.step_id, None)
            if rv is not None:
                rv._set(error=self._ended(c, error))

    def _fail_all(self, error: BaseException) -> None:
        self._first_error = self._first_error or error
        self._fail(self._queue.drain(), error)


def _shut_down_while_running(c: Closure, e: ShardClosedError) -> StepCancelledError:
    """The error of step ``c``, running when the strategy shut down (its shards closed):
    a public one (``jr.ps.StepCancelledError``), the shard's as its cause."""
    err = StepCancelledError(f"the strategy shut down while step {c.step_id} ran (its "
                             "shards closed before it pushed or pulled); nothing ran it "
                             "again")
    err.__cause__ = e
    return err


def _not_run(c: Closure) -> StopIteration:
    return StopIteration(f"step {c.step_id} was not run: every worker's input pipeline "
                         "is exhausted")


def _input_sweep(c: Closure) -> tuple | None:
    """The sweep ``(key, generation)`` of the per-worker input ``c`` reads (a tuple of
    them for several read together), or None."""
    m = c.batch
    return m.sweep if isinstance(m, (WorkerInput, WorkerInputs)) else None

