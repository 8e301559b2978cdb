"""Fault injection as a plan: what a test or benchmark makes go wrong, and where.

A :class:`FaultPlan` says, per worker, how many extra seconds each of its steps takes
(a straggler) and whether it dies in its next step: while computing (``"compute"``) or
between two shards' pushes (``"push"``). A carrier is given one plan when it is built
and hands it to what it builds: the embedded carrier to its workers and their shard
clients, the Ray carrier to each worker actor (its part, then every change,
``set_faults``). Production code holds only the plan, and consults it at three named
points:

* :meth:`FaultPlan.after_compute` -- a step computed, before its push: sleep the
  worker's delay; die if a kill at ``"compute"`` is armed;
* :meth:`FaultPlan.ordered` -- whether the push goes to shard 0 first, then the others
  (a kill at ``"push"`` is armed: it has a moment between the two to die in);
* :meth:`FaultPlan.between_shards` -- shard 0 has the push, the others not yet: die if
  a kill at ``"push"`` is armed.

A kill fires once (the worker that dies is replaced, or lost for good); a delay stays
until it is set again. The default plan, ``FaultPlan()``, injects nothing: no sleep, no
kill, every push all at once. Shards have no plan: ``kill_shard`` closes (embedded) or
kills (Ray) a shard at once, as a crash would.

Example::

  >>> plan = FaultPlan()
  >>> plan.set_delay(1, 0.05)
  >>> plan.kill(2, "push")
  >>> plan.get(2)
  WorkerFaults(delay=0.0, kill_at='push')
  >>> plan.ordered(2), plan.ordered(1)
  (True, False)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping

from jreplicate.ps.remote import WorkerLostError

#: Where a worker can be made to die in its next step.
KILL_POINTS = ("compute", "push")


@dataclasses.dataclass(frozen=True)
class WorkerFaults:
    """One worker's faults.

    Attributes:
      delay: extra seconds each of its steps takes (after computing, before pushing).
      kill_at: ``"compute"`` or ``"push"``: it dies there in its next step; None: it
        does not.
    """

    delay: float = 0.0
    kill_at: str | None = None

    def __post_init__(self):
        if not self.delay >= 0.0:  # (NaN too)
            raise ValueError(f"WorkerFaults(delay={self.delay!r}): a worker's delay is "
                             "seconds >= 0; pass 0.0 for none.")
        if self.kill_at is not None and self.kill_at not in KILL_POINTS:
            raise ValueError(f"WorkerFaults(kill_at={self.kill_at!r}) must be one of "
                             f"{KILL_POINTS} or None.")


_NONE = WorkerFaults()


class FaultPlan:
    """The faults to inject, per worker index (see the module docstring); thread-safe.

    Args:
      workers: the faults of each worker index to start with (none: inject nothing).
    """

    def __init__(self, workers: Mapping[int, WorkerFaults] | None = None):
        self._lock = threading.Lock()
        self._workers: dict[int, WorkerFaults] = {
            int(w): f for w, f in (workers or {}).items() if f != _NONE}

    def __getstate__(self) -> dict:
        with self._lock:  # (shipped to Ray's worker actors; a lock does not pickle)
            return {"workers": dict(self._workers)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["workers"])

    def __repr__(self) -> str:
        with self._lock:
            return f"FaultPlan({self._workers!r})"

    # -- the plan: read and changed by tests and benchmarks (jreplicate.testing) ------------
    def get(self, worker: int) -> WorkerFaults:
        """Worker ``worker``'s faults (none armed: ``WorkerFaults()``)."""
        with self._lock:
            return self._workers.get(worker, _NONE)

    def set(self, worker: int, faults: WorkerFaults) -> None:
        """Worker ``worker``'s faults become ``faults`` (the Ray carrier sends a worker
        actor its part of the driver's plan so)."""
        with self._lock:
            self._put(worker, faults)

    def set_delay(self, worker: int, seconds: float) -> None:
        """Each step of worker ``worker`` takes ``seconds`` more (0.0: no delay)."""
        self._change(worker, delay=float(seconds))

    def kill(self, worker: int, when: str) -> None:
        """Worker ``worker`` dies in its next step, at ``when`` (see KILL_POINTS)."""
        self._change(worker, kill_at=when)

    def disarm(self, worker: int) -> None:
        """Worker ``worker`` has no kill armed (a replacement starts afresh; its delay
        stays)."""
        self._change(worker, kill_at=None)

    def _change(self, worker: int, **changes) -> None:
        with self._lock:
            self._put(worker, dataclasses.replace(self._workers.get(worker, _NONE),
                                                  **changes))

    def _put(self, worker: int, faults: WorkerFaults) -> None:
        """(Under the lock.) A worker with nothing armed has no entry: the default
        plan's points then return at once."""
        if faults == _NONE:
            self._workers.pop(worker, None)
        else:
            self._workers[worker] = faults

    def _fire(self, worker: int, point: str) -> WorkerFaults:
        """Worker ``worker``'s faults, its kill disarmed if it fires at ``point``."""
        with self._lock:
            f = self._workers.get(worker, _NONE)
            if f.kill_at == point:
                self._put(worker, dataclasses.replace(f, kill_at=None))
        return f

    # -- the named points production code consults -------------------------------------------
    def after_compute(self, worker: int, step_id: int) -> None:
        """Worker ``worker`` computed step ``step_id`` and has not pushed it: sleeps its
        delay, then raises :class:`WorkerLostError` if it is to die computing."""
        if not self._workers:  # (the default plan: not even the lock)
            return
        f = self._fire(worker, "compute")
        if f.delay:
            time.sleep(f.delay)
        if f.kill_at == "compute":
            raise WorkerLostError(f"worker {worker} died computing step {step_id}")

    def ordered(self, worker: int) -> bool:
        """Whether worker ``worker``'s push goes to shard 0 first, then to the others,
        with :meth:`between_shards` between them (a kill at ``"push"`` is armed)."""
        return bool(self._workers) and self.get(worker).kill_at == "push"

    def between_shards(self, worker: int, i: int) -> None:
        """Worker ``worker`` pushed to shards ``0 .. i - 1`` and not yet to the others:
        raises :class:`WorkerLostError` if it is to die pushing."""
        if self._workers and self._fire(worker, "push").kill_at == "push":
            raise WorkerLostError(f"worker {worker} died after pushing to shard {i - 1}")
