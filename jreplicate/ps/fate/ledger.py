"""The ledger of one parameter-server shard: what became of every push.

Each push carries an id (the id of the scheduled step it belongs to; a rescheduled step
keeps its id). The shard records the outcome of each push in the same critical section
as the apply, so a push id is applied at most once:

* ``applied``: the gradient went into the parameters (asynchronous mode), or into the
  accumulators of the step it was computed for (token-gated mode);
* ``stale``: dropped, computed at an old step (token-gated mode), or more than
  ``max_staleness`` updates stale (asynchronous mode);
* ``backup``: dropped, enough faster gradients of its step were already aggregated;
* ``duplicate``: the id was already decided (a rescheduled step whose first attempt
  reached this shard);
* ``failed``: a shard's optimizer update raised for it (the step's error,
  :class:`jreplicate.ps.ShardUpdateError`): no shard applied it, and every shard records
  it so.

An id whose step ended for good without pushing (its function raised, its token wait was
cancelled, it was not run: cancelled at shutdown or at the end of its input) is
*skipped* (:meth:`Ledger.skip`): decided without a push, counted nowhere, so that the
watermark moves past it.

Invariant: ``pushes == applied + stale + backup + duplicate + failed``. Staleness
(shard step at apply minus the step at which the worker fetched the parameters) is
recorded per applied push as a histogram.

The ledger saves to fixed-shape arrays (:meth:`Ledger.to_arrays`), so it is
checkpointed with the shard's state by :class:`jreplicate.CheckpointManager`: decided
ids are kept as a watermark (every id below it is decided) plus a window of the decided
ids above it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

KINDS = ("applied", "stale", "backup", "duplicate", "failed")
#: Staleness values kept exactly; larger ones count in the last bin.
HISTOGRAM_BINS = 64
#: Decided push ids above the watermark kept in a checkpoint.
WINDOW = 1024


class Ledger:
    """Outcomes of the pushes one shard received (not thread-safe: the shard's lock
    guards it)."""

    def __init__(self, watermark: int = 0):
        self.counts = dict.fromkeys(KINDS, 0)
        self.staleness = collections.Counter()
        self._decided: set[int] = set()
        self._watermark = int(watermark)  # every id < watermark is decided
        # Shard 0's decisions (token-gated mode) and the failed pushes, by push id: a
        # rerun's push gets its step's decision back. Kept until the coordinator says
        # that the step ended (forget).
        self.decisions: dict[int, Any] = {}

    @property
    def pushes(self) -> int:
        return sum(self.counts.values())

    def seen(self, push_id: int) -> bool:
        return push_id < self._watermark or push_id in self._decided

    def record(self, push_id: int, kind: str, staleness: int | None = None) -> None:
        """Records a push's outcome (``duplicate`` for an id already decided)."""
        self.counts[kind] += 1
        if kind == "duplicate":
            return
        self._decide(push_id)
        if staleness is not None:
            self.staleness[int(staleness)] += 1

    def skip(self, push_id: int) -> None:
        """Marks ``push_id`` decided without a push: its step ended for good without
        pushing, so no push of it will come. Nothing is counted (``pushes`` still sums
        the kinds); a no-op for an id already decided."""
        if not self.seen(push_id):
            self._decide(push_id)

    def forget(self, below: int) -> None:
        """Every step with an id below ``below`` ended (the coordinator said so): no push
        of them comes again, so their decisions are let go (at most the running
        steps' are kept)."""
        if any(i < below for i in self.decisions):
            self.decisions = {i: d for i, d in self.decisions.items() if i >= below}

    @property
    def watermark(self) -> int:
        """Every id below it is decided."""
        return self._watermark

    def _decide(self, push_id: int) -> None:
        self._decided.add(push_id)
        while self._watermark in self._decided:
            self._decided.discard(self._watermark)
            self._watermark += 1

    def summary(self) -> dict[str, Any]:
        """``{"pushes", "applied", "stale", "backup", "duplicate", "failed",
        "staleness"}``."""
        return {"pushes": self.pushes, **self.counts,
                "staleness": dict(sorted(self.staleness.items()))}

    # -- checkpoints -------------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The ledger as fixed-shape int32 arrays (see :meth:`from_arrays`)."""
        hist = np.zeros(HISTOGRAM_BINS, np.int32)
        for s, n in self.staleness.items():
            hist[min(max(s, 0), HISTOGRAM_BINS - 1)] += n
        above = sorted(self._decided)[-WINDOW:]
        window = np.full(WINDOW, -1, np.int32)
        window[:len(above)] = above
        counts = np.array([self.counts[k] for k in KINDS], np.int32)
        return {"counts": counts, "staleness": hist,
                "watermark": np.array(self._watermark, np.int32), "window": window}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> Ledger:
        led = cls()
        counts = np.asarray(arrays["counts"]).tolist()
        # (a ledger saved before ``failed`` existed has one count fewer: none failed)
        led.counts.update(zip(KINDS, (int(c) for c in counts)))
        for s, n in enumerate(np.asarray(arrays["staleness"]).tolist()):
            if n:
                led.staleness[s] = int(n)
        led._watermark = int(np.asarray(arrays["watermark"]))
        led._decided = {int(i) for i in np.asarray(arrays["window"]).tolist() if i >= 0}
        return led
