"""``ParameterServerStrategy.state()`` and ``restore(state)``: what a saved state
holds, read back and checked before anything is replaced.

A state is ``{"shards": [each shard's state and ledger], "next_step_id": int32,
"steps": the record of the job's steps}`` (:mod:`jreplicate.ps.fate.record`),
``"names": uint32[leaves]``}, all NumPy, for :class:`jreplicate.CheckpointManager`. It is
taken only while no step is scheduled or running and every shard is at one step, so a
restore never keeps a push that reached some shards only.

The shards key their pieces by the leaf's position (``"0"``, ``"3:0:128"``), so
``"names"`` keeps a CRC-32 of each parameter's path (``"['w']"``) in flattening order:
a state restored into parameters renamed or reordered (``{"a", "b"}`` saved, ``{"b",
"z"}`` restored, same shapes) is refused instead of putting ``a``'s values into ``b``.
A state without it (saved before it was recorded) is not checked.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np

from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.fate.record import StepRecord
from jreplicate.ps.handle import Carrier
from jreplicate.ps.placement import Placement
from jreplicate.ps.shard_restart import (
    check_same_aggregation,
    check_shard_state,
    host_shard_state,
)


def names(placement: Placement) -> np.ndarray:
    """The CRC-32 of each parameter's rendered path, in flattening order (``"names"``)."""
    paths = {p.leaf: p.path for p in placement.parts}
    return np.array([zlib.crc32(paths[i].encode()) for i in range(len(paths))], np.uint32)


def check_names(state: dict[str, Any], placement: Placement, caller: str) -> None:
    """Raises when ``state`` records parameter names (``"names"``) other than this job's.

    Raises:
      ValueError: a parameter was renamed, added, removed or moved, naming the first
        leaf that differs and the fix.
    """
    saved = state.get("names") if isinstance(state, dict) else None
    if saved is None:
        return  # a state saved before names were recorded
    saved, here = np.asarray(saved).reshape(-1), names(placement)
    if saved.shape == here.shape and np.array_equal(saved, here):
        return
    paths = {p.leaf: p.path for p in placement.parts}
    first = next((i for i in range(min(len(saved), len(here))) if saved[i] != here[i]),
                 min(len(saved), len(here)))
    where = (f"parameter {first} in flattening order is {paths[first] or 'the root'} here, "
             "and was saved under another name" if first < len(here) else
             f"the state has {len(saved)} parameters, this job {len(here)}")
    raise ValueError(
        f"{caller}: the state's parameters are not this job's: {where} (the shards keep "
        "parameters by position, so restoring would put each saved value into whatever "
        "parameter is at its position). Restore into a job whose parameters have the "
        "names, order and shapes they were saved with (rename them back, or convert the "
        "state by position yourself).")


def snapshot(coordinator: Coordinator, carrier: Carrier, num_ps: int, token_gated: bool,
             next_id: int, placement: Placement | None = None) -> dict[str, Any]:
    """Every shard's state and ledger, taken while no step is scheduled or running
    (so no push moves a shard between two shards' reads), with the parameters' names
    (``"names"``) when ``placement`` is given.

    Raises:
      RuntimeError: steps are scheduled or running (call ``rep.join()`` first), a
        step's push is on some shards only, or the shards are not at one step
        (token-gated).
    """
    c = coordinator
    pending = c.pending
    if pending:
        raise RuntimeError(
            f"ParameterServerStrategy.state(): {pending} steps are scheduled or running, "
            "so the shards may be at different steps. Call rep.join() first, then "
            "state().")
    shards = [carrier.shard_state(i) for i in range(num_ps)]
    if c.pending:
        raise RuntimeError(
            "ParameterServerStrategy.state(): steps were scheduled while the shards "
            "were read; call rep.join() first and schedule no steps meanwhile.")
    if c.half_applied:
        sid, why = next(iter(c.half_applied.items()))
        raise RuntimeError(
            f"ParameterServerStrategy.state(): the shards disagree (step {sid}'s push "
            f"is on some shards only: {why}); saving them would keep it. Restore the "
            "last checkpoint with strategy.restore(state).")
    steps = [int(sh["step"]) for sh in shards]
    if token_gated and len(set(steps)) > 1:
        raise RuntimeError(
            f"ParameterServerStrategy.state(): the shards are at global steps {steps}; "
            "a push is half committed (a worker lost mid-push whose step never ran "
            "again). Restore the last checkpoint.")
    state = {"shards": shards, "next_step_id": np.array(next_id, np.int32),
             "steps": c.record.to_arrays(next_id)}
    if placement is not None:
        state["names"] = names(placement)
    return state


def read_state(state: dict[str, Any], num_ps: int) -> tuple[list[dict], int, StepRecord]:
    """``restore(state)``'s state read back: each shard's state on the host, the next
    step id and the record of the steps.

    Raises:
      ValueError: ``state`` is not a ``strategy.state()``, or has another number of
        shards.
    """
    try:
        shards, next_id = state["shards"], int(np.asarray(state["next_step_id"]))
        if len(shards) != num_ps:
            raise ValueError(f"restore: the state has {len(shards)} shards, this "
                             f"strategy {num_ps}; restore with the same num_ps.")
        restored = [host_shard_state(sh) for sh in shards]
        # (a state saved before the record was: the ids before it are all ended,
        # which of them were skipped is unknown)
        record = StepRecord.from_arrays(state["steps"], next_id) if "steps" in state \
            else StepRecord(next_id)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(
            f"restore(state): the state is not a strategy.state() ({type(e).__name__}: "
            f"{e}); pass what ParameterServerStrategy.state() returned (e.g. restored "
            "by a CheckpointManager).") from None
    return restored, next_id, record


def check_restorable(restored: list[dict], here: list, tx: Any, opt_host: Any) -> None:
    """Each restored shard matches this job's piece of the parameters (``here``) and
    optimizer (``tx``, the registered state ``opt_host``).

    Raises:
      ValueError: a shard's state does not match, naming the piece or the leaf.
    """
    for i, r in enumerate(restored):
        check_shard_state(i, r, here[i], jax.eval_shape(tx.init, here[i])
                          if here[i] else None, caller="restore(state)")
        if here[i]:
            check_same_aggregation(i, r["opt_state"], opt_host, "restore(state)")
