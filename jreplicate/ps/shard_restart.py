"""Restarting one lost parameter-server shard from a saved state
(:meth:`jreplicate.ParameterServerStrategy.restart_shard`).

A lost shard stops training (:class:`jreplicate.ps.ParameterServerError`): its parameters
are gone. Where the user asks, the shard comes back from a state saved earlier
(``strategy.state()``, e.g. through :class:`jreplicate.CheckpointManager`) while the
other shards keep theirs, and training goes on. Asynchronous training only: a
token-gated job's shards must agree on ``global_step``, so it restores every shard
(``strategy.restore(state)``).

What the restarted shard holds: its parameters, optimizer state, step and ledger as
saved. The updates it applied after the save are gone with it, while the other shards
still hold theirs; nothing is re-applied behind the user's back. The
:class:`ShardRestart` report names them: the ids of the steps that completed since
(the coordinator's record) or that another shard decided, which the restarted
shard's ledger has not decided, less the steps that ended without a push (skipped,
which no shard applied: :class:`jreplicate.ps.step_record.StepRecord`, saved with the
state and restored with it, so a job restored from a later state knows the skipped
steps before it). Only a lost shard is restarted (a live one rolled back alone would
fall behind the others: ``strategy.restore(state)`` restores them all), and the saved
state is checked first, so a refused call changes nothing: its pieces and its
optimizer state's structure, shapes and dtypes; that it was saved on this job's
timeline (not on one a ``restore`` went back from, whose shard would bring back
updates of steps the job ran again under the same ids); and within the history the
record keeps (the last :data:`jreplicate.ps.step_record.HISTORY` step ids). No step
is pending then, so no push of an id below the next step's will come: the restarted
shard's ledger decides (uncounted, :meth:`jreplicate.ps.ledger.Ledger.skip`) the lost
ids and the ids skipped since the save, so that its watermark moves on.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jreplicate._tree import host_copy
from jreplicate.ps import step_record
from jreplicate.ps.ledger import Ledger
from jreplicate.ps.step_record import StepRecord, epoch_token
from jreplicate.sync.state import SyncReplicasState


class ShardRestart(NamedTuple):
    """What :meth:`jreplicate.ParameterServerStrategy.restart_shard` did.

    Attributes:
      shard: the restarted shard.
      step: its step, as saved (updates it has applied).
      lost: the step ids whose updates the restarted shard no longer has (steps that
        completed, or that another shard decided, after the saved state), ascending;
        their updates are missing from its part of the parameters.
    """

    shard: int
    step: int
    lost: tuple[int, ...]


def host_shard_state(sh: dict[str, Any]) -> dict[str, Any]:
    """One shard's saved state (``strategy.state()["shards"][i]``) as the carriers
    build a shard from: numpy pytrees, the step as an int, the :class:`Ledger`."""
    return {"params": jax.tree.map(host_copy, sh["params"]),
            "opt_state": jax.tree.map(host_copy, sh["opt_state"]),
            "step": int(np.asarray(sh["step"])),
            "ledger": Ledger.from_arrays(sh["ledger"])}


def _decided(led: dict[str, Any], start: int, stop: int) -> set[int]:
    """The ids in ``[start, stop)`` a ledger (its arrays) decided, plus its window."""
    wm = int(np.asarray(led["watermark"]))
    window = {int(x) for x in np.asarray(led["window"]).tolist() if x >= 0}
    return set(range(start, min(wm, stop))) | window


def lost_updates(restored: dict[str, Any], live: list[dict[str, Any]], record: StepRecord,
                 stop: int) -> tuple[int, ...]:
    """The ids below ``stop`` (the next step's; none running) whose update the restarted
    shard lacks: decided by none of the ids of its ledger ``restored`` (arrays), and
    completed (``record``) or decided by one of the ``live`` shards (ledger arrays),
    and not skipped (the ledgers decide a skipped id uncounted). Ascending.

    ``restored``'s watermark is at least ``record.history_start``
    (:func:`check_history`): whether each id was skipped is known."""
    start = int(np.asarray(restored["watermark"]))
    mine = _decided(restored, start, start)
    theirs = [_decided(o, start, stop) for o in live]
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
            f"{step_record.HISTORY} step ids and {step_record.EPOCHS} restores), so "
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


def check_same_aggregation(i: int, saved_opt: Any, job_opt: Any, who: str) -> None:
    """A token-gated state (``jr.sync_replicas``) was saved by a job that hands out as
    many tokens per step as this one. ``TokenQueue.per_step`` is
    ``max(total_num_replicas, replicas_to_aggregate)`` of the job that made it; restored
    into a job aggregating more, its token queue would run dry (training stopped later
    with a StepCancelledError that blamed the schedule), into one aggregating fewer it
    would hand out tokens no step needs.

    Args:
      i: the shard whose saved optimizer state is ``saved_opt``.
      job_opt: the optimizer state this job's transformation made (concrete).
      who: what the message starts with.

    Raises:
      ValueError: naming both counts and the fix.
    """
    mine, theirs = _tokens_per_step(job_opt), _tokens_per_step(saved_opt)
    if mine is None or theirs is None or mine == theirs:
        return
    raise ValueError(
        f"{who}: shard {i}'s state was saved by a job whose jr.sync_replicas hands out "
        f"{theirs} tokens per step (max(total_num_replicas, replicas_to_aggregate)), this "
        f"job's {mine}: its token queue would not match this job's aggregation. Restore "
        "into a job with the replicas_to_aggregate and total_num_replicas it was saved "
        "with.")


def _tokens_per_step(opt_state: Any) -> int | None:
    """``TokenQueue.per_step`` of the first ``SyncReplicasState`` in ``opt_state`` (None:
    none there)."""
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SyncReplicasState)):
        if isinstance(s, SyncReplicasState):
            return int(np.asarray(s.tokens.per_step))
    return None


def check_shard_state(i: int, saved: dict[str, Any], expected: dict[str, Any],
                      opt_spec: Any = None, caller: str | None = None) -> None:
    """The saved pieces of shard ``i`` have the keys, shapes and dtypes it holds, and
    its optimizer state the structure, shapes and dtypes of ``opt_spec`` (the
    transformation's ``init`` of those pieces, as ``jax.eval_shape`` gives it).

    Args:
      caller: what the messages start with (default ``restart_shard(i, state)``).

    Raises:
      ValueError: naming the piece or the optimizer state's leaf, and the fix.
    """
    who = caller or f"restart_shard({i}, state)"
    got = saved["params"]
    if set(got) != set(expected):
        raise ValueError(
            f"{who}: the state's shard {i} holds {sorted(got)}, this "
            f"strategy's shard {i} {sorted(expected)}; pass a state saved by this job "
            "(strategy.state(), same num_ps and placement).")
    for k, v in expected.items():
        a = np.asarray(got[k])
        if a.shape != v.shape or a.dtype != v.dtype:
            raise ValueError(
                f"{who}: piece {k!r} is {a.dtype}{list(a.shape)} in the "
                f"state, {v.dtype}{list(v.shape)} here; pass a state saved by this job.")
    if opt_spec is None:
        return
    want, want_def = jax.tree_util.tree_flatten_with_path(opt_spec)
    got, got_def = jax.tree_util.tree_flatten(saved["opt_state"])
    if want_def != got_def:
        raise ValueError(
            f"{who}: the state's opt_state of shard {i} is {got_def}, "
            f"this strategy's optimizer makes {want_def}; pass a state saved by this job "
            "(same optimizer).")
    for (path, spec), leaf in zip(want, got):
        a = np.asarray(leaf)
        if a.shape != spec.shape or a.dtype != spec.dtype:
            raise ValueError(
                f"{who}: opt_state{jax.tree_util.keystr(path)} of shard {i} is "
                f"{a.dtype}{list(a.shape)} in the state, {spec.dtype}{list(spec.shape)} "
                "here; pass a state saved by this job (same optimizer and dtypes).")
