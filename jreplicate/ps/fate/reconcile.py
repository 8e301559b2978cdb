"""Reconciliation after a loss: what became of a push when a worker or a shard was lost.

Pure functions of what the shards answered (no threads, no I/O): the coordinator and
the executor ask the shards, then call these to learn which steps are applied (by every
shard), half applied (by some shards only: the shards' parameters disagree, training
stops), or to skip (decided by no shard: each ledger decides the id uncounted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jreplicate.ps.remote import ParameterServerError

#: The answers of the shards to ``decided(push_id)``: True, False, or None (no answer:
#: lost or closed).
Answers = Sequence[bool | None]


class Fate(NamedTuple):
    """What the shards said of a step's push after its worker was lost in it.

    Attributes:
      kind: ``"half"`` (some shards decided it, some not), ``"all"`` (every shard), or
        ``"unknown"`` (a shard did not answer, or nobody could be asked).
      decided: the shards that decided it.
      not_decided: the shards that did not.
      silent: the shards that did not answer.
    """

    kind: str
    decided: list[int]
    not_decided: list[int]
    silent: list[int]


def push_fate(answers: Answers | None) -> Fate | None:
    """The fate of a lost worker's push from every shard's ``answers`` (None: the
    shards could not be asked). None: no shard decided it (its step may be skipped)."""
    if answers is None:
        return Fate("unknown", [], [], [])
    yes = [i for i, a in enumerate(answers) if a]
    no = [i for i, a in enumerate(answers) if a is False]
    silent = [i for i, a in enumerate(answers) if a is None]
    if yes and no:
        return Fate("half", yes, no, silent)
    if silent:
        return Fate("unknown", yes, no, silent)
    if yes:
        return Fate("all", yes, no, silent)
    return None


def half_applied_error(step_id: int, fate: Fate, error: BaseException
                       ) -> ParameterServerError:
    """The error with which training stops: step ``step_id`` ended for good (``error``)
    with its push on some shards only (``fate``)."""
    silent = f" (shard(s) {fate.silent} did not answer)" if fate.silent else ""
    err = ParameterServerError(
        f"step {step_id} ended for good ({type(error).__name__}: {error}) after a "
        "worker was lost in the middle of its push, and no later run pushed it again: "
        f"shard(s) {fate.decided} decided its push (applied or dropped it) and "
        f"shard(s) {fate.not_decided} never received it{silent}, so the shards' "
        "parameters disagree. Training stops; restore the last checkpoint with "
        "strategy.restore(state).")
    err.__cause__ = error
    return err


def shard_lost_error(e: BaseException) -> ParameterServerError:
    """The error with which training stops after a shard failed with ``e``."""
    err = ParameterServerError(
        f"a parameter-server shard failed ({type(e).__name__}: {e}); the parameters it "
        "held are gone, so training stops. Restore the last checkpoint "
        "(strategy.restore(...)), or restart the lost shard from it "
        "(strategy.restart_shard(i, state)).")
    err.__cause__ = e
    return err


# -- the live shards when a lost one restarts --------------------------------------------
def decided_ids(led: dict[str, Any], start: int, stop: int) -> set[int]:
    """The ids in ``[start, stop)`` a ledger (its arrays: ``Ledger.to_arrays``) decided."""
    wm = int(np.asarray(led["watermark"]))
    window = {int(x) for x in np.asarray(led["window"]).tolist() if start <= x < stop}
    return set(range(start, min(wm, stop))) | window


def ids_to_ask(live: Iterable[dict[str, Any]], lo: int, hi: int,
               was_skipped: Callable[[int], bool | None],
               completed: Callable[[int], bool]) -> list[int]:
    """The ids in ``[lo, hi)`` whose fate the live shards' ledgers (arrays) leave open:
    decided by some live shards and not others (and not skipped), or by none (and not
    completed). A ledger's saved window may be short, so the shards are asked of each
    (:func:`judge_live`)."""
    sets = [decided_ids(led, lo, hi) for led in live]
    union = set().union(*sets)
    some = sorted(p for p in union if not was_skipped(p) and any(p not in d for d in sets))
    none = [p for p in range(lo, hi) if p not in union and not completed(p)]
    return some + none


def judge_live(answers: Answers, live: Iterable[int], skipped: bool | None,
               completed: bool) -> tuple[str, list[int], list[int]]:
    """What the live shards' ``answers`` (indexed by shard) say of one id:
    ``("half", yes, no)``: on some live shards only (and not skipped: training cannot
    go on); ``("undecided", [], no)``: on none, and not completed (its step ended
    pushing nowhere: to skip); else ``("decided", yes, no)``."""
    live = list(live)
    yes = [j for j in live if answers[j]]
    no = [j for j in live if answers[j] is False]
    if yes and no and not skipped:
        return "half", yes, no
    if not yes and not completed:
        return "undecided", yes, no
    return "decided", yes, no
