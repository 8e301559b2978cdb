"""Scheduling with TF2 ``ClusterCoordinator`` semantics, for both carriers.

``schedule`` puts a closure in a queue and returns a :class:`RemoteValue` at once; one
thread per worker takes closures as the worker becomes free and runs them through a
*runner* (the embedded carrier calls :meth:`PSWorker.run` in-process; the Ray carrier
calls a worker actor). Outcomes:

* success: the RemoteValue gets the outputs;
* :class:`ApplicationError` (the step raised): the RemoteValue gets the error, and the
  first one is re-raised by :meth:`Coordinator.join` (not retried, as in TF);
* a worker failure (:class:`WorkerLostError`, Ray's ``ActorDiedError``, any other
  exception of the carrier): the worker is marked dead and the closure goes back to the
  front of the queue with its id, so its push is applied at most once (the shards'
  ledgers drop a second push of the id as a duplicate); after ``max_attempts`` the
  step fails. A carrier that can replace the worker (Ray restarts a dead worker
  actor, ``max_restarts``) is asked to (``replace``); the replaced worker takes steps
  again;
* a lost shard (:class:`ShardClosedError` while not shutting down, or the Ray actor of a
  shard dead): :class:`ParameterServerError` for this and every pending step.

Bounded staleness (``max_staleness=tau``, Li et al., OSDI'14): the staleness of an
applied update is the number of updates applied between the worker's pull and the
application of its push; none may exceed tau. Every update a shard applies while a step
runs comes from a step that ran alongside it, so the coordinator counts, for each
running step, the steps that ran alongside it (``alongside``), and a worker waits
before starting a step while that would bring any running step's count above tau
(tau = 0: one step at a time, sequential). The shards drop a push staler than tau all
the same (``stale`` in the ledger), which only a step outliving its worker can cause.

Token-gated mode: a worker counts as waiting for a token only while it blocks on a queue
holding none it may take; when every running step does, none is queued and shard 0 has
no token to give, nothing can push the gradients the next step needs, and ``join``
cancels the waits (:class:`StepCancelledError`). A worker lost mid-push has its
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
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from jreplicate.ps.ledger import Ledger
from jreplicate.ps.remote import (
    ParameterServerError,
    RemoteValue,
    StepCancelledError,
    WorkerLostError,
)
from jreplicate.ps.shard import ShardClosedError
from jreplicate.ps.worker import ApplicationError, Closure
from jreplicate.ps.worker_input import InputEnded, WorkerInput

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, stops every coordinator's threads before Python finalises
    (a daemon thread inside a JAX call during finalisation aborts the process)."""
    for c in list(_LIVE):
        c.shutdown(wait=2.0)


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
      max_attempts: runs of one closure before its step fails.
      is_shard_failure: tells a shard's failure from a worker's (Ray's errors).
      replace: ``replace(w)`` after worker ``w`` was lost: True when the carrier replaced
        it (Ray restarted its actor), so ``w`` takes steps again; called on ``w``'s
        thread once its steps are ended (the lost step already rescheduled), and ``w``
        counts as coming back meanwhile (the steps wait for it rather than fail when no
        other worker is alive).
    """

    def __init__(self, runners: list[Callable], *, depth: int = 1,
                 max_staleness: int | None = None, max_attempts: int = 4,
                 is_shard_failure: Callable[[BaseException], bool] | None = None,
                 interrupt: Callable[[], None] | None = None,
                 on_worker_lost: Callable[[int], None] | None = None,
                 on_relax: Callable[[bool], None] | None = None,
                 settle: Callable[[int], None] | None = None,
                 starved: Callable[[], bool] | None = None,
                 replace: Callable[[int], bool] | None = None):
        self._runners = runners
        self._replace = replace
        self._replacing: set[int] = set()  # lost workers the carrier is replacing
        self.replaced = 0
        if depth > 1 and max_staleness is not None:
            raise ValueError("Coordinator(depth > 1): bounded staleness admits one step "
                             "per worker at a time.")
        self._depth = depth
        self._interrupt = interrupt or (lambda: None)
        self._on_worker_lost = on_worker_lost or (lambda alive: None)
        self._settle = settle or (lambda push_id: None)
        self._starved = starved or (lambda: True)
        # Token-gated: every running step waits for a token and nothing is queued, so
        # no other worker can push; on_relax(True) lets the waiters take a second token
        # of the current step (one gradient per worker and step is only a preference),
        # on_relax(False) restores that when new steps are scheduled.
        self._on_relax = on_relax or (lambda relax: None)
        self._relaxed = False
        self._tau = max_staleness
        self._max_attempts = max_attempts
        self._is_shard_failure = is_shard_failure or (lambda e: False)
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._values: dict[int, RemoteValue] = {}
        self._inflight: dict[int, tuple[int, Closure]] = {}  # step id -> worker, closure
        self._token_waiting: set[int] = set()
        self._alive = [True] * len(runners)
        self._alongside: dict[int, int] = {}  # step id -> steps it ran alongside
        self._idle: dict[int, int] = {}  # worker waiting for a step -> its ticket
        self._tickets = 0
        self.max_alongside = 0
        self._progress = 0  # token waits ended and steps finished
        self.rescheduled = 0
        self.scheduled = 0
        self.completed = 0
        self.completed_by = [0] * len(runners)
        # The ids of the steps that completed (each shard decided their pushes): what a
        # shard restarted from an older state may have lost (see shard_restart).
        self.completed_ids = Ledger()
        self.finish_times: list[list[float]] = [[] for _ in runners]
        self._first_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._stopping = False
        self._threads: list[threading.Thread | None] = [None] * len(runners)
        self._input_ended: dict[int, set[int]] = {}  # input key -> workers at its end
        self._input_exhausted: set[int] = set()  # input keys ended on every live worker
        self.not_run_end_of_input = 0
        _LIVE.add(self)
        with self._cond:
            self._start_threads()

    IDLE_EXIT = 5.0  # seconds a worker thread waits for work before it exits

    def _start_threads(self) -> None:
        """(Re)starts the thread of every live worker that has none (threads exit after
        ``IDLE_EXIT`` seconds without work, so an unused strategy holds no threads)."""
        for w, t in enumerate(self._threads):
            if self._alive[w] and (t is None or not t.is_alive()):
                t = threading.Thread(target=self._loop, args=(w,), daemon=True,
                                     name=f"jreplicate-ps-worker-{w}")
                self._threads[w] = t
                t.start()

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self, closure: Closure) -> RemoteValue:
        with self._cond:
            if self._fatal is not None:
                raise self._fatal
            if self._stopping:
                raise RuntimeError("ParameterServerStrategy was shut down; create a new one.")
            if not self._any_live():
                raise ParameterServerError(
                    "every worker of the ParameterServerStrategy is dead; nothing can run "
                    "the step. Restart the job (restore the last checkpoint).")
            key = _input_key(closure)
            if key in self._input_exhausted:
                raise StopIteration
            rv = RemoteValue(closure.step_id)
            self._values[closure.step_id] = rv
            self._queue.append(closure)
            self.scheduled += 1
            self._start_threads()
            self._cond.notify_all()
            restore, self._relaxed = self._relaxed, False
        if restore:
            self._on_relax(False)
        return rv

    #: Seconds every running step must wait for a token, none queued and no progress,
    #: before shard 0 is asked whether a token is there and, if none, join cancels (a
    #: token_timeout below it gives its own error first).
    STARVED_AFTER = 1.0
    #: The longest a wait on the condition lasts (every change notifies; a safety net).
    MAX_WAIT = 5.0

    def join(self, timeout: float | None = None) -> None:
        """Waits until every scheduled step finished; re-raises the first error.

        Raises:
          TimeoutError: ``timeout`` seconds passed with steps still pending.
          ParameterServerError: a shard was lost.
          StepCancelledError: steps wait for tokens no running step can produce.
        """
        end = None if timeout is None else time.monotonic() + timeout
        starved = [None, -1]  # since when every running step waits, at which progress
        with self._cond:
            while (self._queue or self._inflight) and self._fatal is None:
                if not self._any_live() and self._queue:
                    self._fail_all(ParameterServerError(
                        "every worker died; the remaining steps cannot run."))
                    break
                recheck = self._check_starved(starved)
                if self._fatal is not None:
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"join: {len(self._queue) + len(self._inflight)} "
                                       f"steps still pending after {timeout} s.")
                self._cond.wait(min(t for t in (recheck, left, self.MAX_WAIT)
                                    if t is not None))
            if self._fatal is not None:
                self._cond.release()
                try:
                    self._interrupt()  # wake token waits
                finally:
                    self._cond.acquire()
            grace = time.monotonic() + 60.0
            while self._inflight and self._fatal is not None and time.monotonic() < grace:
                self._cond.wait(min(grace - time.monotonic(), self.MAX_WAIT))
            err = self._fatal or self._first_error
            self._first_error = None
            if isinstance(self._fatal, StepCancelledError):
                self._fatal = None  # starved token waits: later steps may run again
        if err is not None:
            raise err

    @property
    def pending(self) -> int:
        """Steps scheduled and not finished (queued or running)."""
        with self._cond:
            return len(self._queue) + len(self._inflight)

    def _check_starved(self, starved: list) -> float | None:
        """Cancels the running steps if every one of them waits for a token, none is
        queued, nothing progressed for ``STARVED_AFTER`` seconds and shard 0 has no
        token to give. Returns when to look again (None: not waiting on tokens)."""
        if self._queue or not self._inflight or \
                not self._running_workers() <= self._token_waiting:
            starved[0] = None
            return None
        now = time.monotonic()
        if starved[0] is None or starved[1] != self._progress:
            starved[0], starved[1] = now, self._progress
            return self.STARVED_AFTER
        if now - starved[0] < self.STARVED_AFTER:
            return self.STARVED_AFTER - (now - starved[0])
        progress = self._progress
        self._cond.release()  # shard 0 is asked outside the coordinator's lock
        try:
            none_to_give = self._starved()
        finally:
            self._cond.acquire()
        if none_to_give and progress == self._progress and not self._queue and \
                self._inflight and self._running_workers() <= self._token_waiting:
            self._cancel_starved()
        starved[0] = None
        return self.STARVED_AFTER

    def _cancel_starved(self) -> None:
        """Every running step waits for a token and none is queued: nothing can push the
        gradients the next global step needs, so the waits are cancelled (a clear
        error now instead of a hang, or of a timeout later)."""
        steps = sorted(self._inflight)
        self._fatal = StepCancelledError(
            f"token-gated training cannot go on: steps {steps} wait for a token of the "
            "next global step, but no other step is scheduled or running to push the "
            "gradients that step needs. Schedule steps in multiples of the number of "
            "workers, or lower replicas_to_aggregate.")

    def shutdown(self, wait: float = 0.0) -> None:
        """Cancels queued steps and stops the threads (waiting up to ``wait`` seconds
        for running steps to end)."""
        with self._cond:
            self._stopping = True
            self._fail_queue(StepCancelledError("the strategy shut down before this step ran"))
            self._cond.notify_all()
            threads = [t for t in self._threads if t is not None]
        self._interrupt()
        end = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def kill(self, worker: int) -> None:
        with self._cond:
            self._alive[worker] = False
            self._cond.notify_all()

    @property
    def alive(self) -> list[bool]:
        return list(self._alive)

    # -- the worker threads ------------------------------------------------------------
    def _take(self, w: int, wait: bool = True) -> Closure | None:
        """The next closure ``w`` may run, marked running (None: stop, or none now when
        not ``wait``-ing)."""
        with self._cond:
            if not wait:
                i = self._runnable(w) if self._fatal is None and not self._stopping and \
                    self._alive[w] and self._tau is None else None
                if i is None:
                    return None
                c = self._queue[i]
                del self._queue[i]
                self._start(w, c)
                return c
            idle_since = time.monotonic()
            self._tickets += 1
            self._idle[w] = self._tickets
            try:
                while True:
                    if self._stopping or not self._alive[w]:
                        return None
                    i = self._runnable(w) if self._fatal is None else None
                    if i is not None:
                        idle_since = time.monotonic()
                        c = self._queue[i]
                        if self._may_start(w, c):
                            del self._queue[i]
                            self._start(w, c)
                            return c
                        self._cond.wait(self.MAX_WAIT)  # a finishing step notifies
                        continue
                    left = self.IDLE_EXIT - (time.monotonic() - idle_since)
                    if left <= 0:
                        self._threads[w] = None  # restarted by the next schedule
                        return None
                    self._cond.wait(left)
            finally:
                self._idle.pop(w, None)

    def _can_run(self, w: int, c: Closure) -> bool:
        """Whether ``w`` can run ``c``: not if ``c`` reads an input ended on ``w``."""
        key = _input_key(c)
        return key is None or w not in self._input_ended.get(key, ())

    def _runnable(self, w: int) -> int | None:
        """The queue position of the first closure ``w`` can run, or None."""
        for i, c in enumerate(self._queue):
            if self._can_run(w, c):
                return i
        return None

    def _may_start(self, w: int, c: Closure) -> bool:
        """Bounded staleness: starting a step on ``w`` keeps every running step's count
        of steps alongside it (the bound on its staleness) at most tau; idle workers
        (that can run ``c``) start in the order they became idle."""
        if self._tau is None:
            return True
        if self._idle[w] != min(t for v, t in self._idle.items() if self._can_run(v, c)):
            return False  # first come, first served: a finishing worker does not hog
        running = [i for i, (v, _) in self._inflight.items() if v != w]
        return len(running) <= self._tau and \
            all(self._alongside[i] < self._tau for i in running)

    def _start(self, w: int, c: Closure) -> None:
        for i in self._inflight:
            self._alongside[i] += 1
            self.max_alongside = max(self.max_alongside, self._alongside[i])
        self._alongside[c.step_id] = len(self._inflight)
        self.max_alongside = max(self.max_alongside, self._alongside[c.step_id])
        self._inflight[c.step_id] = (w, c)

    def _stop(self, c: Closure) -> None:
        self._inflight.pop(c.step_id, None)
        self._alongside.pop(c.step_id, None)

    def _running_workers(self) -> set[int]:
        return {w for w, _ in self._inflight.values()}

    def _token_wait(self, w: int, waiting: bool) -> None:
        with self._cond:
            (self._token_waiting.add if waiting else self._token_waiting.discard)(w)
            self._progress += 1
            self._cond.notify_all()
        self._maybe_relax()

    def _maybe_relax(self) -> None:
        with self._cond:
            stuck = not self._queue and bool(self._inflight) and \
                self._running_workers() <= self._token_waiting and not self._relaxed
            if stuck:
                self._relaxed = True
        if stuck:
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
                    lost = False
                    continue
                return
            c, wait = started.popleft()
            lost = self._end(w, c, wait, lost) or lost

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
        except InputEnded:
            self._end_of_input(w, c)
        except ApplicationError as e:
            self._finish(w, c, error=e.error)
        except StepCancelledError as e:
            self._finish(w, c, error=self._fatal or e)
        except ShardClosedError as e:
            self._finish(w, c, error=e if self._stopping else self._shard_lost(e))
        except BaseException as e:  # a worker failure: retry elsewhere
            if self._is_shard_failure(e):
                self._finish(w, c, error=self._shard_lost(e))
            elif lost:
                self._not_run(c, e)
            else:
                self._worker_lost(w, c, e)
                return True
        else:
            self._values[c.step_id].worker = w
            self._finish(w, c, value=out)
        return False

    def _finish(self, w: int, c: Closure, value: Any = None,
                error: BaseException | None = None) -> None:
        with self._cond:
            self._stop(c)
            self._progress += 1
            rv = self._values.pop(c.step_id)
            if error is None:
                self.completed += 1
                self.completed_ids.record(c.step_id, "applied")
                self.completed_by[w] += 1
                self.finish_times[w].append(time.monotonic())
            elif self._first_error is None and self._fatal is None:
                self._first_error = error
            rv._set(value, error)
            self._cond.notify_all()
        self._maybe_relax()

    def _end_of_input(self, w: int, c: Closure) -> None:
        """``w``'s pipeline of ``c``'s input is exhausted: ``c`` goes back to the front
        of the queue (this run uncounted) for a worker that still has input."""
        with self._cond:
            self._stop(c)
            self._progress += 1
            self._values[c.step_id].attempts -= 1
            self._input_ended.setdefault(_input_key(c), set()).add(w)
            self._queue.appendleft(c)
            self._end_exhausted_inputs()
            self._cond.notify_all()

    def _end_exhausted_inputs(self) -> None:
        """Inputs ended on every live worker: their queued steps end with
        StopIteration (not run; no error for join)."""
        for key, ended in self._input_ended.items():
            if key in self._input_exhausted or not all(
                    v in ended for v, alive in enumerate(self._alive) if alive):
                continue
            self._input_exhausted.add(key)
            keep = collections.deque()
            for c in self._queue:
                if _input_key(c) != key:
                    keep.append(c)
                    continue
                self.not_run_end_of_input += 1
                self._values.pop(c.step_id)._set(error=StopIteration(
                    f"step {c.step_id} was not run: every worker's input pipeline is "
                    "exhausted"))
            self._queue = keep

    def input_exhausted(self, key: int) -> bool:
        """Whether input ``key`` is exhausted on every live worker."""
        with self._cond:
            return key in self._input_exhausted

    def resume(self) -> None:
        """Training goes on after a lost shard was restarted: the loss no longer stops
        new steps (nothing may be pending)."""
        with self._cond:
            if self._queue or self._inflight:
                raise RuntimeError("resume: steps are pending; join first.")
            self._fatal = None
            self._first_error = None
            self._cond.notify_all()

    def reset_input(self, key: int) -> None:
        """Input ``key`` was restarted (``reinitialize``): every worker may read it."""
        with self._cond:
            self._input_ended.pop(key, None)
            self._input_exhausted.discard(key)
            self._start_threads()
            self._cond.notify_all()

    def _shard_lost(self, e: BaseException) -> ParameterServerError:
        with self._cond:
            if self._fatal is None:
                self._fatal = ParameterServerError(
                    f"a parameter-server shard failed ({type(e).__name__}: {e}); the "
                    "parameters it held are gone, so training stops. Restore the last "
                    "checkpoint (strategy.restore(...)), or restart the lost shard from "
                    "it (strategy.restart_shard(i, state)).")
                self._fatal.__cause__ = e
                self._fail_queue(self._fatal)
            self._cond.notify_all()
            return self._fatal

    def _worker_lost(self, w: int, c: Closure, e: BaseException) -> None:
        # Its push, if shard 0 decided it, is committed on the other shards first (the
        # rerun's push is then a duplicate everywhere); a lost shard shows up on the next
        # push or pull.
        for call in (lambda: self._settle(c.step_id),
                     lambda: self._on_worker_lost(sum(self._alive) - self._alive[w])):
            try:
                call()
            except Exception:
                pass
        with self._cond:
            self._alive[w] = False
            if self._replace is not None and not self._stopping:
                self._replacing.add(w)
            self._stop(c)
            rv = self._values[c.step_id]
            if rv.attempts >= self._max_attempts:
                self._values.pop(c.step_id)
                err = WorkerLostError(f"step {c.step_id} failed on {rv.attempts} workers; "
                                      f"the last error: {type(e).__name__}: {e}")
                self._first_error = self._first_error or err
                rv._set(error=err)
            elif not self._any_live():
                self._values.pop(c.step_id)
                rv._set(error=ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
                self._first_error = self._first_error or rv._error
                self._fail_queue(ParameterServerError("every worker died"))
            else:
                self.rescheduled += 1
                self._queue.appendleft(c)
            self._end_exhausted_inputs()  # the dead worker's input no longer counts
            self._cond.notify_all()

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
        if not self._stopping:
            try:
                ok = bool(self._replace(w))
            except Exception:  # the carrier could not: the worker stays lost
                ok = False
        with self._cond:
            self._replacing.discard(w)
            if ok and not self._stopping:
                self._alive[w] = True
                self.replaced += 1
            elif not self._any_live() and self._queue:
                self._fail_all(ParameterServerError(
                    f"every worker died (worker {w} could not be replaced)"))
            self._end_exhausted_inputs()
            self._cond.notify_all()
            alive, n = self._alive[w], sum(self._alive)
        if alive:
            try:
                self._on_worker_lost(n)  # the shards count it again
            except Exception:
                pass
        return alive

    def _not_run(self, c: Closure, e: BaseException) -> None:
        """``c`` was started on a worker after a step that the worker was lost in: it
        never ran there (a worker runs its steps in order), so it goes back to the queue
        (behind the lost step) without counting as an attempt."""
        with self._cond:
            self._stop(c)
            rv = self._values[c.step_id]
            rv.attempts -= 1
            if not self._any_live():
                self._values.pop(c.step_id)
                rv._set(error=ParameterServerError(
                    f"every worker died (the last: {type(e).__name__}: {e})"))
                self._first_error = self._first_error or rv._error
            else:
                self.rescheduled += 1
                self._queue.insert(min(1, len(self._queue)), c)
            self._cond.notify_all()

    def _fail_queue(self, error: BaseException) -> None:
        while self._queue:
            c = self._queue.popleft()
            rv = self._values.pop(c.step_id, None)
            if rv is not None:
                rv._set(error=error)

    def _fail_all(self, error: BaseException) -> None:
        self._first_error = self._first_error or error
        self._fail_queue(error)


def _input_key(c: Closure) -> int | None:
    """The key of the per-worker input ``c`` reads, or None (no input, or driver-fed)."""
    return c.batch.key if isinstance(c.batch, WorkerInput) else None
