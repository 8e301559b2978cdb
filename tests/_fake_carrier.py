"""A fake :class:`jreplicate.ps.handle.StepCarrier` for thread tests of the Coordinator.

Subclass it and define ``start(w, closure, on_token_wait)``, returning a callable that
returns the step's :mod:`jreplicate.ps.outcome`; the shard calls default to a carrier
without shards (no push is ever decided, none skipped), or pass a driver ``client``
(a :class:`jreplicate.ps.client.ShardClient`) to ask its shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jreplicate.ps.closure import Closure
from jreplicate.ps.outcome import Outcome


class FakeCarrier:
    """``num_workers`` workers; override :meth:`start` (and any other call)."""

    def __init__(self, num_workers: int, *, client: Any = None,
                 replaces_workers: bool = False) -> None:
        self.num_workers = num_workers
        self.client = client
        self.replaces_workers = replaces_workers
        self.interrupts = 0
        self.alive_told: list[int] = []  # every workers_alive(n), in order

    def start(self, w: int, closure: Closure, on_token_wait: Callable[[bool], None]
              ) -> Callable[[], Outcome]:
        raise NotImplementedError

    def replace_worker(self, w: int) -> bool:
        return True

    def interrupt(self) -> None:
        self.interrupts += 1

    def workers_alive(self, n: int) -> None:
        self.alive_told.append(n)

    def starved(self) -> bool:
        return True

    def settle(self, step_id: int) -> None:
        if self.client is not None:
            self.client.settle(step_id)

    def decided(self, step_id: int) -> list[bool | None] | None:
        return None if self.client is None else self.client.decided(step_id)

    def skip(self, step_id: int) -> None:
        if self.client is not None:
            self.client.skip(step_id)

    def forget(self, below: int) -> None:
        if self.client is not None:
            self.client.forget(below)
