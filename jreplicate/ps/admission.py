"""When a worker may start a step, and when token-gated steps can no longer go on.

* :class:`StalenessGate`: bounded staleness (``max_staleness=tau``, Li et al., OSDI'14).
  The staleness of an applied update is the number of updates applied between the
  worker's pull and the application of its push. Every update a shard applies while a
  step runs comes from a step that ran alongside it, so the gate counts, for each
  running step, the steps that ran alongside it (``alongside``) and admits a step only
  while that keeps every running step's count at most tau (tau = 0: one step at a time).
  Idle workers are admitted in the order they became idle.
* :class:`ClockGate`: stale-synchronous parallel (``max_clock_lead=s``, Ho et al.,
  NIPS'13). A worker's clock is its count of ended steps; a worker may start a step only
  while its clock is at most s ahead of the slowest *live* worker's (of those that can
  run the step), so about ``(s + 1) x workers`` steps run at once. A lost worker leaves
  the minimum (its clock never blocks the others); a replaced one rejoins at the
  slowest live worker's clock. Idle workers that may start are admitted in the order
  they became idle. Both gates share one small protocol, :class:`AdmissionGate`.
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
from typing import NamedTuple, Protocol


class AdmissionGate(Protocol):
    """When an idle worker may start a step (called under the queue's lock).

    ``arrive``/``leave`` bracket a worker's wait for a step; ``admits`` decides (and
    ``first`` names the idle worker it would admit);
    ``start``/``stop`` follow a step in and out of flight; ``tick`` ends a step on a
    worker (its clock moves on); ``lose``/``rejoin`` follow a worker's loss and return.
    """

    bounded: bool

    def arrive(self, worker: int) -> None: ...
    def leave(self, worker: int) -> None: ...
    def first(self, can_run: Callable[[int], bool] | None = None,
              running: dict[int, int] | None = None) -> int | None: ...
    def admits(self, worker: int, can_run: Callable[[int], bool] | None,
               running: dict[int, int]) -> bool: ...
    def start(self, step_id: int) -> None: ...
    def stop(self, step_id: int) -> None: ...
    def tick(self, worker: int) -> None: ...
    def lose(self, worker: int) -> None: ...
    def rejoin(self, worker: int) -> None: ...


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
        self._idle: dict[int, None] = {}  # the workers waiting for a step, in arrival order
        self._max = 0  # the most steps one step ran alongside, so far

    def arrive(self, worker: int) -> None:
        """``worker`` starts waiting for a step (at the end of the idle order, unless it
        waits already)."""
        self._idle.setdefault(worker)

    def leave(self, worker: int) -> None:
        """``worker`` stopped waiting (took a step, or exits)."""
        self._idle.pop(worker, None)

    def first(self, can_run: Callable[[int], bool] | None = None,
              running: dict[int, int] | None = None) -> int | None:
        """The first idle worker (of those ``can_run`` the step), if starting a step on
        it now keeps every running step's count at most tau; else None."""
        v = next((v for v in self._idle if can_run is None or can_run(v)), None)
        return v if v is not None and self._room(v, running or {}) else None

    def _room(self, worker: int, running: dict[int, int]) -> bool:
        if self.tau is None:
            return True
        others = [i for i, v in running.items() if v != worker]
        return len(others) <= self.tau and all(self._alongside[i] < self.tau
                                               for i in others)

    def admits(self, worker: int, can_run: Callable[[int], bool] | None,
               running: dict[int, int]) -> bool:
        """Whether idle ``worker`` may start a step now: it is the first idle worker
        (of those ``can_run`` the step) and starting keeps every running step's count
        at most tau (``can_run`` None: every worker can). ``running``: ``{step id:
        worker}`` in flight."""
        if self.tau is None:
            return True
        # first come, first served: a finishing worker does not hog
        return self.first(can_run, running) == worker

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

    @property
    def bounded(self) -> bool:
        """Whether the gate ever refuses (tau set)."""
        return self.tau is not None

    # Bounded delay counts steps in flight, not workers' clocks: nothing to follow.
    def tick(self, worker: int) -> None:
        del worker

    def lose(self, worker: int) -> None:
        del worker

    def rejoin(self, worker: int) -> None:
        del worker


