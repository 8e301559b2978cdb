"""The embedded carrier of :class:`jreplicate.ParameterServerStrategy` (the default):
shards and workers are objects of this process, each shard on its own device, each
worker on its own devices and run by a thread of the :class:`Coordinator`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jreplicate.ps.client import ShardClient
from jreplicate.ps.config import PSConfig
from jreplicate.ps.placement import Placement
from jreplicate.ps.shard import PSShard
from jreplicate.ps.worker import PSWorker


class EmbeddedCarrier:
    """Shards and workers as objects of this process; each worker runs on a thread of
    the :class:`Coordinator` with its own devices."""

    def __init__(self, s: PSConfig, tx: Any, placement: Placement,
                 pieces: list, opt_host: Any, restored: list | None):
        self._config, self._tx = s, tx
        self.shards = [self._new_shard(i, pieces[i], restored[i] if restored else {})
                       for i in range(s.num_ps)]
        gated = self.shards[0].token_gated
        guarded = any(sh.may_raise for sh in self.shards)
        self.workers = [PSWorker(w, list(grp), ShardClient(self.shards, placement, gated,
                                                           guarded=guarded),
                                 opt_host, token_timeout=s.token_timeout,
                                 skip_stale_tokens=s.skip_stale_tokens,
                                 axis_name=s.layout.replica_axis)
                        for w, grp in enumerate(s.worker_devices)]
        self.client = ShardClient(self.shards, placement, gated, guarded=guarded)
        # A step runs on its worker's coordinator thread when the thread waits for it.
        self.runners = [lambda c, on_wait, w=w: functools.partial(_outputs, w, c, on_wait)
                        for w in self.workers]
        self.depth = 1

    def is_shard_failure(self, e: BaseException) -> bool:
        return False

    def starved(self) -> bool:
        """Whether shard 0 has no token a waiting worker could take."""
        return not self.shards[0].takeable()

    def interrupt(self) -> None:
        self.shards[0].interrupt()

    def shard_step(self, i: int) -> int:
        return self.shards[i].step

    def shard_summary(self, i: int) -> dict[str, Any]:
        return self.shards[i].summary()

    def shard_state(self, i: int) -> dict[str, Any]:
        return self.shards[i].state()

    def _new_shard(self, i: int, params: Any, r: dict[str, Any]) -> PSShard:
        s = self._config
        return PSShard(i, params, self._tx, device=s.shard_devices[i],
                       opt_state=r.get("opt_state"), step=r.get("step", 0),
                       ledger=r.get("ledger"), num_shards=s.num_ps,
                       max_staleness=s.max_staleness)

    def shard_lost(self, i: int) -> bool:
        return self.shards[i].closed

    def restart_shard(self, i: int, saved: dict[str, Any]) -> None:
        """Shard ``i`` anew from ``saved`` (``host_shard_state``), in every client."""
        self.shards[i].close("replaced")
        self.shards[i] = sh = self._new_shard(i, saved["params"], saved)
        for client in [self.client] + [w.client for w in self.workers]:
            client.shards[i] = sh

    def replace_worker(self, w: int) -> bool:
        """False: a lost worker thread is not replaced (its device stays idle)."""
        return False

    def kill_worker(self, w: int, when: str) -> None:
        self.workers[w].kill_at = when

    def set_worker_delay(self, w: int, seconds: float) -> None:
        self.workers[w].delay = seconds

    def set_live_workers(self, fn: Callable[[], int]) -> None:
        for w in self.workers:
            w.live_workers = fn

    def forget_function(self, key: int) -> None:
        """Nothing: the workers hold the step functions weakly."""

    def release_input(self, key: int, *, now: bool = False) -> None:
        """Every worker frees its pipeline of input ``key`` (at once, or as soon as the
        read holding it ends; never blocks: may run as a finalizer)."""
        for w in self.workers:
            w.inputs.release(key)

    def release_value(self, key: int) -> None:
        """Every worker lets its per-worker value of ``key`` go."""
        for w in self.workers:
            w.values.release(key)

    def workers_alive(self, n: int) -> None:
        self.shards[0].set_live_workers(n)

    def kill_shard(self, i: int) -> None:
        self.shards[i].close("lost (killed)")

    def close(self, *, why: str = "the strategy was shut down") -> None:
        """(``why``: the Ray carrier's reason; outputs here stay fetchable.)"""
        for sh in self.shards:
            sh.close("shut down")


def _outputs(worker: PSWorker, c: Any, on_wait: Callable[[bool], None]) -> Any:
    return worker.run(c, on_wait)[0]
