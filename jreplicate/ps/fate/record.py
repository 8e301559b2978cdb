"""The driver's record: what the coordinator knows of the pushes of the steps that ended.

A step ends with its push decided by every shard (it completed), without a push (its
function raised, its token wait was cancelled, it was not run): then it is *skipped* on
every shard so that the ledgers' watermarks move past its id, or, after a worker was
lost in the middle of its push, with its push on some shards only: then the shards'
parameters disagree and training must stop (asynchronous mode pushes to each shard on
its own). :class:`StepRecord` keeps those records and tells the coordinator which case
an ending step is; the coordinator acts on it under its own lock.

Every record is bounded, however long the job runs:

* the ended ids: a watermark (every id below it ended) and the ended ids above it, as
  the shards' ledgers keep them (:class:`jreplicate.ps.fate.ledger.Ledger`);
* which ended ids were skipped: one bit per id for the last :data:`HISTORY` ids (and
  the ids still running), what ``restart_shard`` needs to tell a lost update from a
  skipped step: a state saved further back is refused there;
* the *epochs* of the job's history: the stretches of step ids between two
  ``restore``\\ s, each with a random token. After ``restore(state)`` the ids from the
  state's next step on are given to new steps, so one id may name two steps of two
  timelines; a state whose last step's epoch is not this job's was saved on a timeline
  ``restore`` left, and ``restart_shard`` refuses it (its shard would bring back
  updates this job never made);
* the fates of the pushes of lost workers, and the steps given up half pushed: one
  entry per running step (training stops at a half-pushed one).

The record is saved with the state (:meth:`StepRecord.to_arrays`, fixed-shape arrays) and
restored from it (:meth:`StepRecord.from_arrays`): a job restored from a checkpoint
knows which steps before it were skipped, and on which timeline.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.fate.reconcile import Fate, half_applied_error, push_fate
from jreplicate.ps.remote import ParameterServerError

#: Step ids (back from the next one) whose fate the record keeps one bit of.
HISTORY = 1 << 16
#: Epochs of the history kept (a restore starts one).
EPOCHS = 32
#: Ended steps between two messages telling the shards which steps ended (they let go
#: of the decisions they keep for a rerun's push: :meth:`Ledger.forget`).
FORGET_EVERY = 256


def _token() -> int:
    """A random epoch token (31 bits: it is saved as an int32)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


