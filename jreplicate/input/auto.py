"""The default of ``prefetch_on_device``: prefetch once reads are seen to cost (private).

A prefetch thread hides a slow source behind the step, but on a host with few cores it
also competes with the step's own dispatch: ``bench/host_overhead.py`` measured ~7 %
on a dispatch-bound 1.6 ms step fed by a fast source, while ``bench/prefetch.py``
measured a source as slow as the step going from 1.27-1.38x to 1.03-1.07x of the ideal
with prefetch. So the default reads on the calling thread and times each read against
the whole cycle from one read to the next (the read, the step's dispatch, the user's
loop); once the median read over the last :data:`WINDOW` steps takes more than
:data:`SHARE` of the median cycle, it starts the prefetch thread for the rest of the
iteration. The first :data:`WARMUP` steps (compilation) are not counted.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

#: Steps not timed at the start (the first step compiles; the second may still).
WARMUP = 2
#: Steps over which the median read and cycle are taken.
WINDOW = 8
#: A read taking more than this share of the cycle turns prefetch on.
SHARE = 0.10


class AutoPrefetch:
    """Times the reads made on the calling thread; says when to prefetch instead."""

    def __init__(self) -> None:
        self._reads: collections.deque = collections.deque(maxlen=WINDOW)
        self._cycles: collections.deque = collections.deque(maxlen=WINDOW)
        self._last_end: float | None = None
        self._seen = 0

    def read(self, produce: Callable[[], Any]) -> Any:
        """``produce()``, timed."""
        start = time.perf_counter()
        item = produce()
        end = time.perf_counter()
        self._seen += 1
        if self._last_end is not None and self._seen > WARMUP:
            self._reads.append(end - start)
            self._cycles.append(end - self._last_end)
        self._last_end = end
        return item

    def restart(self) -> None:
        """Forgets the cycle in progress (the input was restarted, e.g. a new sweep)."""
        self._last_end = None

    def wants_prefetch(self) -> bool:
        if len(self._reads) < WINDOW:
            return False
        return statistics.median(self._reads) > SHARE * statistics.median(self._cycles)
