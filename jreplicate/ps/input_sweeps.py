"""Which sweeps of the per-worker inputs ended on which workers (pure, no threads).

A *sweep* is one generation of a ``PER_WORKER`` input, ``(key, generation)``
(``reinitialize()`` starts the next), or a tuple of them for a step reading several
inputs together. Each step reads the sweep it was scheduled in, so the end of one sweep
never ends another. A worker whose pipeline of a sweep is exhausted takes no more steps
of it; once every live worker's is, the sweep is *exhausted*: its queued steps are not
run (``StopIteration``) and scheduling another raises ``StopIteration``.

The :class:`~jreplicate.ps.coordinator.Coordinator` holds one :class:`InputSweeps` and
changes it under its lock; :meth:`InputSweeps.exhausted` may be read without it (it
reads an immutable snapshot).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jreplicate.ps.worker_input import WorkerInput, WorkerInputs


def input_sweep(closure: Any) -> tuple | None:
    """The sweep of the per-worker input a scheduled step (a ``Closure``) reads, or
    None (a driver-fed batch)."""
    m = closure.batch
    return m.sweep if isinstance(m, (WorkerInput, WorkerInputs)) else None


class InputSweeps:
    """Per sweep, the workers at its end, and the sweeps exhausted on every live worker.

    Example:
      >>> s = InputSweeps()
      >>> s.ended((7, 0), worker=0)
      >>> s.can_run(0, (7, 0)), s.can_run(1, (7, 0))
      (False, True)
      >>> s.newly_exhausted([True, True]), s.newly_exhausted([True, False])
      ([], [(7, 0)])
      >>> s.exhausted((7, 0)), s.exhausted((7, 1))
      (True, False)
    """

    def __init__(self) -> None:
        self._ended: dict[tuple, set[int]] = {}
        self._exhausted: frozenset[tuple] = frozenset()

    def can_run(self, w: int, sweep: tuple | None) -> bool:
        """Whether worker ``w`` may run a step of ``sweep`` (None: no per-worker input)."""
        return sweep is None or w not in self._ended.get(sweep, ())

    def exhausted(self, sweep: tuple | None) -> bool:
        """Whether ``sweep`` ended on every live worker."""
        return sweep in self._exhausted

    def ended(self, sweep: tuple, worker: int) -> None:
        """``worker``'s pipeline of ``sweep`` is exhausted."""
        self._ended.setdefault(sweep, set()).add(worker)

    def newly_exhausted(self, alive: Iterable[bool]) -> list[tuple]:
        """The sweeps now ended on every live worker (``alive[w]``) that were not
        before; from now on they are :meth:`exhausted`."""
        live = [w for w, a in enumerate(alive) if a]
        new = [sweep for sweep, ended in self._ended.items()
               if sweep not in self._exhausted and all(w in ended for w in live)]
        if new:
            self._exhausted = self._exhausted | frozenset(new)
        return new

    def reset(self, sweep: tuple) -> None:
        """``sweep`` was restarted (``reinitialize``): its ends are counted afresh."""
        self._ended.pop(sweep, None)
        self._exhausted = self._exhausted - {sweep}
