"""Scheduling with TF2 ``ClusterCoordinator`` semantics, for both carriers.

``schedule`` puts a closure in a :class:`~jreplicate.ps.closure_queue.ClosureQueue` and
returns a :class:`RemoteValue` at once; one thread per worker takes closures as the
worker becomes free, starts them on it through the carrier
(:class:`~jreplicate.ps.handle.StepCarrier`: the embedded carrier calls
:meth:`PSWorker.run` in-process, the Ray carrier a worker actor) and ends each by the
outcome of its run (:mod:`jreplicate.ps.outcome`; how each outcome ends a step is
:class:`~jreplicate.ps.step_ends.StepEnds`'s): a step's own error stops training as
TF's ``mark_failed``, a lost worker's step runs again elsewhere (its push applied at
most once: the shards' ledgers drop a second push of its id), a lost shard fails every
pending step. A carrier that can replace a lost worker (Ray restarts a dead worker
actor, ``max_restarts``; the embedded carrier makes a new worker with its index,
``max_worker_restarts``) is asked to; the replaced worker takes steps again, on a new
thread.

A step that ends for good without pushing (its function raised, its token wait was
cancelled, it was not run: cancelled at shutdown, given up, or at the end of its input)
is *skipped* on every shard (``carrier.skip``: each ledger decides its id without a
push, so the ledgers' watermarks move past it; a no-op where a shard decided it) and
recorded in :attr:`Coordinator.skipped`. A step re-queued (a lost worker's, or one
handed back at the end of a worker's input) keeps its id and is not skipped: it may
still push.

A worker lost in a step may have pushed to some shards only (asynchronous mode pushes to
each shard on its own). The coordinator asks the shards (``carrier.decided``) which
decided the id; a step that then ends for good (``max_attempts``, shutdown, ...) with
its push on some shards and not on others fails with :class:`ParameterServerError`
naming the step and the shards, and training stops (the shards disagree: restore the
last checkpoint); :attr:`Coordinator.half_applied` keeps them, so that ``state()``
refuses to save them. A worker lost mid-push has its decided push committed on the
other shards (``carrier.settle``) before its step runs again.

Bounded staleness (``max_staleness=tau``): a worker starts a step only while the
:class:`~jreplicate.ps.admission.StalenessGate` admits it. The shards drop a push staler
than tau all the same (``stale`` in the ledger), which only a step outliving its worker
can cause. Stale-synchronous parallel (``max_clock_lead=s``): the
:class:`~jreplicate.ps.admission.ClockGate` admits a worker only while its clock (steps
ended on it) is at most s ahead of the slowest live worker's; a lost worker leaves the
minimum, a replaced one rejoins at the slowest live clock.

Token-gated mode: when every running step waits for a token, none is queued and shard 0
has none to give, ``join`` cancels the waits (:class:`StepCancelledError`; see
:class:`~jreplicate.ps.admission.StarvationDetector`).

Input read on the workers (``PER_WORKER``, :mod:`jreplicate.ps.worker_input`): a worker
whose pipeline of an iterator is exhausted hands its step back, uncounted, and takes no
more steps of that iterator; once every live worker's is, the queued steps of that
iterator end with ``StopIteration`` (not run, not an error for ``join``) and scheduling
another raises ``StopIteration`` (:mod:`jreplicate.ps.input_sweeps`).
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable

from jreplicate.ps.admission import CoordinatorStats
from jreplicate.ps.closure import Closure
from jreplicate.ps.closure_queue import ClosureQueue
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.fate.record import StepRecord
from jreplicate.ps.handle import StepCarrier
from jreplicate.ps.input_sweeps import InputSweeps, input_sweep
from jreplicate.ps.outcome import Outcome, from_error
from jreplicate.ps.remote import ParameterServerError, RemoteValue, StepCancelledError
from jreplicate.ps.scheduler import Scheduler
from jreplicate.ps.step_ends import StepEnds

_log = logging.getLogger("jreplicate")

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, stops every coordinator's threads before Python finalises
    (a daemon thread inside a JAX call during finalisation aborts the process)."""
    for c in list(_LIVE):
        c.shutdown(wait=2.0)


