"""What the coordinator knows of the pushes of the steps that ended (private).

A step ends with its push decided by every shard (it completed), without a push (its
function raised, its token wait was cancelled, it was not run): then it is *skipped* on
every shard so that the ledgers' watermarks move past its id, or, after a worker was
lost in the middle of its push, with its push on some shards only: then the shards'
parameters disagree and training must stop (asynchronous mode pushes to each shard on
its own). :class:`StepRecord` keeps those records and tells the coordinator which case
an ending step is; the coordinator acts on it under its own lock.
"""

from __future__ import annotations

from typing import NamedTuple

from jreplicate.ps.ledger import Ledger
from jreplicate.ps.remote import ParameterServerError


class Fate(NamedTuple):
    """What the shards said of a step's push after its worker was lost in it."""

    kind: str  # "half" (some decided it, some not), "all" (every shard), "unknown"
    decided: list[int]
    not_decided: list[int]
    silent: list[int]  # shards that did not answer


class StepRecord:
    """The coordinator's record of ended steps (not thread-safe: under its lock).

    Attributes:
      completed_ids: the ids of the steps that completed (each shard decided their
        pushes), and of those skipped (decided without a count): what a shard restarted
        from an older state may have lost (see :mod:`jreplicate.ps.shard_restart`).
      skipped: the ids of the steps skipped (ended for good without a push): no shard
        applied them, so a shard restarted from an older state lost nothing of them
        (one int per such step, not per step).
      half_applied: ``{step id: message}`` of the steps that ended with their push on
        some shards only (``state()`` refuses to save such shards).
    """

    def __init__(self):
        self.completed_ids = Ledger()
        self.skipped: set[int] = set()
        self.half_applied: dict[int, str] = {}
        self._fates: dict[int, Fate] = {}

    def completed(self, step_id: int) -> None:
        """Step ``step_id`` pushed to every shard (a run of it succeeded)."""
        self._fates.pop(step_id, None)
        self.completed_ids.record(step_id, "applied")

    def skip(self, step_id: int) -> None:
        """Step ``step_id`` ended for good and no shard holds its push: recorded
        skipped (the caller skips it on the shards)."""
        self.skipped.add(step_id)
        self.completed_ids.skip(step_id)

    def note_fate(self, step_id: int, answers: list[bool | None] | None) -> None:
        """What the shards said of step ``step_id``'s push after its worker was lost in
        it (``answers``: :meth:`jreplicate.ps.client.ShardClient.decided`, or None)."""
        self._fates.pop(step_id, None)
        if answers is None:
            self._fates[step_id] = Fate("unknown", [], [], [])
            return
        yes = [i for i, a in enumerate(answers) if a]
        no = [i for i, a in enumerate(answers) if a is False]
        silent = [i for i, a in enumerate(answers) if a is None]
        if yes and no:
            self._fates[step_id] = Fate("half", yes, no, silent)
        elif silent:
            self._fates[step_id] = Fate("unknown", yes, no, silent)
        elif yes:
            self._fates[step_id] = Fate("all", yes, no, silent)

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
            self.completed_ids.record(step_id, "applied")  # its update is on every shard
            return False
        if fate is None and resolved:
            self.skip(step_id)
            return True
        return False

    def _half_applied(self, step_id: int, fate: Fate, error: BaseException
                      ) -> ParameterServerError:
        silent = f" (shard(s) {fate.silent} did not answer)" if fate.silent else ""
        err = ParameterServerError(
            f"step {step_id} ended for good ({type(error).__name__}: {error}) after a "
            "worker was lost in the middle of its push, and no later run pushed it again: "
            f"shard(s) {fate.decided} decided its push (applied or dropped it) and "
            f"shard(s) {fate.not_decided} never received it{silent}, so the shards' "
            "parameters disagree. Training stops; restore the last checkpoint with "
            "strategy.restore(state).")
        err.__cause__ = error
        self.half_applied[step_id] = str(err)
        return err
