"""The closures waiting to run and those running: TensorFlow's ``_CoordinatedClosureQueue``.

The thread-side shell of the pure :class:`~jreplicate.ps.scheduler.Scheduler` (which
owns the queue, the closures in flight, the admission gate and starvation): one lock and
a NAMED condition per predicate a thread waits on, notified exactly where that predicate
can change, so no wait polls. The shape of
``tensorflow/python/distribute/coordinator/cluster_coordinator.py``'s queue: ``put`` /
``get`` / ``put_back`` / ``mark_finished`` / ``mark_failed`` / ``wait``.

* ``_can_take`` (``get``): a closure the taker may run is queued, or it must stop.
  Notified by ``put``, ``put_back``, a closure leaving flight (an admission gate may
  open), ``stop``, ``clear_error`` and :meth:`notify_takers` (the owner's own state
  changed: a worker lost or back, an input restarted, an idle taker left).
* ``_settled`` (``wait``, ``wait_for_change``, ``wait_inflight``): nothing is queued or
  in flight, an error is set, or the owner's view changed (:meth:`notify_waiters`:
  workers lost, token waits). Notified by every change of the queued or in-flight
  closures and by ``mark_failed`` / ``stop``.

The lock is reentrant and public (``lock``): the owner (the :class:`Coordinator`) takes
it to read and change its own state and the scheduler's (``sched``) in the same critical
section as the queue's, and calls the queue's methods while holding it. Each method also
takes it itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jreplicate.ps.scheduler import HELD, Scheduler

if TYPE_CHECKING:
    from jreplicate.ps.closure import Closure


class ClosureQueue:
    """Closures queued and in flight (taken by a worker, not yet finished).

    Args:
      sched: the scheduler whose state this queue guards (default: a new one with no
        admission bound).

    >>> from jreplicate.ps.scheduler import Step
    >>> q = ClosureQueue()
    >>> for i in range(2):
    ...     _ = q.put(Step(i))
    >>> c = q.get(worker=0)
    >>> c.step_id, q.pending, q.running()
    (0, 2, {0: 0})
    >>> q.mark_finished(c)
    >>> q.pending, q.wait(timeout=0.01)
    (1, False)
    """

    def __init__(self, sched: Scheduler | None = None):
        self.sched = sched if sched is not None else Scheduler(0)
        self.lock = threading.RLock()
        self._can_take = threading.Condition(self.lock)
        self._settled = threading.Condition(self.lock)

    # -- the state (read under the lock for a consistent view) --------------------------
    @property
    def error(self) -> BaseException | None:
        """The error that stopped the queue (``mark_failed``), after which no closure is
        taken."""
        return self.sched.error

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (for good)."""
        return self.sched.stopped

    @property
    def queued(self) -> int:
        return self.sched.queued

    @property
    def inflight(self) -> int:
        return self.sched.inflight

    @property
    def pending(self) -> int:
        """Closures queued or in flight."""
        with self.lock:
            return self.sched.pending

    def running(self) -> dict[int, int]:
        """``{step id: worker}`` of the closures in flight."""
        with self.lock:
            return self.sched.running()

    def in_flight(self) -> list[Closure]:
        """The closures in flight."""
        with self.lock:
            return self.sched.in_flight()

    def running_workers(self) -> set[int]:
        with self.lock:
            return self.sched.running_workers()

    # -- producers ----------------------------------------------------------------------
    def put(self, c: Closure) -> bool:
        """Queues ``c`` at the back; returns :meth:`Scheduler.submit`'s answer (True:
        token-gated relaxation is to be undone)."""
        with self.lock:
            unrelax = self.sched.submit(c)
            self._changed()
            return unrelax

    def put_back(self, c: Closure, position: int = 0) -> None:
        """``c`` (in flight, or not) goes back into the queue at ``position`` (0: the
        front, to run next)."""
        with self.lock:
            self.sched.put_back(c, position)
            self._changed()

    # -- consumers ----------------------------------------------------------------------
    def get(self, worker: int, can_run: Callable[[int, Any], bool] | None = None, *,
            stop: Callable[[], bool] = lambda: False,
            idle_timeout: float | None = None) -> Closure | None:
        """Takes the first queued closure ``worker`` can run (``can_run(worker, c)``),
        once the scheduler's admission gate lets ``worker`` start it
        (:meth:`Scheduler.take`), and marks it in flight on ``worker``.

        Returns None when the queue is stopped, ``stop()`` is true, or no closure
        ``worker`` can run was queued for ``idle_timeout`` seconds (0: do not block).
        While an error is set nothing is runnable. A closure that is runnable but not
        admitted is waited for without a timeout: the gate opens only when something
        notifies ``_can_take``.
        """
        with self.lock:
            self.sched.arrive(worker)
            try:
                return self._get(worker, can_run, stop, idle_timeout)
            finally:
                self.sched.leave(worker)
                if self.sched.gate.bounded:
                    self._can_take.notify_all()  # the next idle worker may be first now

    def _get(self, worker: int, can_run: Callable[[int, Any], bool] | None,
             stop: Callable[[], bool], idle_timeout: float | None) -> Closure | None:
        idle_since = time.monotonic()
        while True:
            if stop():
                return None
            took = self.sched.take(worker, can_run)
            if took.closure is not None:
                return took.closure
            if took.why == HELD:  # runnable, not admitted: the worker is not idle
                idle_since = time.monotonic()
                if idle_timeout is not None and idle_timeout <= 0:
                    return None
                self._can_take.wait()
                continue
            if self.sched.stopped:
                return None
            left = None if idle_timeout is None else \
                idle_timeout - (time.monotonic() - idle_since)
            if left is not None and left <= 0:
                return None
            self._can_take.wait(left)

    def mark_finished(self, c: Closure) -> None:
        """``c`` left flight (done, failed or given up on)."""
        with self.lock:
            self.sched.drop(c)
            self._changed()

    def finish(self, worker: int, c: Closure) -> None:
        """``c`` ended on ``worker`` (:meth:`Scheduler.finish`: its clock moves on)."""
        with self.lock:
            self.sched.finish(worker, c)
            self._changed()

    # -- errors and the end -------------------------------------------------------------
    def mark_failed(self, error: BaseException) -> list[Closure]:
        """Stops the queue with ``error`` (unless one is set already: the first stays)
        and returns the queued closures, removed (the caller fails them). Closures in
        flight stay: :meth:`wait` and the owner see them end."""
        with self.lock:
            if self.sched.error is not None:
                return []
            out = self.sched.fail(error)
            self._changed()  # nothing is runnable now; join's wait ends
            return out

    def clear_error(self) -> None:
        """The queue takes closures again after :meth:`mark_failed`."""
        with self.lock:
            self.sched.clear_error()
            self._can_take.notify_all()

    def drain(self) -> list[Closure]:
        """Removes and returns every queued closure."""
        return self.remove_where(lambda c: True)

    def remove_where(self, pred: Callable[[Closure], bool]) -> list[Closure]:
        """Removes and returns the queued closures ``pred`` accepts, in queue order."""
        with self.lock:
            out = self.sched.remove_where(pred)
            if out:
                self._settled.notify_all()
            return out

    def stop(self) -> list[Closure]:
        """Stops the queue for good: every ``get`` returns None. Returns the queued
        closures, removed."""
        with self.lock:
            out = self.sched.stop()
            self._changed()
            return out

    # -- waiting ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or in flight or an error is set (True), or
        ``timeout`` seconds pass (False)."""
        return self._wait_until(lambda: self.sched.settled, timeout)

    def wait_for_change(self, timeout: float | None = None) -> bool:
        """One wait on ``_settled``: returns once the queue is settled (True), or on the
        next change of the queue or :meth:`notify_waiters`, or after ``timeout`` seconds
        (False when still unsettled). For an owner whose wait loop reads state of its
        own (the coordinator's starvation check)."""
        with self.lock:
            if not self.sched.settled:
                self._settled.wait(timeout)
            return self.sched.settled

    def wait_inflight(self, timeout: float | None) -> bool:
        """Blocks until nothing is in flight (True) or ``timeout`` seconds pass."""
        return self._wait_until(lambda: not self.sched.inflight, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not done():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def _changed(self) -> None:
        """The queued or in-flight closures (or the error, or the end) changed: both
        predicates may have turned."""
        self._can_take.notify_all()
        self._settled.notify_all()

    def notify_takers(self) -> None:
        """The owner's state that ``get``'s predicates read changed."""
        with self.lock:
            self._can_take.notify_all()

    def notify_waiters(self) -> None:
        """The owner's state that its ``wait`` loop reads changed."""
        with self.lock:
            self._settled.notify_all()
