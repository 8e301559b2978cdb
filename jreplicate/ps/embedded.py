"""The embedded carrier of :class:`jreplicate.ParameterServerStrategy` (the default):
shards and workers are objects of this process, each shard on its own device, each
worker on its own devices and run by a thread of the :class:`Coordinator`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import Closure
from jreplicate.ps.config import PSConfig
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.handle import Carrier
from jreplicate.ps.outcome import Outcome
from jreplicate.ps.placement import Placement
from jreplicate.ps.shard import PSShard
from jreplicate.ps.worker import PSWorker


class EmbeddedCarrier(Carrier):
    """Shards and workers as objects of this process; each worker runs on a thread of
    the :class:`Coordinator` with its own devices. ``faults`` (tests, benchmarks; none
    by default) is handed to every worker and its shard client."""

    def __init__(self, s: PSConfig, tx: Any, placement: Placement,
                 pieces: list, opt_host: Any, restored: list | None, *,
                 faults: FaultPlan | None = None):
        self._config, self._tx, self._placement, self._opt_host = s, tx, placement, opt_host
        self.faults = FaultPlan() if faults is None else faults
        self.shards = [self._new_shard(i, pieces[i], restored[i] if restored else {})
                       for i in range(s.num_ps)]
        self.workers = [self._new_worker(w) for w in range(s.num_workers)]
        self.client = ShardClient(self.shards, placement, self.shards[0].token_gated,
                                  guarded=self._guarded())
        self.num_workers = s.num_workers
        self.depth = 1
        self.replaces_workers = s.max_worker_restarts != 0
        #: Per worker: replacements left (-1: no limit), and those made.
        self._restarts_left = [s.max_worker_restarts] * s.num_workers
        self.restarts = [0] * s.num_workers

    def _guarded(self) -> bool:
        return any(sh.may_raise for sh in self.shards)

    def _new_worker(self, w: int) -> PSWorker:
        """Worker ``w`` afresh, on its devices, over the current shards."""
        s = self._config
        client = ShardClient(self.shards, self._placement, self.shards[0].token_gated,
                             guarded=self._guarded(), faults=self.faults)
        return PSWorker(w, list(s.worker_devices[w]), client, self._opt_host,
                        token_timeout=s.token_timeout, skip_stale_tokens=s.skip_stale_tokens,
                        axis_name=s.layout.replica_axis, faults=self.faults)

    def start(self, w: int, closure: Closure, on_token_wait: Callable[[bool], None]
              ) -> Callable[[], Outcome]:
        """The step runs on its worker's coordinator thread when the thread waits for
        it; ``self.workers[w]`` is read now (a replaced worker takes its place)."""
        return functools.partial(self.workers[w].run, closure, on_token_wait)

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
        """Worker ``w`` was lost in a step: True once a new worker with its index, its
        devices and its per-worker input took its place, as Ray restarts a worker actor
        (``max_worker_restarts`` times at most; False after that, and ``w`` stays lost).

        The new worker starts afresh (no token taken yet, no kill armed, its step
        functions compiled again) with the lost one's delay and input pipelines: these
        go on after the elements of the lost one's completed steps and, when no shard
        decided the push of the step it died in, that step's elements, which it reads
        first (Ray's restarted worker reads them again); a decided push applied them.
        """
        left = self._restarts_left[w]
        if left == 0:
            return False
        self._restarts_left[w] = left - 1 if left > 0 else left
        old, new = self.workers[w], self._new_worker(w)
        new.inputs, new.live_workers = old.inputs, old.live_workers
        self.faults.disarm(w)  # (its delay, the plan's, stays)
        new.return_params = old.return_params
        if old.lost_read is not None:
            m, batch, decided = old.lost_read
            if not decided:
                new.inputs.hand_back(m, batch.elements, batch.treedef)
        self.workers[w] = new
        self.restarts[w] += 1
        return True

    def kill_worker(self, w: int, when: str) -> None:
        self.faults.kill(w, when)

    def set_worker_delay(self, w: int, seconds: float) -> None:
        self.faults.set_delay(w, seconds)

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

    def read_value(self, key: int) -> list:
        """Each worker's per-worker state of ``key`` (NumPy; None where it holds none)."""
        return [w.values.read(key) for w in self.workers]

    def workers_alive(self, n: int) -> None:
        self.shards[0].set_live_workers(n)

    def kill_shard(self, i: int) -> None:
        self.shards[i].close("lost (killed)")

    def close(self, *, why: str = "the strategy was shut down") -> None:
        """(``why``: the Ray carrier's reason; outputs here stay fetchable.)"""
        for sh in self.shards:
            sh.close("shut down")
