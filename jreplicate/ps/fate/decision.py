"""What became of a push on one shard: the decision, and the book a shard keeps of it.

Pure (no threads, no locks, no JAX): :class:`jreplicate.ps.shard.PSShard` holds a
:class:`ShardBook` under its lock and runs the updates the book says to run.

Token-gated mode (a :func:`jreplicate.sync_replicas` transformation): shard 0 runs the
transform's host driver and decides each push (:func:`driver_decision`); the other
shards *stage* a push's pieces per run (:meth:`ShardBook.stage`) until shard 0's
decision is *committed* on them (:meth:`ShardBook.commit`): an accepted push's pieces
are then fed to the accumulators in shard 0's order (:meth:`ShardBook.next_piece`), so
that every shard's parameters are those a single shard would hold. A second push of a
decided id is a ``duplicate`` that gets the original decision back
(:meth:`ShardBook.duplicate`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jreplicate.ps.fate.ledger import Ledger


@dataclasses.dataclass(frozen=True)
class Decision:
    """What shard 0 decided for a push in token-gated mode.

    Attributes:
      kind: ``"applied"`` (accepted into step ``step``'s aggregate), ``"stale"``,
        ``"backup"`` or ``"failed"`` (an update raised: no shard applies it); or
        ``"skipped"`` (:data:`SKIPPED`, sent to every shard's
        :meth:`jreplicate.ps.shard.PSShard.record` by the coordinator): the step ended
        for good without pushing, its id is decided without counting
        (:meth:`jreplicate.ps.fate.ledger.Ledger.skip`); or ``"forget"`` (:data:`FORGET`,
        to :meth:`jreplicate.ps.shard.PSShard.record` with a push id ``n``): every step
        with an id below ``n`` ended, so what is kept for their reruns is let go
        (:meth:`jreplicate.ps.fate.ledger.Ledger.forget`).
      step: the global step the gradient counts for (accepted), else the step then.
      index: the push's position among step ``step``'s accepted gradients.
      completes: the push completed step ``step`` (shard 0 applied the aggregate).
      attempt: the run of the step whose gradient shard 0 decided on (the other shards
        feed the pieces that run staged).
      duplicate: returned for a second push of a decided id (the fields are the
        original decision's).
    """

    kind: str
    step: int
    index: int = -1
    completes: bool = False
    attempt: int = 0
    duplicate: bool = False


#: The decision that marks a push id decided without a push (see :class:`Decision`).
SKIPPED = Decision("skipped", -1)
#: The decision that says every step below a push id ended (see :class:`Decision`).
FORGET = Decision("forget", -1)


class Counters(NamedTuple):
    """The counters of a ``SyncReplicasState`` that a decision is read from (ints)."""

    global_step: int
    num_accumulated: int
    dropped_stale: int
    dropped_backup: int


def driver_decision(before: Counters, after: Counters, attempt: int) -> Decision:
    """Shard 0's decision for a push, from the host driver's counters before and after
    its update: dropped as stale or as a backup, else accepted as the
    ``num_accumulated``-th gradient of ``global_step`` (completing it if the step
    moved on)."""
    gs = before.global_step
    if after.dropped_stale > before.dropped_stale:
        return Decision("stale", gs)
    if after.dropped_backup > before.dropped_backup:
        return Decision("backup", gs)
    return Decision("applied", gs, before.num_accumulated,
                    completes=after.global_step > gs, attempt=attempt)


def needs_ack(decision: Decision, steps: list[int]) -> bool:
    """Whether shard 0 is to be told the other shards' ``steps`` after they committed
    ``decision``: an accepted push that moved one of them past its step (the next step's
    tokens wait for every shard to reach it)."""
    return decision.kind == "applied" and max(steps) > decision.step


class ShardBook:
    """The fate of the pushes one shard received: its :class:`Ledger`, shard 0's
    decisions kept for reruns (in the ledger), and (token-gated, shards > 0) the staged
    pieces and the accepted pushes waiting for their turn. Not thread-safe: the shard's
    lock guards it.

    Args:
      index: the shard's index (for errors).
      ledger: the shard's ledger (restored, or new).
      fed: accepted pushes of the current step already fed to the accumulators.
    """

    def __init__(self, index: int, ledger: Ledger | None = None, fed: int = 0):
        self.index = index
        self.ledger = ledger or Ledger()
        #: ``{push id: {run: pieces}}``: staged, waiting for shard 0's decision.
        self.staged: dict[int, dict[int, Any]] = {}
        #: ``{step: {index: pieces}}``: accepted, waiting for their turn.
        self.pending: dict[int, dict[int, Any]] = {}
        #: ``{step: gradients}``: how many gradients shard 0 took for a completed step.
        self.need: dict[int, int] = {}
        self.fed = int(fed)

    # -- any shard -------------------------------------------------------------------
    def duplicate(self, push_id: int, step: int) -> Decision | None:
        """A second push of a decided ``push_id``: recorded ``duplicate``, returns the
        original decision marked ``duplicate`` (None: not decided, a first push)."""
        if not self.ledger.seen(push_id):
            return None
        self.ledger.record(push_id, "duplicate")
        d = self.ledger.decisions.get(push_id, Decision("applied", step))
        return dataclasses.replace(d, duplicate=True)

    def failed(self, push_id: int, step: int) -> None:
        """The push's update raised here: recorded ``failed``, and kept for its reruns."""
        self.ledger.record(push_id, "failed")
        self.ledger.decisions[push_id] = Decision("failed", step)

    def too_stale(self, push_id: int, step: int, staleness: int, tau: int | None
                  ) -> Decision | None:
        """Asynchronous mode: a push ``staleness`` updates stale, beyond the bound
        ``tau`` (None: no bound), is dropped: recorded ``stale``, its decision returned
        (None: it is applied)."""
        if tau is None or staleness <= tau:
            return None
        self.ledger.record(push_id, "stale")
        return Decision("stale", step)

    def decided_by_driver(self, push_id: int, d: Decision) -> None:
        """Shard 0 (token-gated) decided ``d`` for ``push_id``: recorded, and kept for
        a rerun's push (until :data:`FORGET`)."""
        self.ledger.record(push_id, d.kind, 0 if d.kind == "applied" else None)
        self.ledger.decisions[push_id] = d

    # -- token-gated, shards > 0 -------------------------------------------------------
    def stage(self, push_id: int, attempt: int, pieces: Any) -> None:
        """Keeps run ``attempt``'s ``pieces`` of ``push_id`` until shard 0's decision is
        committed (ignored for an id already decided)."""
        if not self.ledger.seen(push_id):
            self.staged.setdefault(push_id, {})[int(attempt)] = pieces

    def commit(self, push_id: int, d: Decision, empty: bool = False) -> bool:
        """Commits shard 0's decision ``d`` for ``push_id`` (or :data:`SKIPPED`,
        :data:`FORGET`). Returns True when an accepted push's pieces were queued: the
        caller feeds them (:meth:`next_piece`).

        Args:
          empty: the shard holds no parameters (it keeps only the count).

        Raises:
          RuntimeError: the decided run's pieces were never staged here.
        """
        if d.kind == "forget":  # every step below push_id ended
            self.ledger.forget(push_id)
            if any(i < push_id for i in self.staged):
                self.staged = {i: s for i, s in self.staged.items() if i >= push_id}
            return False
        staged = self.staged.pop(push_id, {})
        if d.kind == "skipped":  # never pushed (a no-op if decided)
            self.ledger.skip(push_id)
            return False
        if self.ledger.seen(push_id):
            self.ledger.record(push_id, "duplicate")
            return False
        if d.kind != "applied":
            self.ledger.record(push_id, d.kind)
            return False
        if d.attempt not in staged and not empty:
            raise RuntimeError(
                f"PSShard {self.index}: push {push_id} (run {d.attempt}) was accepted by "
                "shard 0 but its pieces were never staged here; stage() every shard "
                "before pushing to shard 0.")
        self.ledger.record(push_id, "applied", 0)
        self.ledger.decisions[push_id] = d
        self.pending.setdefault(d.step, {})[d.index] = staged.get(d.attempt)
        if d.completes:
            self.need[d.step] = d.index + 1
        return True

    def next_piece(self, step: int) -> tuple[bool, Any]:
        """``(True, pieces)`` of the next accepted push of ``step`` to feed (shard 0's
        order), ``(False, None)`` while it has not been committed here."""
        got = self.pending.get(step)
        if got is None or self.fed not in got:
            return False, None
        return True, got[self.fed]

    def fed_one(self, step: int) -> None:
        """The piece :meth:`next_piece` gave was fed to the accumulators."""
        self.pending[step].pop(self.fed)
        self.fed += 1

    def completes(self, step: int) -> bool:
        """Whether the gradients fed complete ``step`` (as shard 0 said): for a shard
        without parameters, which has no accumulator to tell."""
        return self.need.get(step) == self.fed

    def step_done(self, step: int) -> None:
        """``step`` completed here: checks that it took as many gradients as on shard 0
        and starts the next.

        Raises:
          RuntimeError: it took another number (the shards were built with different
            transformations).
        """
        need = self.need.pop(step, self.fed)
        if need != self.fed:
            raise RuntimeError(
                f"PSShard {self.index}: step {step} took {need} gradients on shard 0 but "
                f"{self.fed} here; shards must be built with the same sync_replicas "
                "transformation.")
        self.pending.pop(step, None)
        self.fed = 0


class TokenRelease:
    """Token-gated shard 0: when a step's tokens may be handed out (TensorFlow's "only
    after all variables have been updated"): once every other shard committed the
    step's accepted pushes and acknowledged reaching it (:meth:`ack`), and, for a waiter
    that already pushed for the step, not before the next one.

    Args:
      step: the step every shard is at (the restored ``global_step``).
      num_shards: the shards of the job.
    """

    def __init__(self, step: int, num_shards: int):
        #: The step each shard acknowledged having reached (index 0 unused).
        self.acked = [int(step)] * max(int(num_shards), 1)
        self.k: int | None = None  # replicas_to_aggregate, learnt at the first completion
        self.live: int | None = None  # workers alive, as the coordinator last said

    def ack(self, steps: list[int]) -> None:
        """The other shards' ``steps`` (shard 1 first) as a worker saw them."""
        for i, st in enumerate(steps, 1):
            if i < len(self.acked):
                self.acked[i] = max(self.acked[i], int(st))

    def decided(self, d: Decision) -> None:
        """Shard 0 decided ``d``: a completing push tells ``replicas_to_aggregate``."""
        if d.completes:
            self.k = d.index + 1

    def released(self, step: int) -> bool:
        """Whether every other shard reached ``step`` (shard 0's ``global_step``)."""
        return min(self.acked[1:], default=step) >= step

    def holds_back(self, step: int, min_step: int, live_workers: int,
                   skip_stale: bool) -> bool:
        """Whether a waiter whose last gradient counted for ``min_step - 1`` waits for
        ``global_step`` (``step``) to reach ``min_step``: one gradient per worker and
        step, while at least ``replicas_to_aggregate`` workers are alive."""
        live = live_workers if self.live is None else min(live_workers, self.live)
        return skip_stale and self.k is not None and live >= self.k and step < min_step