class Coordinator:
    """Runs closures on the workers of ``carrier`` (:class:`StepCarrier`): one thread per
    worker starts steps (``carrier.start``) and ends each by its outcome
    (:mod:`jreplicate.ps.outcome`, :class:`StepEnds`).

    Args:
      carrier: the workers and the shard calls a step's end needs (a lost worker's push
        settled and its fate asked, a step skipped, old ids forgotten, token waits
        interrupted, a lost worker replaced; see :class:`StepCarrier`).
      depth: steps in flight per worker (> 1: the next steps are started while the
        worker runs one, so that it never waits for the coordinator; asynchronous
        unbounded training only). A worker runs its steps in the order started, so
        when it is lost, the steps started after the lost one never ran: they go back
        to the queue without counting as an attempt.
      max_staleness: the bounded delay tau, or None (fully asynchronous).
      max_clock_lead: stale-synchronous parallel's s, or None (exclusive with
        ``max_staleness``).
      max_attempts: runs of one closure before its step fails.
      record: the record of the steps before the first one this coordinator runs (a
        restored state's: :meth:`StepRecord.from_arrays`); default: a new job's.
    """

    #: Seconds every running step must wait for a token, none queued and no progress,
    #: before shard 0 is asked whether a token is there and, if none, join cancels (a
    #: token_timeout below it gives its own error first).
    STARVED_AFTER = 1.0
    IDLE_EXIT = 5.0  # seconds a worker thread waits for work before it exits

    def __init__(self, carrier: StepCarrier, *, depth: int = 1,
                 max_staleness: int | None = None, max_clock_lead: int | None = None,
                 max_attempts: int = 4, record: StepRecord | None = None):
        if depth > 1 and (max_staleness is not None or max_clock_lead is not None):
            raise ValueError("Coordinator(depth > 1): bounded staleness admits one step "
                             "per worker at a time.")
        if max_staleness is not None and max_clock_lead is not None:
            raise ValueError("Coordinator: pass max_staleness (bounded delay) or "
                             "max_clock_lead (stale-synchronous), not both.")
        n = carrier.num_workers
        self._carrier = carrier
        self._depth = depth
        # The scheduling state (queue, in flight, admission, starvation) is the pure
        # Scheduler's; the queue's lock guards it, and the worker threads drive it.
        self._sched = Scheduler(n, max_staleness=max_staleness,
                                max_clock_lead=max_clock_lead,
                                starved_after=self.STARVED_AFTER)
        self._stats, self._gate = self._sched.stats, self._sched.gate
        self._starvation = self._sched.starvation
        self._queue = ClosureQueue(self._sched)
        self._threads: list[threading.Thread | None] = [None] * n
        #: The sweeps of the per-worker inputs ended on which workers (under the lock).
        self.sweeps = InputSweeps()
        #: The record of ended steps (completed, skipped, half applied) and of the
        #: job's history: see :mod:`jreplicate.ps.fate.record`.
        self.record = record if record is not None else StepRecord()
        self._ends = StepEnds(self._queue, carrier, self.record, self.sweeps, self._stats,
                              self._gate, self._starvation, max_attempts=max_attempts,
                              relax=lambda: self._maybe_relax())
        # (The same objects as the ends': the scheduling reads them.)
        self._values, self._alive = self._ends.values, self._ends.alive
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
        q, ends = self._queue, self._ends
        with q.lock:
            if q.error is not None:
                raise q.error
            if ends.stopped_by_error:
                ends.raise_stopping_error()
            if q.stopped:
                raise RuntimeError("ParameterServerStrategy was shut down; create a new one.")
            if not ends.any_live():
                raise ParameterServerError(
                    "every worker of the ParameterServerStrategy is dead; nothing can run "
                    "the step. Restart the job (restore the last checkpoint).")
            if self.sweeps.exhausted(input_sweep(closure)):
                raise StopIteration
            rv = RemoteValue(closure.step_id)
            self._values[closure.step_id] = rv
            restore = q.put(closure)  # new steps: token-gated relaxation undone
            self._stats.count("scheduled")
            self._start_threads()
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
        q, ends = self._queue, self._ends
        with q.lock:
            self._starvation.asked()  # a new join looks at starvation afresh
            while q.pending and q.error is None:
                if not ends.any_live() and q.queued:
                    ends.fail_all(ParameterServerError(
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
                    self._carrier.interrupt()  # wake token waits
                finally:
                    q.lock.acquire()
                q.wait_inflight(60.0)
            if fatal is None and ends.stopped_by_error:
                ends.raise_stopping_error()
            err = fatal or ends.first_error
            ends.first_error = None
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
        q, sched = self._queue, self._sched
        due = sched.starvation_due(time.monotonic())
        if due is None or due > 0:
            return due
        progress = sched.starvation.progress
        q.lock.release()  # shard 0 is asked outside the coordinator's lock
        try:
            none_to_give = self._carrier.starved()
        finally:
            q.lock.acquire()
        if sched.starved(progress, none_to_give):
            q.mark_failed(StepCancelledError(
                f"token-gated training cannot go on: steps {sorted(q.running())} wait "
                "for a token of the next global step, but no other step is scheduled or "
                "running to push the gradients that step needs. Schedule steps in "
                "multiples of the number of workers, or lower replicas_to_aggregate."))
        return sched.starvation.grace

    def shutdown(self, wait: float = 0.0) -> None:
        """Cancels queued steps and stops the threads (waiting up to ``wait`` seconds
        for running steps to end)."""
        with self._queue.lock:
            self._ends.fail(self._queue.stop(),
                            StepCancelledError("the strategy shut down before this step ran"))
            threads = [t for t in self._threads if t is not None]
        self._carrier.interrupt()
        end = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    @property
    def alive(self) -> list[bool]:
        return list(self._alive)

    def resume(self) -> None:
        """Training goes on after a lost shard was restarted: the loss no longer stops
        new steps (nothing may be pending)."""
        with self._queue.lock:
            if self._queue.pending:
                raise RuntimeError("resume: steps are pending; join first.")
            self._ends.first_error = None
            self._queue.clear_error()

    def reset_input(self, key: int, generation: int) -> None:
        """Input ``key`` was restarted (``reinitialize``) for its sweep ``generation``:
        every worker may read it (the sweep's ends are counted afresh)."""
        with self._queue.lock:
            self.sweeps.reset((key, generation))
            self._start_threads()
            self._queue.notify_takers()

    # -- the worker threads ------------------------------------------------------------
    def _take(self, w: int, wait: bool = True) -> Closure | None:
        """The next closure ``w`` may run, marked running (None: stop, or none now when
        not ``wait``-ing)."""
        q = self._queue
        with q.lock:  # Scheduler.take, waited for (admission and all)
            c = q.get(w, self._can_run, stop=lambda: not self._alive[w],
                      idle_timeout=self.IDLE_EXIT if wait else 0)
            if c is None and wait and self._alive[w] and not q.stopped:
                self._threads[w] = None  # idle: restarted by the next schedule
            return c

    def _can_run(self, w: int, c: Closure) -> bool:
        """Whether ``w`` can run ``c``: not if ``c`` reads an input sweep ended on ``w``."""
        return self.sweeps.can_run(w, input_sweep(c))

    def _token_wait(self, w: int, waiting: bool) -> None:
        with self._queue.lock:
            relax = self._sched.token_wait(w, waiting)
            self._queue.notify_waiters()  # join's starvation check
        if relax:
            self._on_relax(True)

    def _maybe_relax(self) -> None:
        with self._queue.lock:
            relax = self._sched.maybe_relax()
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
                if lost and self._ends.revive(w):
                    with self._queue.lock:  # a new thread runs the replaced worker
                        self._threads[w] = None
                        self._start_threads()
                return
            c, wait = started.popleft()
            lost = self._end(w, c, wait, lost) or lost
            # Not kept while this thread waits for the next step: a finished step's
            # function and outputs are freed when the caller lets them go.
            c = wait = None

    def _begin(self, w: int, c: Closure) -> Callable[[], Outcome]:
        """Starts ``c`` on ``w`` (one more attempt); returns the wait for its outcome."""
        rv = self._values[c.step_id]
        rv.attempts += 1
        c.attempt = rv.attempts
        try:
            return self._carrier.start(
                w, c, lambda waiting, w=w: self._token_wait(w, waiting))
        except BaseException as e:  # noqa: BLE001 - broad on purpose: a carrier that
            # raised instead of starting ends the step as that error's outcome; raised
            # here it would end this worker's thread with the step never ended
            return functools.partial(from_error, e)

    def _end(self, w: int, c: Closure, wait: Callable[[], Outcome], lost: bool) -> bool:
        """Waits for ``c``'s run on ``w`` and ends it by its outcome; True: ``w`` was
        lost (``lost``: it was lost before, so ``c`` never ran there)."""
        try:
            outcome = wait()
        except BaseException as e:  # noqa: BLE001 - broad on purpose: a carrier's wait
            # returns an outcome; one that raised instead is ended as its error's
            _log.warning("parameter server: worker %d's wait for step %d raised instead of "
                         "returning an outcome", w, c.step_id, exc_info=True)
            outcome = from_error(e)
        return self._ends.by_outcome(w, c, outcome, lost)

    def _on_relax(self, relax: bool) -> None:
        """Token-gated: with ``relax``, every running step waits for a token and nothing
        is queued, so shard 0 lets the waiters take a second token of the current step
        (as if no worker were alive); without, new steps came: the live count again."""
        self._carrier.workers_alive(0 if relax else sum(self._alive))
