"""The typed interfaces between the PS core and its carriers.

:class:`ShardHandle` is one shard's operations as a worker's
:class:`jreplicate.ps.client.ShardClient` calls them: a :class:`jreplicate.ps.shard.PSShard`
itself (embedded carrier) or a proxy of a Ray shard actor. A remote handle also has
``nowait``, the same operations returning futures, and ``gather`` to wait for them, so
the client calls every shard at once (:class:`RemoteShardHandle`).

:class:`Carrier` is what the executor asks of a carrier (embedded or Ray): the shards'
step, ledger and state, fault injection, and the hooks of the coordinator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jreplicate.ps.shard import Decision


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
class Carrier(Protocol):
    """Shards and workers, wherever they run, as the executor drives them."""

    client: Any  # the driver's ShardClient
    #: Per worker: ``start(closure, on_token_wait)`` starts the step and returns a
    #: callable that waits for it and returns its outputs (or raises its error).
    runners: list[Callable]
    depth: int  # steps started per worker at once (see Coordinator)

    def shard_step(self, i: int) -> int: ...

    def shard_summary(self, i: int) -> dict[str, Any]: ...

    def shard_state(self, i: int) -> dict[str, Any]: ...

    def kill_worker(self, w: int, when: str) -> None: ...

    def replace_worker(self, w: int) -> bool: ...

    def set_worker_delay(self, w: int, seconds: float) -> None: ...

    def kill_shard(self, i: int) -> None: ...

    def restart_shard(self, i: int, saved: dict[str, Any]) -> None: ...

    def shard_lost(self, i: int) -> bool: ...

    def is_shard_failure(self, e: BaseException) -> bool: ...

    def starved(self) -> bool: ...

    def interrupt(self) -> None: ...

    def workers_alive(self, n: int) -> None: ...

    def set_live_workers(self, fn: Callable[[], int]) -> None: ...

    def forget_function(self, key: int) -> None: ...

    def release_input(self, key: int, *, now: bool = False) -> None: ...

    def release_value(self, key: int) -> None: ...

    def read_value(self, key: int) -> list: ...

    def close(self, *, why: str = "the strategy was shut down") -> None: ...