class ClockGate:
    """Admission under stale-synchronous parallel (see the module docstring).

    Args:
      lead: s, the most clocks a worker may be ahead of the slowest live worker when it
        starts a step (0: no worker starts its step c+1 before every live worker ended
        c steps).
      workers: the number of workers (all live, at clock 0: a new job's, or a restored
        one's: clocks are relative, so a restore starts them level).
      stats: where the largest lead admitted is recorded (``saw_clock_lead``).

    >>> g = ClockGate(lead=0, workers=2, stats=StatsRecorder(2))
    >>> g.arrive(0); g.admits(0, lambda w: True, running={})
    True
    >>> g.leave(0); g.tick(0); g.arrive(0)  # worker 0 ended a step: 1 clock ahead
    >>> g.admits(0, lambda w: True, running={})
    False
    >>> g.lose(1); g.admits(0, lambda w: True, running={})  # worker 1 no longer counts
    True
    """

    bounded = True

    def __init__(self, lead: int, workers: int, stats: StatsRecorder):
        self.lead = lead
        self._stats = stats
        self.clocks = [0] * workers
        self._live = [True] * workers
        # How many live workers are at each clock: the slowest one in O(distinct clocks),
        # which SSP keeps within about lead + 2 values (1,000 workers: no scan of all).
        self._at: collections.Counter[int] = collections.Counter({0: workers} if workers
                                                                 else {})
        self._idle: dict[int, int] = {}  # in arrival order: worker -> its ticket
        self._tickets = 0
        self._max = 0

    def arrive(self, worker: int) -> None:
        """``worker`` starts waiting for a step (joins the end of the idle order)."""
        self._tickets += 1
        self._idle.pop(worker, None)
        self._idle[worker] = self._tickets

    def leave(self, worker: int) -> None:
        self._idle.pop(worker, None)

    def slowest(self, can_run: Callable[[int], bool] | None = None) -> int | None:
        """The smallest clock of the live workers that ``can_run`` the step (None: no
        such worker)."""
        if can_run is None:
            return min(self._at, default=None)
        return min((c for v, c in enumerate(self.clocks)
                    if self._live[v] and (can_run is None or can_run(v))), default=None)

    def first(self, can_run: Callable[[int], bool] | None = None,
              running: dict[int, int] | None = None) -> int | None:
        """The first idle worker (in arrival order) that may start a step now
        (``running`` is not needed: clocks say it all)."""
        del running
        low = self.slowest(can_run)
        for v in self._idle:
            if (can_run is None or can_run(v)) and self._ok(v, low):
                return v
        return None

    def _ok(self, v: int, low: int | None) -> bool:
        # A worker outside the minimum (lost, or unable to run the step) is never held
        # back by itself: low is None only when no live worker can run the step.
        return low is None or self.clocks[v] - low <= self.lead

    def admits(self, worker: int, can_run: Callable[[int], bool] | None,
               running: dict[int, int]) -> bool:
        """Whether idle ``worker`` may start a step now: its clock is at most ``lead``
        ahead of the slowest live worker's that can run it, and no idle worker that may
        start came before it. ``running`` is not needed (clocks say it all). A True
        answer is taken as the start of a step by ``worker`` (its lead is recorded)."""
        del running
        if self.first(can_run) != worker:
            return False
        low = self.slowest(can_run)
        n = 0 if low is None else self.clocks[worker] - low
        if n > self._max:
            self._max = n
            self._stats.saw_clock_lead(n)
        return True

    def start(self, step_id: int) -> None:
        del step_id

    def stop(self, step_id: int) -> None:
        del step_id

    def tick(self, worker: int) -> None:
        """A step ended on ``worker`` (completed, or failed there): its clock moves on."""
        if self._live[worker]:
            self._count(self.clocks[worker], -1)
            self._count(self.clocks[worker] + 1, 1)
        self.clocks[worker] += 1

    def _count(self, clock: int, n: int) -> None:
        self._at[clock] += n
        if not self._at[clock]:
            del self._at[clock]

    def lose(self, worker: int) -> None:
        """``worker`` was lost: its clock no longer holds the others back."""
        if self._live[worker]:
            self._count(self.clocks[worker], -1)
        self._live[worker] = False
        self._idle.pop(worker, None)

    def rejoin(self, worker: int) -> None:
        """``worker`` is back (replaced): it rejoins at the slowest live worker's clock
        (or its own, if later), so that the others' leads over it stay within bounds
        and the bound on the staleness of updates holds."""
        if self._live[worker]:
            return
        low = self.slowest()
        self._live[worker] = True
        if low is not None:
            self.clocks[worker] = max(self.clocks[worker], low)
        self._count(self.clocks[worker], 1)


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

    @property
    def waits(self) -> bool:
        """Whether any worker waits for a token."""
        return bool(self._waiting)

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
    max_clock_lead: int = 0  # max_clock_lead: the largest lead of a worker admitted


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
        self._max_clock_lead = 0
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

    def saw_clock_lead(self, n: int) -> None:
        with self._lock:
            self._max_clock_lead = max(self._max_clock_lead, n)

    def snapshot(self) -> CoordinatorStats:
        with self._lock:
            times = tuple(tuple(t) for t in self._finish_times)
            return CoordinatorStats(
                scheduled=self._counts["scheduled"], completed=sum(self._completed),
                completed_by=tuple(self._completed),
                rescheduled=self._counts["rescheduled"],
                replaced=self._counts["replaced"], max_alongside=self._max_alongside,
                finish_times=times,
                not_run_end_of_input=self._counts["not_run_end_of_input"],
                max_clock_lead=self._max_clock_lead)
