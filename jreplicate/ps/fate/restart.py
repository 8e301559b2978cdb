"""Lost pushes at the restart of a shard (:meth:`jreplicate.ParameterServerStrategy.restart_shard`).

Pure functions of the saved ledgers and the coordinator's record
(:class:`jreplicate.ps.fate.record.StepRecord`): whether a saved state may restart a
shard (:func:`check_history`), which updates the restarted shard lost
(:func:`lost_updates`), and how the record and the restarted shard's ledger are brought
up to the job's next step (:func:`settle_restart`). See :mod:`jreplicate.ps.shard_restart`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from jreplicate.ps.fate import record as record_module
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.fate.reconcile import decided_ids
from jreplicate.ps.fate.record import StepRecord, epoch_token


def lost_updates(restored: dict[str, Any], live: list[dict[str, Any]], record: StepRecord,
                 stop: int) -> tuple[int, ...]:
    """The ids below ``stop`` (the next step's; none running) whose update the restarted
    shard lacks: decided by none of the ids of its ledger ``restored`` (arrays), and
    completed (``record``) or decided by one of the ``live`` shards (ledger arrays),
    and not skipped (the ledgers decide a skipped id uncounted). Ascending.

    ``restored``'s watermark is at least ``record.history_start``
    (:func:`check_history`): whether each id was skipped is known."""
    start = int(np.asarray(restored["watermark"]))
    mine = decided_ids(restored, start, stop)
    theirs = [decided_ids(o, start, stop) for o in live]
    seen = record.completed_ids.seen
    return tuple(p for p in range(start, stop) if p not in mine and not record.was_skipped(p)
                 and (seen(p) or any(p in d for d in theirs)))


def check_history(i: int, state: dict[str, Any], record: StepRecord, next_id: int) -> None:
    """``restart_shard(i, state)``: ``state`` was saved on this job's timeline (before its
    next step ``next_id``, in the epoch this job's ``record`` gives that step), within the
    history ``record`` keeps (so that the updates shard ``i`` loses can all be named).

    Raises:
      ValueError: naming why, and the fix (``strategy.restore(state)``).
    """
    who = f"restart_shard({i}, state)"
    saved_next = int(np.asarray(state["next_step_id"]))
    if saved_next > next_id:
        raise ValueError(
            f"{who}: the state was saved when step {saved_next} was next, beyond this "
            f"job's next step {next_id} (it was restored from an older state since): its "
            "ledger has decided steps the job will run again, whose pushes it would drop. "
            "Restore every shard from that state with strategy.restore(state), or restart "
            "from an older one.")
    if "steps" not in state:
        raise ValueError(
            f"{who}: the state has no record of its steps (state['steps']: saved by an "
            f"earlier jreplicate), so the updates shard {i} would lose cannot be told from "
            "the steps that were skipped. Restore every shard from it with "
            "strategy.restore(state) (then a state() saved from there restarts shards).")
    watermark = int(np.asarray(state["shards"][i]["ledger"]["watermark"]))
    mine = record.token_at(saved_next - 1) if saved_next else None
    if min(watermark, saved_next) < record.history_start or (saved_next and mine is None):
        raise ValueError(
            f"{who}: the state was saved when step {saved_next} was next, before the "
            f"history this job keeps (from step {record.history_start}: the last "
            f"{record_module.HISTORY} step ids and {record_module.EPOCHS} restores), so "
            f"the updates shard {i} would lose cannot all be named. Restore every shard "
            "from it with strategy.restore(state), or restart from a later state.")
    if saved_next and epoch_token(state["steps"], saved_next - 1) != mine:
        raise ValueError(
            f"{who}: the state was saved on another timeline of this job: since it was "
            "saved, strategy.restore went back to an earlier state and new steps ran "
            f"under the same ids, so its shard {i} holds updates the other shards never "
            "had. Restart from a state saved on this timeline (since the last restore, or "
            "before the state it restored), or restore every shard from a state with "
            "strategy.restore(state).")


def settle_restart(record: StepRecord, ledger: Ledger, undecided: Iterable[int],
                   lost: Iterable[int], stop: int) -> None:
    """Brings ``record`` and the restarted shard's ``ledger`` up to ``stop`` (the next
    step's id; no step pending, every id below it ended): the ``undecided`` ids (no live
    shard decided them) are recorded skipped, the other ended ids completed (a live
    shard decided them); the restarted ledger decides, uncounted, the ids it ``lost``
    and those skipped since its save (no push of them will come), so that its watermark
    moves on. The caller skips the ``undecided`` ids on the live shards.

    The steps recorded half applied below ``stop`` are resolved: the live shards agree
    on each (the caller checked), and the restarted shard either lost its update
    (``lost``) or, as every shard, skips it; so they no longer keep ``state()`` from
    saving."""
    for pid in undecided:
        record.skip(pid)
    record.ended_below(stop)
    for pid in [p for p in record.half_applied if p < stop]:
        del record.half_applied[pid]
    gone = set(lost)
    for pid in range(ledger.watermark, stop):
        if pid in gone or record.was_skipped(pid):
            ledger.skip(pid)
