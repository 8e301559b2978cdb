"""How every process of a checkpoint manager agrees (private to jreplicate.checkpoint).

Functions of a :class:`~jreplicate.checkpoint.CheckpointManager` ``m`` (its
``_agreement``, ``is_chief`` and strategy): the chief's result given to everyone, every
process's outcome combined alike everywhere, the check that every process builds the
same state, and the broadcast of the chief's host values. Without an agreement (one
process) each is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate import _wire
from jreplicate.checkpoint.errors import CheckpointError
from jreplicate.checkpoint.tree import state_digest


def share(m: Any, chief_fn: Callable[[], tuple[Any, str | None]], what: str):
    """Runs ``chief_fn`` on the chief and gives its ``(value, error)`` to everyone."""
    value, err = chief_fn()
    if m._agreement is None:
        return value, err
    mine = {"value": value, "error": err} if m.is_chief else \
        {"value": None, "error": None}
    chief = m._agreement.exchange(mine, what, _wire.CHIEF_RESULT)[0]
    return chief["value"], chief["error"]


def agree(m: Any, kind: str, detail: str, what: str, *,
          chief_only: bool = False) -> tuple[str, str]:
    """Every process's outcome, combined alike everywhere: the first process's
    mismatch or error, else the first damage, else ok (``chief_only``: the chief's)."""
    if m._agreement is None:
        return kind, detail
    outcomes = m._agreement.exchange({"kind": kind, "detail": detail}, what,
                                        _wire.CHECKPOINT_OUTCOME)
    if chief_only:
        return outcomes[0]["kind"], outcomes[0]["detail"]
    for wanted in (("mismatch", "error"), ("damaged",)):
        for p, o in enumerate(outcomes):
            if o["kind"] in wanted:
                named = o["detail"] if p == 0 or o["kind"] == "mismatch" else \
                    f"process {p}: {o['detail']}"
                return o["kind"], named
    return "ok", ""


def check_same_state(m: Any, host: Any) -> None:
    """Raises on every process alike when init_fn() builds another structure, shape
    or dtype on some process (the broadcast would otherwise hang or fail on one)."""
    if m._agreement is None:
        return
    digests = m._agreement.all_gather(state_digest(host).encode(),
                                         "init_fn()'s state")
    others = [p for p, d in enumerate(digests) if d != digests[0]]
    if others:
        raise CheckpointError(
            f"restore_or_initialize: init_fn() builds another state on process "
            f"{others[0]} than on process 0 (other paths, shapes or dtypes); every "
            "process must build the same state (the same model and optimizer).")


def broadcast(m: Any, host: Any) -> Any:
    if m._strategy.num_processes == 1:
        return host
    from jax.experimental import multihost_utils
    leaves, treedef = jax.tree.flatten(host)
    # As bytes: the broadcast sums the chief's values with the others' zeros, which
    # would turn -0.0 into +0.0 (and may change a NaN's payload); bytes sum exactly.
    raw = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves]
    raw = multihost_utils.broadcast_one_to_all(raw)
    return jax.tree.unflatten(treedef, [
        np.asarray(r, np.uint8).view(x.dtype).reshape(np.shape(x))
        for r, x in zip(raw, leaves, strict=True)])
