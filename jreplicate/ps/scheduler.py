"""The pure scheduling core of the parameter-server coordinator.

Which idle worker takes which queued step, and what a step's end, a worker's loss and
its return change: one state machine over the queued steps (FIFO; a step handed back
goes to the front), the steps in flight (``{step id: worker}``), the admission gate
(:class:`~jreplicate.ps.admission.StalenessGate` or
:class:`~jreplicate.ps.admission.ClockGate`, which keep the idle workers' order and the
per-worker clocks) and token-gated starvation
(:class:`~jreplicate.ps.admission.StarvationDetector`).

No threads, no locks and no clock of its own: every method that needs the time takes it
as ``now``. Two drivers share it:

* the :class:`~jreplicate.ps.coordinator.Coordinator`, in real time: its
  :class:`~jreplicate.ps.closure_queue.ClosureQueue` wraps a :class:`Scheduler` with a
  lock and condition variables, and one thread per worker calls :meth:`Scheduler.take`
  whenever it may have changed;
* ``bench/ps_scale_sim.py``, in virtual time: an event heap calls
  :meth:`Scheduler.take_next` after every event.

>>> s = Scheduler(2, max_staleness=0)
>>> for i in range(3):
...     _ = s.submit(Step(i))
>>> s.arrive(0); s.arrive(1)
>>> s.take(0).closure.step_id, s.take(1)  # tau = 0: one step at a time
(0, Take(closure=None, why='held'))
>>> s.finish(0, s.in_flight()[0]); s.take_next()[0]  # worker 1 came first
1
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from jreplicate.ps.admission import (
    AdmissionGate,
    ClockGate,
    StalenessGate,
    StarvationDetector,
    StatsRecorder,
)

#: Why :meth:`Scheduler.take` gave no step.
TAKEN, STOPPED, FAILED, EMPTY, HELD = "taken", "stopped", "failed", "empty", "held"


class Schedulable(Protocol):
    """What the scheduler needs of a step (:class:`jreplicate.ps.closure.Closure`)."""

    step_id: int


@dataclasses.dataclass
class Step:
    """The smallest :class:`Schedulable` (tests, the simulator)."""

    step_id: int


class Take(NamedTuple):
    """What an idle worker runs next: ``closure``, or None and ``why``: ``"stopped"``
    (for good), ``"failed"`` (an error is set: nothing is taken until it is cleared),
    ``"empty"`` (no queued step the worker can run) or ``"held"`` (one is queued, but
    the admission gate holds the worker back: wait for a step to end or leave flight)."""

    closure: Any
    why: str


class Scheduler:
    """The queued and running steps, admission and starvation (see the module doc).

    Args:
      workers: the number of workers (indices ``0 .. workers - 1``).
      max_staleness: bounded delay's tau (:class:`StalenessGate`), or None.
      max_clock_lead: stale-synchronous parallel's s (:class:`ClockGate`), or None.
      stats: the counters the gates record into (default: new ones).
      starved_after: seconds every running step waits for a token, none queued and no
        progress, before :meth:`starvation_due` says to ask shard 0.
    """

    def __init__(self, workers: int, *, max_staleness: int | None = None,
                 max_clock_lead: int | None = None, stats: StatsRecorder | None = None,
                 starved_after: float = 1.0):
        if max_staleness is not None and max_clock_lead is not None:
            raise ValueError("Scheduler: pass max_staleness (bounded delay) or "
                             "max_clock_lead (stale-synchronous), not both.")
        self.stats = stats if stats is not None else StatsRecorder(workers)
        self.gate: AdmissionGate = (
            StalenessGate(max_staleness, self.stats) if max_clock_lead is None
            else ClockGate(max_clock_lead, workers, self.stats))
        self.starvation = StarvationDetector(starved_after)
        self._queue: collections.deque = collections.deque()
        self._inflight: dict[int, tuple[int, Any]] = {}  # step id -> worker, closure
        self._running: dict[int, int] = {}  # step id -> worker (the gate's view)
        self.error: BaseException | None = None
        self.stopped = False

    # -- the state ----------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def pending(self) -> int:
        """Steps queued or in flight."""
        return len(self._queue) + len(self._inflight)

    @property
    def settled(self) -> bool:
        """Nothing queued or in flight, or an error set (what ``join`` waits for)."""
        return self.error is not None or not (self._queue or self._inflight)

    def running(self) -> dict[int, int]:
        """``{step id: worker}`` of the steps in flight (a copy)."""
        return dict(self._running)

    def in_flight(self) -> list:
        """The steps in flight, in the order they started."""
        return [c for _, c in self._inflight.values()]

    def running_workers(self) -> set[int]:
        return set(self._running.values())

    # -- producers ----------------------------------------------------------------------
    def submit(self, c: Schedulable) -> bool:
        """Queues ``c`` at the back. Returns True when token-gated relaxation (see
        :meth:`maybe_relax`) is to be undone: new steps can push the gradients the
        waiters need."""
        self._queue.append(c)
        return self.starvation.unrelax()

    def put_back(self, c: Schedulable, position: int = 0) -> None:
        """``c`` (in flight or not) goes back into the queue at ``position`` (0: the
        front, to run next), out of flight without a tick of its worker's clock."""
        self._leave_flight(c)
        self._queue.insert(min(position, len(self._queue)), c)

    # -- takers -------------------------------------------------------------------------
    def arrive(self, worker: int) -> None:
        """``worker`` is idle and waits for a step: it joins the end of the idle order
        (once per wait, until it takes a step or :meth:`leave`-s)."""
        self.gate.arrive(worker)

    def leave(self, worker: int) -> None:
        """``worker`` stopped waiting (it exits, or gives up for now)."""
        self.gate.leave(worker)

    def take(self, worker: int,
             can_run: Callable[[int, Any], bool] | None = None) -> Take:
        """The first queued step idle ``worker`` can run, if the gate admits it now:
        the step is then in flight on ``worker`` and the worker no longer idle.

        ``can_run(v, c)``: whether worker ``v`` can run step ``c`` (default: any worker
        any step); the gate uses it for the other idle workers too (first come, first
        served among those that could run the step). ``worker`` must have
        :meth:`arrive`-d.
        """
        if self.stopped:
            return Take(None, STOPPED)
        if self.error is not None:
            return Take(None, FAILED)
        if can_run is None:  # (the gate's own can_run None: every worker, no calls)
            i, runs = (0 if self._queue else None), None
        else:
            i = next((i for i, c in enumerate(self._queue) if can_run(worker, c)), None)
            runs = None if i is None else \
                (lambda v, c=self._queue[i]: can_run(v, c))
        if i is None:
            return Take(None, EMPTY)
        c = self._queue[i]
        if self.gate.bounded and not self.gate.admits(worker, runs, self._running):
            return Take(None, HELD)
        del self._queue[i]
        self.gate.start(c.step_id)
        self._inflight[c.step_id] = (worker, c)
        self._running[c.step_id] = worker
        self.gate.leave(worker)
        return Take(c, TAKEN)

    def take_next(self) -> tuple[int, Any] | None:
        """For a driver that runs every step on any worker: the idle worker that takes a
        step now and the step (started, as :meth:`take`), or None when none may: the
        first idle worker the gate admits (unbounded: the first idle one)."""
        if not self._queue or self.stopped or self.error is not None:
            return None
        w = self.gate.first(None, self._running)
        if w is None:
            return None
        c = self.take(w).closure
        return None if c is None else (w, c)

    # -- the ends of steps, workers lost and back ---------------------------------------
    def finish(self, worker: int, c: Schedulable) -> None:
        """Step ``c`` ended on ``worker`` (completed, or failed there): the worker's
        clock moves on, the step leaves flight and counts as progress."""
        self.gate.tick(worker)
        self._leave_flight(c)
        self.starvation.moved()

    def drop(self, c: Schedulable) -> None:
        """``c`` leaves flight without a tick (given up, cancelled, not run)."""
        self._leave_flight(c)

    def worker_lost(self, worker: int) -> None:
        """``worker`` was lost: it no longer waits, and its clock no longer holds the
        others back. (Its step in flight is the driver's: :meth:`put_back` or
        :meth:`drop` it.)"""
        self.gate.leave(worker)
        self.gate.lose(worker)

    def worker_back(self, worker: int) -> None:
        """Lost ``worker`` is back (replaced): it rejoins at the slowest live clock; it
        takes steps once it :meth:`arrive`-s."""
        self.gate.rejoin(worker)

    def _leave_flight(self, c: Schedulable) -> None:
        if self._inflight.pop(c.step_id, None) is not None:
            del self._running[c.step_id]
            self.gate.stop(c.step_id)

    # -- errors and the end -------------------------------------------------------------
    def fail(self, error: BaseException) -> list:
        """Sets ``error`` (unless one is set: the first stays) and returns the queued
        steps, removed (the driver fails them); the steps in flight stay."""
        if self.error is not None:
            return []
        self.error = error
        return self.remove_where(lambda c: True)

    def clear_error(self) -> None:
        """Steps are taken again after :meth:`fail`."""
        self.error = None

    def remove_where(self, pred: Callable[[Any], bool]) -> list:
        """Removes and returns the queued steps ``pred`` accepts, in queue order."""
        out = [c for c in self._queue if pred(c)]
        if out:
            self._queue = collections.deque(c for c in self._queue if not pred(c))
        return out

    def stop(self) -> list:
        """Stops for good (every take: ``"stopped"``); returns the queued steps,
        removed."""
        self.stopped = True
        return self.remove_where(lambda c: True)

    # -- token-gated training -----------------------------------------------------------
    def token_wait(self, worker: int, waiting: bool) -> bool:
        """``worker``'s running step began (``waiting``) or ended a wait for a token.
        Returns :meth:`maybe_relax`'s answer."""
        self.starvation.token_wait(worker, waiting)
        return self.maybe_relax()

    def stuck(self) -> bool:
        """Every running step waits for a token and none is queued."""
        if self._queue or not self.starvation.waits:  # (no set of 1,000 workers built)
            return False
        return self.starvation.stuck(self.running_workers(), len(self._queue))

    def maybe_relax(self) -> bool:
        """True once per stuck spell: the waiters may take a second token of the current
        step (one gradient per worker and step is only a preference)."""
        return self.starvation.relax(self.stuck())

    def starvation_due(self, now: float) -> float | None:
        """Seconds until shard 0 is to be asked for a token (0.0: now), or None: not
        stuck. Note :attr:`StarvationDetector.progress` before asking and pass it to
        :meth:`starved`."""
        return self.starvation.due(self.stuck(), now)

    def starved(self, progress: int, none_to_give: bool) -> bool:
        """Shard 0 answered ``none_to_give``: True when the waits are to be cancelled
        (no token, and nothing moved since ``progress`` was noted). The next stuck spell
        starts anew."""
        out = none_to_give and progress == self.starvation.progress and self.stuck()
        self.starvation.asked()
        return out
