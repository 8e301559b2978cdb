"""A worker's view of the shards: pull all pieces, push to every shard (both carriers).

``shards`` are objects with the methods of :class:`jreplicate.ps.shard.PSShard`
(``pull``, ``push``, ``record``, ``take_token``, ``return_token``): the shards
themselves in the embedded carrier, proxies of Ray actors in the Ray carrier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jreplicate.ps.placement import Placement
from jreplicate.ps.shard import Decision


class ShardClient:
    """Pulls and pushes whole parameter pytrees through a :class:`Placement`.

    Args:
      shards: one object per shard with :class:`PSShard`'s methods.
      placement: how the parameters are split over the shards.
      token_gated: whether shard 0 decides which pushes count (token-gated mode).
      between_shards: called with 1 after shard 0's push, before the others' (a test
        hook to simulate a worker dying mid-push).
    """

    def __init__(self, shards: Sequence[Any], placement: Placement, token_gated: bool,
                 between_shards: Callable[[int], None] | None = None):
        self.shards = list(shards)
        self.placement = placement
        self.token_gated = token_gated
        self.between_shards = between_shards
        #: Push to shard 0 first, then call ``between_shards``, then the others (always
        #: in token-gated mode; in asynchronous mode only when a test arms it).
        self.ordered = False

    def _fan(self, calls: list[tuple[Any, str, tuple]]) -> list:
        """Calls ``getattr(shard, name)(*args)`` for each call; concurrently where the
        shards are remote (proxies with ``submit`` and ``gather``, e.g. Ray actors)."""
        if calls and hasattr(calls[0][0], "submit"):
            return calls[0][0].gather([s.submit(name, *args) for s, name, args in calls])
        return [getattr(s, name)(*args) for s, name, args in calls]

    def pull(self) -> tuple[list[int], Any]:
        """``(step of each shard, parameters as a numpy pytree)``."""
        got = self._fan([(s, "pull", ()) for s in self.shards])
        return [g[0] for g in got], self.placement.join([g[1] for g in got])

    def push(self, push_id: int, worker: int, fetched: Sequence[int], grads: Any,
             attempt: int = 0) -> Decision:
        """Pushes ``grads`` (a numpy pytree like the parameters) to every shard.

        Asynchronous mode: each shard applies its pieces (``fetched[i]``: the step of
        shard ``i`` when the parameters were pulled). Token-gated mode (``fetched[0]``
        is the worker's ``local_step``): the pieces are staged on the other shards, shard
        0 decides, and its decision is committed on the others (:meth:`settle`).

        Returns:
          Shard 0's decision.
        """
        pieces = self.placement.split(grads)
        if not self.token_gated and not self.ordered:  # no order needed: all at once
            got = self._fan([(s, "push", (push_id, worker, int(fetched[i]), pieces[i]))
                             for i, s in enumerate(self.shards)])
            return got[0]
        rest = self.shards[1:]
        if self.token_gated:
            self._fan([(s, "stage", (push_id, attempt, pieces[i]))
                       for i, s in enumerate(rest, 1)])
        first = self.shards[0].push(push_id, worker, int(fetched[0]), pieces[0], None,
                                    attempt)
        if rest and self.between_shards is not None:
            self.between_shards(1)
        if self.token_gated:
            self.settle(push_id, first)
        else:
            self._fan([(s, "push", (push_id, worker, int(fetched[i]), pieces[i]))
                       for i, s in enumerate(rest, 1)])
        return first

    def settle(self, push_id: int, decision: Decision | None = None) -> None:
        """Token-gated: commits shard 0's decision for ``push_id`` on the other shards
        (their staged pieces) and tells shard 0 the steps they reached, which releases
        the next step's tokens. The coordinator calls it for a worker lost mid-push (the
        decision is then read from shard 0; nothing happens if there is none)."""
        if not self.token_gated or len(self.shards) == 1:
            return
        if decision is None:
            decision = self._fan([(self.shards[0], "decision", (push_id,))])[0]
            if decision is None:
                return
        steps = self._fan([(s, "commit", (push_id, decision)) for s in self.shards[1:]])
        if decision.kind == "applied" and max(steps) > decision.step:
            self._fan([(self.shards[0], "ack", (steps,))])


def to_numpy(tree: Any) -> Any:
    """A numpy copy of a pytree of arrays."""
    import jax
    return jax.tree.map(np.asarray, tree)
