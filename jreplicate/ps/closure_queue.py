"""The closures waiting to run and those running: TensorFlow's ``_CoordinatedClosureQueue``.

The shape of ``tensorflow/python/distribute/coordinator/cluster_coordinator.py``'s queue:
``put`` / ``get`` / ``put_back`` / ``mark_finished`` / ``mark_failed`` / ``wait``, with
one lock and a NAMED condition per predicate a thread waits on, notified exactly where
that predicate can change, so no wait polls:

* ``_can_take`` (``get``): a closure the taker may run is queued, or it must stop.
  Notified by ``put``, ``put_back``, a closure leaving flight (an admission gate may
  open), ``stop``, ``clear_error`` and :meth:`notify_takers` (the owner's own state
  changed: a worker lost or back, an input restarted, an idle taker left).
* ``_settled`` (``wait``, ``wait_for_change``, ``wait_inflight``): nothing is queued or
  in flight, an error is set, or the owner's view changed (:meth:`notify_waiters`:
  workers lost, token waits). Notified by every change of the queued or in-flight
  closures and by ``mark_failed`` / ``stop``.

The lock is reentrant and public (``lock``): the owner (the :class:`Coordinator`) takes
it to read and change its own state in the same critical section as the queue's, and
calls the queue's methods while holding it. Each method also takes it itself.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jreplicate.ps.closure import Closure


def _nothing(c: Closure) -> None:
    del c


class ClosureQueue:
    """Closures queued and in flight (taken by a worker, not yet finished).

    Args:
      on_start: called (under the lock) with a closure as a worker takes it, before it
        counts as in flight: an admission gate's bookkeeping.
      on_stop: called (under the lock) with a closure as it leaves flight.

    >>> from jreplicate.ps.closure import Closure
    >>> q = ClosureQueue()
    >>> for i in range(2):
    ...     q.put(Closure(i, None, False, None, (), 0, None))
    >>> c = q.get(worker=0, runnable=lambda c: True)
    >>> c.step_id, q.pending, q.running()
    (0, 2, {0: 0})
    >>> q.mark_finished(c)
    >>> q.pending, q.wait(timeout=0.01)
    (1, False)
    """

    def __init__(self, on_start: Callable[[Closure], None] = _nothing,
                 on_stop: Callable[[Closure], None] = _nothing):
        self.lock = threading.RLock()
        self._can_take = threading.Condition(self.lock)
        self._settled = threading.Condition(self.lock)
        self._on_start = on_start
        self._on_stop = on_stop
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight: dict[int, tuple[int, Closure]] = {}  # step id -> worker, closure
        self._error: BaseException | None = None
        self._stopped = False

    # -- the state (read under the lock for a consistent view) --------------------------
    @property
    def error(self) -> BaseException | None:
        """The error that stopped the queue (``mark_failed``), after which no closure is
        taken."""
        return self._error

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called (for good)."""
        return self._stopped

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def pending(self) -> int:
        """Closures queued or in flight."""
        with self.lock:
            return len(self._queue) + len(self._inflight)

    def running(self) -> dict[int, int]:
        """``{step id: worker}`` of the closures in flight."""
        with self.lock:
            return {i: w for i, (w, _) in self._inflight.items()}

    def in_flight(self) -> list[Closure]:
        """The closures in flight."""
        with self.lock:
            return [c for _, c in self._inflight.values()]

    def running_workers(self) -> set[int]:
        with self.lock:
            return {w for w, _ in self._inflight.values()}

    # -- producers ----------------------------------------------------------------------
    def put(self, c: Closure) -> None:
        """Queues ``c`` at the back."""
        with self.lock:
            self._queue.append(c)
            self._can_take.notify_all()
            self._settled.notify_all()

    def put_back(self, c: Closure, position: int = 0) -> None:
        """``c`` (in flight, or not) goes back into the queue at ``position`` (0: the
        front, to run next)."""
        with self.lock:
            self._leave_flight(c)
            self._queue.insert(min(position, len(self._queue)), c)
            self._can_take.notify_all()
            self._settled.notify_all()

    # -- consumers ----------------------------------------------------------------------
    def get(self, worker: int, runnable: Callable[[Closure], bool], *,
            admit: Callable[[Closure], bool] = lambda c: True,
            stop: Callable[[], bool] = lambda: False,
            idle_timeout: float | None = None) -> Closure | None:
        """Takes the first queued closure ``runnable`` accepts, once ``admit`` lets
        ``worker`` start it, and marks it in flight on ``worker``.

        Returns None when the queue is stopped, ``stop()`` is true, or no runnable closure
        was queued for ``idle_timeout`` seconds (0: do not block). While an error is set
        nothing is runnable. A closure that is runnable but not admitted is waited for
        without a timeout: the gate opens only when something notifies ``_can_take``.
        """
        with self.lock:
            idle_since = time.monotonic()
            while True:
                if self._stopped or stop():
                    return None
                i = self._first(runnable) if self._error is None else None
                if i is not None:
                    idle_since = time.monotonic()
                    c = self._queue[i]
                    if admit(c):
                        del self._queue[i]
                        self._on_start(c)
                        self._inflight[c.step_id] = (worker, c)
                        return c
                    if idle_timeout is not None and idle_timeout <= 0:
                        return None
                    self._can_take.wait()
                    continue
                left = None if idle_timeout is None else \
                    idle_timeout - (time.monotonic() - idle_since)
                if left is not None and left <= 0:
                    return None
                self._can_take.wait(left)

    def _first(self, runnable: Callable[[Closure], bool]) -> int | None:
        for i, c in enumerate(self._queue):
            if runnable(c):
                return i
        return None

    def mark_finished(self, c: Closure) -> None:
        """``c`` left flight (done, failed or given up on)."""
        with self.lock:
            self._leave_flight(c)
            self._can_take.notify_all()
            self._settled.notify_all()

    def _leave_flight(self, c: Closure) -> None:
        if self._inflight.pop(c.step_id, None) is not None:
            self._on_stop(c)

    # -- errors and the end -------------------------------------------------------------
    def mark_failed(self, error: BaseException) -> list[Closure]:
        """Stops the queue with ``error`` (unless one is set already: the first stays)
        and returns the queued closures, removed (the caller fails them). Closures in
        flight stay: :meth:`wait` and the owner see them end."""
        with self.lock:
            if self._error is not None:
                return []
            self._error = error
            self._can_take.notify_all()  # nothing is runnable now
            self._settled.notify_all()
            return self.drain()

    def clear_error(self) -> None:
        """The queue takes closures again after :meth:`mark_failed`."""
        with self.lock:
            self._error = None
            self._can_take.notify_all()

    def drain(self) -> list[Closure]:
        """Removes and returns every queued closure."""
        return self.remove_where(lambda c: True)

    def remove_where(self, pred: Callable[[Closure], bool]) -> list[Closure]:
        """Removes and returns the queued closures ``pred`` accepts, in queue order."""
        with self.lock:
            out = [c for c in self._queue if pred(c)]
            if out:
                self._queue = collections.deque(c for c in self._queue if not pred(c))
                self._settled.notify_all()
            return out

    def stop(self) -> list[Closure]:
        """Stops the queue for good: every ``get`` returns None. Returns the queued
        closures, removed."""
        with self.lock:
            self._stopped = True
            self._can_take.notify_all()
            self._settled.notify_all()
            return self.drain()

    # -- waiting ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or in flight or an error is set (True), or
        ``timeout`` seconds pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not self._settled_now():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def wait_for_change(self, timeout: float | None = None) -> bool:
        """One wait on ``_settled``: returns once the queue is settled (True), or on the
        next change of the queue or :meth:`notify_waiters`, or after ``timeout`` seconds
        (False when still unsettled). For an owner whose wait loop reads state of its
        own (the coordinator's starvation check)."""
        with self.lock:
            if not self._settled_now():
                self._settled.wait(timeout)
            return self._settled_now()

    def wait_inflight(self, timeout: float | None) -> bool:
        """Blocks until nothing is in flight (True) or ``timeout`` seconds pass."""
        end = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._inflight:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def _settled_now(self) -> bool:
        return self._error is not None or not (self._queue or self._inflight)

    def notify_takers(self) -> None:
        """The owner's state that ``get``'s predicates read changed."""
        with self.lock:
            self._can_take.notify_all()

    def notify_waiters(self) -> None:
        """The owner's state that its ``wait`` loop reads changed."""
        with self.lock:
            self._settled.notify_all()
