"""When a worker may start a step, and when token-gated steps can no longer go on.

* :class:`StalenessGate`: bounded staleness (``max_staleness=tau``, Li et al., OSDI'14).
  The staleness of an applied update is the number of updates applied between the
  worker's pull and the application of its push. Every update a shard applies while a
  step runs comes from a step that ran alongside it, so the gate counts, for each
  running step, the steps that ran alongside it (``alongside``) and admits a step only
  while that keeps every running step's count at most tau (tau = 0: one step at a time).
  Idle workers are admitted in the order they became idle.
* :class:`StarvationDetector`: token-gated training. A worker counts as waiting for a
  token only while it blocks on shard 0's queue holding none it may take
  (``token_wait``); when every running step does and none is queued, nothing can push
  the gradients the next step needs. After ``grace`` seconds in that state with no
  progress (a token wait ended, a step ended), shard 0 is asked whether it has a token to
  give; if not, the waits are cancelled.
* :class:`StatsRecorder`: the coordinator's counters, kept under a lock and read as an
  immutable :class:`CoordinatorStats`.

None of them locks the coordinator's state: their methods are called under the
:class:`~jreplicate.ps.closure_queue.ClosureQueue`'s lock (the recorder has its own).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import NamedTuple


class StalenessGate:
    """Admission under bounded staleness (see the module docstring).

    >>> g = StalenessGate(tau=0, stats=StatsRecorder(2))
    >>> g.arrive(0); g.arrive(1)
    >>> g.admits(0, lambda w: True, running={})
    True
    >>> g.start(7); g.leave(0)
    >>> g.admits(1, lambda w: True, running={7: 0})  # tau = 0: one step at a time
    False
    """

    def __init__(self, tau: int | None, stats: StatsRecorder):
        self.tau = tau
        self._stats = stats
        self._alongside: dict[int, int] = {}  # running step id -> steps it ran alongside
        self._idle: dict[int, int] = {}  # worker waiting for a step -> its ticket
        self._tickets = 0
        self._max = 0  # the most steps one step ran alongside, so far

    def arrive(self, worker: int) -> None:
        """``worker`` starts waiting for a step (takes a ticket)."""
        self._tickets += 1
        self._idle[worker] = self._tickets

    def leave(self, worker: int) -> None:
        """``worker`` stopped waiting (took a step, or exits)."""
        self._idle.pop(worker, None)

    def admits(self, worker: int, can_run: Callable[[int], bool],
               running: dict[int, int]) -> bool:
        """Whether idle ``worker`` may start a step now: it is the first idle worker
        (of those ``can_run`` the step) and starting keeps every running step's count
        at most tau. ``running``: ``{step id: worker}`` in flight."""
        if self.tau is None:
            return True
        if self._idle[worker] != min(t for v, t in self._idle.items() if can_run(v)):
            return False  # first come, first served: a finishing worker does not hog
        others = [i for i, v in running.items() if v != worker]
        return len(others) <= self.tau and all(self._alongside[i] < self.tau
                                               for i in others)

    def start(self, step_id: int) -> None:
        """Step ``step_id`` starts alongside every running one."""
        for i in self._alongside:
            self._alongside[i] += 1
        self._alongside[step_id] = len(self._alongside)
        n = max(self._alongside.values())
        if n > self._max:
            self._max = n
            self._stats.saw_alongside(n)

    def stop(self, step_id: int) -> None:
        self._alongside.pop(step_id, None)


class StarvationDetector:
    """Token-gated starvation (see the module docstring).

    ``grace``: seconds every running step must wait for a token, none queued and no
    progress, before shard 0 is asked.

    >>> d = StarvationDetector(grace=1.0)
    >>> d.token_wait(0, True)
    >>> stuck = d.stuck(running={0}, queued=0)
    >>> stuck, d.due(stuck, now=10.0), d.due(stuck, now=11.5)
    (True, 1.0, 0.0)
    """

    def __init__(self, grace: float):
        self.grace = grace
        self.progress = 0  # token waits ended or begun, steps ended
        self.relaxed = False
        self._waiting: set[int] = set()
        self._since: float | None = None  # stuck since, at progress _seen
        self._seen = -1

    def token_wait(self, worker: int, waiting: bool) -> None:
        (self._waiting.add if waiting else self._waiting.discard)(worker)
        self.progress += 1

    def moved(self) -> None:
        """A step ended (or went back to the queue uncounted)."""
        self.progress += 1

    def stuck(self, running: set[int], queued: int) -> bool:
        """Whether every running step waits for a token and none is queued."""
        return not queued and bool(running) and running <= self._waiting

    def relax(self, stuck: bool) -> bool:
        """True once per stuck spell: let the waiters take a second token of the
        current step (one gradient per worker and step is only a preference)."""
        if stuck and not self.relaxed:
            self.relaxed = True
            return True
        return False

    def unrelax(self) -> bool:
        """New steps were scheduled: True if the relaxation must be undone."""
        was, self.relaxed = self.relaxed, False
        return was

    def due(self, stuck: bool, now: float | None = None) -> float | None:
        """Seconds until shard 0 should be asked (0.0: now), or None (not stuck)."""
        if not stuck:
            self._since = None
            return None
        now = time.monotonic() if now is None else now
        if self._since is None or self._seen != self.progress:
            self._since, self._seen = now, self.progress
            return self.grace
        return max(0.0, self.grace - (now - self._since))

    def asked(self) -> None:
        """Shard 0 was asked: the next spell starts anew."""
        self._since = None


class CoordinatorStats(NamedTuple):
    """A snapshot of the coordinator's counters."""

    scheduled: int
    completed: int
    completed_by: tuple[int, ...]  # per worker
    rescheduled: int
    replaced: int  # lost workers the carrier brought back
    max_alongside: int  # the most steps one step ran alongside (bounds its staleness)
    finish_times: tuple[tuple[float, ...], ...]  # per worker, time.monotonic(): the latest
    not_run_end_of_input: int


#: Finish times kept per worker (the latest: a long job's stats stay bounded).
FINISH_TIMES = 1000


class StatsRecorder:
    """The counters, under a lock of their own.

    >>> s = StatsRecorder(2)
    >>> s.completed(1, at=3.0); s.count("rescheduled")
    >>> s.snapshot().completed_by, s.snapshot().rescheduled
    ((0, 1), 1)
    """

    def __init__(self, workers: int):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("scheduled", "rescheduled", "replaced", "not_run_end_of_input"), 0)
        self._max_alongside = 0
        self._completed = [0] * workers
        self._finish_times = [collections.deque(maxlen=FINISH_TIMES) for _ in range(workers)]

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def completed(self, worker: int, at: float | None = None) -> None:
        with self._lock:
            self._completed[worker] += 1
            self._finish_times[worker].append(time.monotonic() if at is None else at)

    def saw_alongside(self, n: int) -> None:
        with self._lock:
            self._max_alongside = max(self._max_alongside, n)

    def snapshot(self) -> CoordinatorStats:
        with self._lock:
            times = tuple(tuple(t) for t in self._finish_times)
            return CoordinatorStats(
                scheduled=self._counts["scheduled"], completed=sum(self._completed),
                completed_by=tuple(self._completed),
                rescheduled=self._counts["rescheduled"],
                replaced=self._counts["replaced"], max_alongside=self._max_alongside,
                finish_times=times,
                not_run_end_of_input=self._counts["not_run_end_of_input"])
