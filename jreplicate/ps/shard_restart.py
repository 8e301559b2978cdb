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
which no shard applied: :class:`jreplicate.ps.fate.record.StepRecord`, saved with the
state and restored with it, so a job restored from a later state knows the skipped
steps before it). Only a lost shard is restarted (a live one rolled back alone would
fall behind the others: ``strategy.restore(state)`` restores them all), and the saved
state is checked first, so a refused call changes nothing: its pieces and its
optimizer state's structure, shapes and dtypes; that it was saved on this job's
timeline (not on one a ``restore`` went back from, whose shard would bring back
updates of steps the job ran again under the same ids); and within the history the
record keeps (the last :data:`jreplicate.ps.fate.record.HISTORY` step ids). No step
is pending then, so no push of an id below the next step's will come: the restarted
shard's ledger decides (uncounted, :meth:`jreplicate.ps.fate.ledger.Ledger.skip`) the lost
ids and the ids skipped since the save, so that its watermark moves on. Which updates
are lost, and whether a state may restart a shard at all, is decided by the pure
functions of :mod:`jreplicate.ps.fate.restart`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jreplicate._tree import host_copy
from jreplicate.ps.fate.ledger import Ledger
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
