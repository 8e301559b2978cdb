"""A worker's view of the shards: pull all pieces, push to every shard (both carriers).

``shards`` are :class:`jreplicate.ps.handle.ShardHandle` objects: the shards
themselves in the embedded carrier, proxies of Ray actors in the Ray carrier
(:class:`jreplicate.ps.handle.RemoteShardHandle`, called all at once).

A push is applied by every shard or by none. Where a shard's update could raise (a
host callback in the transformation: ``guarded``; or gradients of shapes or dtypes the
shards did not compile for, which their update may fail to trace), the other shards
first try the push (:meth:`jreplicate.ps.shard.PSShard.check`), then shard 0 applies
it, then the others: a push that raises on any shard is recorded ``failed`` on every
shard and its :class:`jreplicate.ps.ShardUpdateError` raised. An update that raises on
a shard after shard 0 applied the push (the check passed, the shard's state then
changed) leaves the shards disagreeing: :class:`jreplicate.ps.ParameterServerError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jreplicate.ps.fate.decision import FORGET, SKIPPED, Decision, needs_ack
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.handle import RemoteShardHandle, ShardHandle
from jreplicate.ps.placement import Placement
from jreplicate.ps.remote import ParameterServerError, ShardUpdateError

_log = logging.getLogger("jreplicate")

T = TypeVar("T")


class ShardClient:
    """Pulls and pushes whole parameter pytrees through a :class:`Placement`.

    Args:
      shards: one :class:`ShardHandle` per shard.
      placement: how the parameters are split over the shards.
      token_gated: whether shard 0 decides which pushes count (token-gated mode).
      guarded: a shard's update can raise once it runs (see the module docstring).
      faults: the faults to inject (tests, benchmarks): a push goes to shard 0 first,
        then ``faults.between_shards(worker, 1)``, then to the others (with one shard:
        after its push) -- always in token-gated mode, in asynchronous mode where
        ``faults.ordered(worker)``. None: no faults.
    """

    def __init__(self, shards: Sequence[ShardHandle], placement: Placement, token_gated: bool,
                 *, guarded: bool = False, faults: FaultPlan | None = None):
        self.shards = list(shards)
        self.placement = placement
        self.token_gated = token_gated
        self.guarded = guarded
        self.faults = FaultPlan() if faults is None else faults

    def _fan(self, op: Callable[[int, ShardHandle], T], first: int = 0,
             stop: int | None = None) -> list[T]:
        """``op(i, shard)`` for shards ``first`` to ``stop``; concurrently where the
        shards are remote (``op`` then runs on ``shard.nowait``, which returns futures,
        and ``gather`` waits for them all)."""
        shards = list(enumerate(self.shards))[first:stop]
        if shards and _is_remote(shards[0][1]):
            return shards[0][1].gather([op(i, s.nowait) for i, s in shards])
        return [op(i, s) for i, s in shards]

    def pull(self) -> tuple[list[int], Any]:
        """``(step of each shard, parameters as a numpy pytree)``."""
        got = self._fan(lambda i, s: s.pull())
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
        leaves = self.placement.treedef.flatten_up_to(grads)
        pieces = self.placement.split_leaves(leaves)
        careful = self._careful(leaves)
        if careful:
            self._check(push_id, fetched, pieces)
        if not self.token_gated and not careful and \
                not self.faults.ordered(worker):  # all at once
            got = self._fan(lambda i, s: s.push(push_id, worker, int(fetched[i]),
                                                pieces[i]))
            return got[0]
        if self.token_gated:
            self._fan(lambda i, s: s.stage(push_id, attempt, pieces[i]), first=1)
        first = self._first(push_id, lambda s: s.push(
            push_id, worker, int(fetched[0]), pieces[0], None, attempt))
        self.faults.between_shards(worker, 1)
        if self.token_gated:
            self.settle(push_id, first)
        else:
            self._rest(push_id, lambda i, s: s.push(push_id, worker, int(fetched[i]),
                                                    pieces[i]))
        return first

    def _careful(self, leaves: list) -> bool:
        """Whether a push of the gradients ``leaves`` (numpy) may raise on a shard (and
        there are others to keep from applying it): ``guarded``, or gradients unlike
        the parameters."""
        if len(self.shards) == 1:
            return False
        if self.guarded:
            return True
        p = self.placement
        return [g.shape for g in leaves] != list(p.shapes) or \
            [g.dtype for g in leaves] != list(p.dtypes)

    def _check(self, push_id: int, fetched: Sequence[int], pieces: list) -> None:
        """Shards 1... try the push; one raising fails it on every shard."""
        f = (lambda i: int(fetched[0])) if self.token_gated else (lambda i: int(fetched[i]))
        try:
            self._fan(lambda i, s: s.check(push_id, f(i), pieces[i]), first=1)
        except ShardUpdateError:
            self._fan(lambda i, s: s.record(push_id, Decision("failed", -1)))
            raise

    def _first(self, push_id: int, push: Callable[[ShardHandle], T]) -> T:
        """Shard 0's ``push``; if its update raises, the others record the push failed."""
        try:
            return push(self.shards[0])
        except ShardUpdateError:
            self._fan(lambda i, s: s.record(push_id, Decision("failed", -1)), first=1)
            raise

    def _rest(self, push_id: int, push: Callable[[int, ShardHandle], T]) -> list[T]:
        """The other shards' ``push`` after shard 0 applied it (asynchronous)."""
        try:
            return self._fan(push, first=1)
        except ShardUpdateError as e:
            raise ParameterServerError(
                f"{e} But shard 0 had applied the push already (the shard's check of it "
                "passed before its state changed): the shards disagree. Restore the last "
                "checkpoint (strategy.restore(state)).") from e

    def push_pull(self, push_id: int, worker: int, fetched: Sequence[int], grads: Any
                  ) -> tuple[Decision, list[int], Any]:
        """Asynchronous mode: :meth:`push`, each shard replying with its step and
        parameters after applying (one round trip per shard instead of a push and a
        pull). Returns shard 0's decision, each shard's step and the parameters."""
        leaves = self.placement.treedef.flatten_up_to(grads)
        pieces = self.placement.split_leaves(leaves)
        op = lambda i, s: s.push_pull(push_id, worker, int(fetched[i]), pieces[i])  # noqa: E731
        if self._careful(leaves):
            self._check(push_id, fetched, pieces)
            got = [self._first(push_id, lambda s: op(0, s)), *self._rest(push_id, op)]
        else:
            got = self._fan(op)
        return got[0][0], [g[1] for g in got], self.placement.join([g[2] for g in got])

    def settle(self, push_id: int, decision: Decision | None = None) -> None:
        """Token-gated: commits shard 0's decision for ``push_id`` on the other shards
        (their staged pieces) and tells shard 0 the steps they reached, which releases
        the next step's tokens. The coordinator calls it for a worker lost mid-push (the
        decision is then read from shard 0; nothing happens if there is none)."""
        if not self.token_gated or len(self.shards) == 1:
            return
        if decision is None:
            decision = self.shards[0].decision(push_id)
            if decision is None:
                return
        steps = self._fan(lambda i, s: s.commit(push_id, decision), first=1)
        if needs_ack(decision, steps):
            self.shards[0].ack(steps)

    def decided(self, push_id: int) -> list[bool | None]:
        """Whether each shard's ledger decided ``push_id`` (None: the shard did not
        answer, lost or closed). The coordinator asks after a worker was lost in a step,
        so that a step given up with its push on some shards only is named."""
        out: list[bool | None] = []
        for s in self.shards:
            try:
                out.append(bool(s.decided(push_id)))
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                out.append(None)
        return out

    def skip(self, push_id: int) -> None:
        """Every shard marks ``push_id`` decided without a push (its step ended for good
        without pushing; a no-op on a shard that decided it): each ledger's watermark
        moves past it. Remote shards are not waited for; a lost or closed shard is
        passed over (nothing of it is lost by the skip)."""
        self._tell(push_id, SKIPPED)

    def forget(self, below: int) -> None:
        """Every step with an id below ``below`` ended: the shards let go of what they
        keep for those steps' reruns (their decisions), so that it stays bounded. Not
        waited for, as :meth:`skip`."""
        self._tell(below, FORGET)

    def _tell(self, push_id: int, decision: Decision) -> None:
        """Every shard's ``record(push_id, decision)``, remote ones not waited for; a lost
        or closed shard is passed over (its loss is raised elsewhere)."""
        for s in self.shards:
            try:
                if _is_remote(s):
                    s.nowait.record(push_id, decision)  # fire and forget
                else:
                    s.record(push_id, decision)
            except Exception:  # noqa: BLE001 - a lost shard: its loss is raised elsewhere
                _log.debug("client: a lost shard: its loss is raised elsewhere", exc_info=True)


_REMOTE: dict[type, bool] = {}


def _is_remote(shard: ShardHandle) -> bool:
    """Whether ``shard`` is a :class:`RemoteShardHandle`, decided once per type (the
    protocol's isinstance looks up its every member: 0.1-0.2 ms a step)."""
    kind = type(shard)
    remote = _REMOTE.get(kind)
    if remote is None:
        remote = _REMOTE[kind] = isinstance(shard, RemoteShardHandle)
    return remote


def to_numpy(tree: Any) -> Any:
    """A numpy copy of a pytree of arrays."""
    return jax.tree.map(np.asarray, tree)
