"""The default of ``prefetch_on_device``: prefetch where it is measured to help (private).

A prefetch thread hides a slow source behind the step, but on a host with few cores it
also competes with the step's own dispatch: ``bench/host_overhead.py`` measured a
prefetch thread costing 5-7 % on a dispatch-bound 1.6 ms step fed by a fast source (2
cores, 8 CPU devices), while ``bench/prefetch.py`` measured a source as slow as the step
going from 1.3-1.5x to 1.1-1.2x of the ideal with prefetch. Neither the read's wall time
nor its CPU time tells in advance which case a pipeline is in (on a busy host a read's
wall time includes the time its thread waits for a core), so the default measures the
outcome itself:

1. Reads on the calling thread, timing each read and each cycle (from one batch handed
   out to the next: the step's dispatch, the rest of the user's loop, the read).
   The first :data:`WARMUP` steps (compilation) are not counted.
2. Once the median read over the last :data:`WINDOW` steps takes more than
   :data:`SHARE` of the median cycle, an A/B/A trial: :data:`WINDOW` steps with the
   prefetch thread, then :data:`WINDOW` steps in line again (each after the steps that
   fill the prefetch queue, or hand out what it read ahead), so that a drift in the
   machine's speed does not pass for a gain.
3. Prefetch is kept if the trial's median cycle is more than :data:`GAIN` shorter than
   the median cycle of both in-line windows; otherwise reading stays in line (what was
   prefetched was handed out first, in order), and another trial is made only once
   reads take twice the share they took at the failed one.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

#: Steps not timed at the start (the first step compiles; the second may still).
WARMUP = 2
#: Steps over which medians are taken, in line and in a trial.
WINDOW = 10
#: A read taking more than this share of the cycle starts a trial of prefetch.
SHARE = 0.10
#: Prefetch is kept if it shortens the median cycle by more than this fraction.
GAIN = 0.10

#: What :meth:`AutoPrefetch.step_done` asks of the iterator: prefetch for a trial, read
#: in line again, or prefetch for good.
TRY, STOP, KEEP = "try", "stop", "keep"


class AutoPrefetch:
    """Times reads and cycles, in line and in a prefetch trial; says what to do next."""

    def __init__(self, buffer_size: int = 1) -> None:
        # Cycles not counted after a switch: the prefetch queue filling, or the batches
        # it read ahead being handed out.
        self._settle = buffer_size + 1
        self.phase = "inline"  # then "trial" (prefetching), "verify" (in line again)
        self._reads: collections.deque = collections.deque(maxlen=WINDOW)
        self._inline: collections.deque = collections.deque(maxlen=WINDOW)
        self._trial: list[float] = []
        self._verify: list[float] = []
        self._share = SHARE  # the read share that starts a trial
        self._read = 0.0
        self._last: float | None = None
        self._seen = 0

    @property
    def trial(self) -> bool:
        """Whether batches are prefetched now (for the trial)."""
        return self.phase == "trial"

    def read(self, produce: Callable[[], Any]) -> Any:
        """``produce()`` on the calling thread, timed."""
        start = time.perf_counter()
        item = produce()
        self._read = time.perf_counter() - start
        return item

    def restart(self) -> None:
        """Forgets the cycle in progress (the input was restarted, e.g. a new sweep)."""
        self._last = None

    def step_done(self) -> str | None:
        """Notes that a batch was handed out; returns :data:`TRY`, :data:`STOP`,
        :data:`KEEP` or None (nothing to change)."""
        now = time.perf_counter()
        cycle = None if self._last is None else now - self._last
        self._last = now
        self._seen += 1
        if cycle is None or self._seen <= WARMUP:
            return None
        if self.phase == "trial":
            self._trial.append(cycle)
            if len(self._trial) < WINDOW + self._settle:
                return None
            self.phase, self._verify = "verify", []
            return STOP
        if self.phase == "verify":
            self._verify.append(cycle)
            if len(self._verify) < WINDOW + self._settle:
                return None
            return self._decide()
        self._reads.append(self._read)
        self._inline.append(cycle)
        if len(self._inline) == WINDOW and \
                statistics.median(self._reads) > self._share * statistics.median(self._inline):
            self.phase, self._trial = "trial", []
            return TRY
        return None

    def _decide(self) -> str | None:
        settle = self._settle
        inline = min(statistics.median(self._inline), statistics.median(self._verify[settle:]))
        if statistics.median(self._trial[settle:]) < (1 - GAIN) * inline:
            return KEEP
        self.phase = "inline"
        self._share = 2 * statistics.median(self._reads) / statistics.median(self._inline)
        self._inline.clear()
        self._reads.clear()
        return None
