"""The fate of every push, as pure modules (no threads, no locks, no JAX, no I/O).

* :mod:`jreplicate.ps.fate.decision`: shard 0's :class:`Decision` of a push and the
  book a shard keeps of the pushes it received (staged, committed, fed in order).
* :mod:`jreplicate.ps.fate.ledger`: each shard's :class:`Ledger` of what became of every
  push (checkpointed with the shard).
* :mod:`jreplicate.ps.fate.record`: the driver's :class:`StepRecord` of the steps that
  ended (completed, skipped, half applied; the epochs of the job's history).
* :mod:`jreplicate.ps.fate.reconcile`: after a worker or a shard was lost, which steps
  are applied, half applied or to skip.
* :mod:`jreplicate.ps.fate.restart`: the pushes a restarted shard lost.
"""

from jreplicate.ps.fate.decision import (
    FORGET,
    SKIPPED,
    Counters,
    Decision,
    ShardBook,
    TokenRelease,
    driver_decision,
    needs_ack,
)
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.fate.reconcile import (
    Fate,
    decided_ids,
    half_applied_error,
    ids_to_ask,
    judge_live,
    push_fate,
    shard_lost_error,
)
from jreplicate.ps.fate.record import StepRecord, epoch_token
from jreplicate.ps.fate.restart import check_history, lost_updates, settle_restart

__all__ = [
    "FORGET",
    "SKIPPED",
    "Counters",
    "Decision",
    "Fate",
    "Ledger",
    "ShardBook",
    "StepRecord",
    "TokenRelease",
    "check_history",
    "decided_ids",
    "driver_decision",
    "epoch_token",
    "half_applied_error",
    "ids_to_ask",
    "judge_live",
    "lost_updates",
    "needs_ack",
    "push_fate",
    "settle_restart",
    "shard_lost_error",
]