class StepRecord:
    """The coordinator's record of ended steps (not thread-safe: under its lock).

    Args:
      start: the id of the job's first step (a restored state's next step id): every id
        below it ended.
      base: the first id whose skip bit is known (default ``start``).
      bits: the skip bits of the ids from ``base`` to ``start - 1`` (bit ``k``: id
        ``base + k`` was skipped).
      epochs: ``(first id, token)`` of the history's epochs before ``start``,
        ascending; a new epoch starts at ``start``.

    Attributes:
      completed_ids: the ids of the ended steps, those that completed (each shard
        decided their pushes) and those skipped, as a watermark and the ids above it:
        what a shard restarted from an older state may have lost (see
        :mod:`jreplicate.ps.fate.restart`).
      half_applied: ``{step id: message}`` of the steps that ended with their push on
        some shards only (``state()`` refuses to save such shards).
      epochs: ``[(first id, token)]``, ascending: the epochs of the history back to
        :attr:`history_start` (or further), the last one this job's.
    """

    def __init__(self, start: int = 0, *, base: int | None = None, bits: int = 0,
                 epochs: Any = ()):
        start = int(start)
        self.completed_ids = Ledger(watermark=start)
        self.half_applied: dict[int, str] = {}
        self._fates: dict[int, Fate] = {}
        self._base = start if base is None else int(base)
        self._bits = int(bits)  # bit k: id base + k was skipped
        self._top = start  # 1 + the highest id that ended (at least start)
        self._forgot = start  # the watermark the shards were last told of
        self.epochs = [(int(a), int(t)) for a, t in epochs if a < start]
        self.epochs = [*self.epochs, (start, _token())][-EPOCHS:]
        self._move_base(max(self._base, self.epochs[0][0]))

    # -- the steps' ends ---------------------------------------------------------------
    def completed(self, step_id: int) -> None:
        """Step ``step_id`` pushed to every shard (a run of it succeeded)."""
        self._fates.pop(step_id, None)
        self.completed_ids.record(step_id, "applied")
        self._ended(step_id)

    def skip(self, step_id: int) -> None:
        """Step ``step_id`` ended for good and no shard holds its push: recorded
        skipped (the caller skips it on the shards). A no-op for an id that ended."""
        if self.completed_ids.seen(step_id):
            return
        if step_id >= self._base:
            self._bits |= 1 << (step_id - self._base)
        self.completed_ids.skip(step_id)
        self._ended(step_id)

    def ended_below(self, stop: int) -> None:
        """No step below ``stop`` runs any more and those no shard decided were skipped
        (``restart_shard``): the others, ended while a shard was lost (the step's error
        left them undecided), are recorded completed (a live shard decided them)."""
        for step_id in range(self.completed_ids.watermark, stop):
            if not self.completed_ids.seen(step_id):
                self.completed(step_id)

    def _ended(self, step_id: int) -> None:
        if step_id >= self._top:
            self._top = step_id + 1
        lo = min(self.completed_ids.watermark, self._top - HISTORY)
        if lo - self._base >= max(HISTORY // 8, 1):  # (moved by chunks: a shift copies)
            self._move_base(lo)

    def _move_base(self, base: int) -> None:
        """Forgets the skip bits and epochs of the ids below ``base``."""
        if base > self._base:
            self._bits >>= base - self._base
            self._base = base
        while len(self.epochs) > 1 and self.epochs[1][0] <= self._base:
            del self.epochs[0]

    # -- what the record tells -----------------------------------------------------------
    @property
    def history_start(self) -> int:
        """The first id whose fate (skipped or not) the record knows."""
        return self._base

    def was_skipped(self, step_id: int) -> bool | None:
        """Whether ended step ``step_id`` was skipped (None: before
        :attr:`history_start`, unknown)."""
        if step_id < self._base:
            return None
        return bool(self._bits >> (step_id - self._base) & 1)

    @property
    def skipped(self) -> set[int]:
        """The ids of the skipped steps from :attr:`history_start` on."""
        b = self._bits
        return {self._base + k for k in range(b.bit_length()) if b >> k & 1}

    def token_at(self, step_id: int) -> int | None:
        """The token of the epoch of id ``step_id`` (None: before
        :attr:`history_start`)."""
        return _token_at(self.epochs, step_id) if step_id >= self._base else None

    def forget_due(self) -> int | None:
        """Every :data:`FORGET_EVERY` ended steps, the watermark of the ended ids (the
        shards may let go of what they keep for the steps below it); else None."""
        w = self.completed_ids.watermark
        if w - self._forgot < FORGET_EVERY:
            return None
        self._forgot = w
        return w

    # -- the fates of lost workers' pushes -----------------------------------------------
    def note_fate(self, step_id: int, answers: list[bool | None] | None) -> None:
        """What the shards said of step ``step_id``'s push after its worker was lost in
        it (``answers``: :meth:`jreplicate.ps.client.ShardClient.decided`, or None)."""
        self._fates.pop(step_id, None)
        fate = push_fate(answers)
        if fate is not None:
            self._fates[step_id] = fate

    def ended(self, step_id: int, error: BaseException, resolved: bool = True
              ) -> ParameterServerError | bool:
        """Step ``step_id`` ends for good without success (``error``).

        Returns:
          The :class:`ParameterServerError` naming the shards if a lost run of it pushed
          to some shards only (recorded in ``half_applied``: training must stop); else
          True if its id is to be skipped on every shard (recorded skipped): no run of
          it is known to have pushed and ``resolved`` (False: a shard was lost in the
          step, which the shards cannot all tell); else False (a lost run pushed to
          every shard, recorded completed, or its fate is unknown).
        """
        fate = self._fates.pop(step_id, None)
        if fate is not None and fate.kind == "half":
            return self._half_applied(step_id, fate, error)
        if fate is not None and fate.kind == "all":
            self.completed(step_id)  # its update is on every shard
            return False
        if fate is None and resolved:
            self.skip(step_id)
            return True
        return False

    def _half_applied(self, step_id: int, fate: Fate, error: BaseException
                      ) -> ParameterServerError:
        err = half_applied_error(step_id, fate, error)
        self.half_applied[step_id] = str(err)
        return err

    # -- checkpoints -------------------------------------------------------------------
    def to_arrays(self, stop: int) -> dict[str, np.ndarray]:
        """The history of the ids below ``stop`` (the next step's id; no step running)
        as fixed-shape arrays: ``history_start``, ``skipped`` (one bit per id from it,
        little-endian) and ``epochs`` (``(first id, token)`` rows, -1 after the last)."""
        base = max(self._base, stop - HISTORY)
        epochs = [e for k, e in enumerate(self.epochs) if e[0] < stop and (
            k + 1 == len(self.epochs) or self.epochs[k + 1][0] > base)][-EPOCHS:]
        if epochs:
            base = max(base, epochs[0][0])
        n = max(stop - base, 0)
        bits = (self._bits >> (base - self._base)) & ((1 << n) - 1)
        rows = np.full((EPOCHS, 2), -1, np.int32)
        if epochs:
            rows[:len(epochs)] = epochs
        return {"history_start": np.array(base, np.int32),
                "skipped": np.frombuffer(bits.to_bytes((HISTORY + 7) // 8, "little"),
                                         np.uint8).copy(),
                "epochs": rows}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], start: int) -> StepRecord:
        """The record of a job restored from a state whose next step id is ``start``
        (:meth:`to_arrays` of its record).

        Raises:
          ValueError: the arrays are not a record of ids below ``start``.
        """
        try:
            base = int(np.asarray(arrays["history_start"]))
            raw = np.asarray(arrays["skipped"])
            rows = np.asarray(arrays["epochs"]).reshape(-1, 2).tolist()
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"state['steps'] is not a step record ({type(e).__name__}: "
                             f"{e}); pass what strategy.state() returned.") from None
        epochs = [(int(a), int(t)) for a, t in rows if a >= 0]
        starts = [a for a, _ in epochs]
        if raw.dtype != np.uint8 or raw.ndim != 1 or not 0 <= base <= start or \
                start - base > 8 * raw.size or starts != sorted(set(starts)) or \
                any(a >= start for a in starts) or any(t < 0 for _, t in epochs):
            raise ValueError(
                f"state['steps'] is not the step record of a state whose next step is "
                f"{start} (history from {base}, {raw.dtype}{list(raw.shape)} skip bits, "
                f"epochs {epochs}); pass what strategy.state() returned.")
        bits = int.from_bytes(raw.tobytes(), "little") & ((1 << (start - base)) - 1)
        return cls(start, base=base, bits=bits, epochs=epochs)


def _token_at(epochs: list[tuple[int, int]], step_id: int) -> int | None:
    """The token of the last of ``epochs`` starting at or before ``step_id``."""
    token = None
    for first, t in epochs:
        if first > step_id:
            break
        token = t
    return token


def epoch_token(arrays: dict[str, Any], step_id: int) -> int | None:
    """The token of id ``step_id``'s epoch in a saved record (:meth:`StepRecord.to_arrays`;
    None: before its history)."""
    if step_id < int(np.asarray(arrays["history_start"])):
        return None
    rows = np.asarray(arrays["epochs"]).reshape(-1, 2).tolist()
    return _token_at([(int(a), int(t)) for a, t in rows if a >= 0], step_id)
