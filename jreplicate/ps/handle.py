"""The typed interfaces between the PS core and its carriers.

:class:`ShardHandle` is one shard's operations as a worker's
:class:`jreplicate.ps.client.ShardClient` calls them: a :class:`jreplicate.ps.shard.PSShard`
itself (embedded carrier) or a proxy of a Ray shard actor. A remote handle also has
``nowait``, the same operations returning futures, and ``gather`` to wait for them, so
the client calls every shard at once (:class:`RemoteShardHandle`).

:class:`StepCarrier` is what the coordinator asks of a carrier (embedded or Ray): start a
step on a worker and wait for its outcome, and the shard calls a step's end needs.
:class:`Carrier` is all the executor asks of one: that, plus the shards' step, ledger
and state and fault injection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from jreplicate.ps.fate.decision import Decision

if TYPE_CHECKING:
    from jreplicate.ps.closure import Closure
    from jreplicate.ps.outcome import Outcome


@runtime_checkable
class ShardHandle(Protocol):
    """One shard's operations (:class:`jreplicate.ps.shard.PSShard`'s signatures)."""

    def pull(self) -> tuple[int, dict[str, np.ndarray]]: ...

    def push(self, push_id: int, worker: int, fetched_step: int,
             grads: dict[str, np.ndarray], decision: Decision | None = None,
             attempt: int = 0) -> Decision: ...

    def push_pull(self, push_id: int, worker: int, fetched_step: int,
                  grads: dict[str, np.ndarray]
                  ) -> tuple[Decision, int, dict[str, np.ndarray]]: ...

    def check(self, push_id: int, fetched_step: int, grads: dict[str, np.ndarray]) -> None: ...

    def stage(self, push_id: int, attempt: int, grads: dict[str, np.ndarray]) -> None: ...

    def commit(self, push_id: int, decision: Decision) -> int: ...

    def decision(self, push_id: int) -> Decision | None: ...

    def ack(self, steps: list[int]) -> None: ...

    def record(self, push_id: int, decision: Decision) -> None: ...

    def decided(self, push_id: int) -> bool: ...

    def take_token(self, deadline: float, *, skip_stale: bool = True, min_step: int = 0,
                   live_workers: int = 0,
                   on_wait: Callable[[bool], None] | None = None) -> int: ...

    def return_token(self, token: int) -> None: ...


@runtime_checkable
class RemoteShardHandle(ShardHandle, Protocol):
    """A shard in another process: ``nowait`` has the same operations returning futures;
    ``gather`` waits for a list of them."""

    nowait: Any

    def gather(self, futures: list) -> list: ...


@runtime_checkable
class StepCarrier(Protocol):
    """What the :class:`~jreplicate.ps.coordinator.Coordinator` asks of a carrier: run
    steps on its workers, and the shard calls that a step's end needs. A fake carrier
    for thread tests implements these alone."""

    num_workers: int
    #: Whether :meth:`replace_worker` may replace a lost worker (if not, a lost worker
    #: is lost for good and is not waited for).
    replaces_workers: bool

    def start(self, w: int, closure: Closure, on_token_wait: Callable[[bool], None]
              ) -> Callable[[], Outcome]:
        """Starts ``closure`` on worker ``w``; returns a callable that waits for it and
        returns its :mod:`~jreplicate.ps.outcome` (it never raises: the carrier turns
        its errors into outcomes, :func:`~jreplicate.ps.outcome.from_error`)."""
        ...

    def replace_worker(self, w: int) -> bool:
        """After worker ``w`` was lost: True once the carrier replaced it (Ray restarted
        its actor; the embedded carrier made a new worker), so that it takes steps
        again."""
        ...

    def interrupt(self) -> None:
        """Makes every token wait end (:class:`StepCancelledError`)."""
        ...

    def workers_alive(self, n: int) -> None:
        """Tells shard 0 that ``n`` workers are alive (0: token-gated waiters may take
        a second token of the current step)."""
        ...

    def starved(self) -> bool:
        """Whether shard 0 has no token a waiting worker could take."""
        ...

    def settle(self, step_id: int) -> None:
        """Commits a lost worker's decided push on every shard."""
        ...

    def decided(self, step_id: int) -> list[bool | None] | None:
        """Per shard, whether it decided the step's push (None: it did not answer);
        None: unknown (the step's push is then of unknown fate, never skipped)."""
        ...

    def skip(self, step_id: int) -> None:
        """Every shard decides the id without a push (called under the coordinator's
        lock: it must not block)."""
        ...

    def forget(self, below: int) -> None:
        """Every step with an id below ``below`` ended: the shards may let go of what
        they keep for those steps' reruns (under the lock, like :meth:`skip`)."""
        ...


@runtime_checkable
class Carrier(StepCarrier, Protocol):
    """Shards and workers, wherever they run, as the executor drives them: the
    :class:`StepCarrier` the coordinator uses, and the shards' step, ledger and state
    and fault injection. The push calls default to the driver's ``client``."""

    client: Any  # the driver's ShardClient
    depth: int  # steps started per worker at once (see Coordinator)

    def settle(self, step_id: int) -> None:
        self.client.settle(step_id)

    def decided(self, step_id: int) -> list[bool | None] | None:
        return self.client.decided(step_id)

    def skip(self, step_id: int) -> None:
        self.client.skip(step_id)

    def forget(self, below: int) -> None:
        self.client.forget(below)

    def shard_step(self, i: int) -> int: ...

    def shard_summary(self, i: int) -> dict[str, Any]: ...

    def shard_state(self, i: int) -> dict[str, Any]: ...

    def kill_worker(self, w: int, when: str) -> None: ...

    def set_worker_delay(self, w: int, seconds: float) -> None: ...

    def kill_shard(self, i: int) -> None: ...

    def restart_shard(self, i: int, saved: dict[str, Any]) -> None: ...

    def shard_lost(self, i: int) -> bool: ...

    def set_live_workers(self, fn: Callable[[], int]) -> None: ...

    def forget_function(self, key: int) -> None: ...

    def release_input(self, key: int, *, now: bool = False) -> None: ...

    def release_value(self, key: int) -> None: ...

    def read_value(self, key: int) -> list: ...

    def close(self, *, why: str = "the strategy was shut down") -> None: ...
