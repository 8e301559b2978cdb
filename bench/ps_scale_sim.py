"""1,000 parameter-server workers, simulated in virtual time (issue 18 item 9).

What it stands for. The engine-neutral core of ``ParameterServerStrategy`` is real
here: :class:`jreplicate.ps.shard.PSShard` objects (their jitted optax updates, their
:class:`jreplicate.ps.fate.ledger.Ledger`, shard 0's ``sync_replicas`` host driver and token
queue, staging / decision / commit / ack across shards, the shards' staleness guard),
:meth:`jreplicate.ps.client.ShardClient.settle` for a worker lost mid-push, and the
coordinator's scheduling: the pure :class:`jreplicate.ps.scheduler.Scheduler` that the
:class:`jreplicate.ps.coordinator.Coordinator`'s worker threads drive in real time is
driven here from an event heap in virtual time. It owns the FIFO of step closures (a
lost worker's step back at its front with its id, at-least-once execution), admission
by the real gates (``"bounded"``: :class:`jreplicate.ps.admission.StalenessGate`, a
step starts only while every running step has run alongside fewer than tau others;
``"ssp"``: :class:`jreplicate.ps.admission.ClockGate`, a worker starts a step only while
its clock is at most ``tau`` ahead of the slowest live worker's, a dead worker leaves
the minimum and a restarted one rejoins at it; idle workers first come, first served),
and token-gated training's "relax" of one gradient per worker and step when every
running step waits and its starvation (the waits cancelled), by the real
:class:`jreplicate.ps.admission.StarvationDetector`. What this file adds is what the
threads and carriers do: token waits that do not block (``take_token`` with a deadline
already past, retried whenever shard 0 may have a token), ``set_live_workers`` on
deaths, restarts and relaxation (the executor's ``on_worker_lost`` / ``on_relax``), and
a worker's push as the call sequence of ``ShardClient.push`` (async: every shard;
token-gated: stage on shards 1.., push to shard 0, commit on 1.., ack), which a death
can cut anywhere.

What it does not stand for: threads and locks (no contention, no lock convoy), JAX
dispatch and compile time of the workers' steps (a step is a latency drawn in virtual
time; gradients are 4 floats per shard, so the shards' real applies stay cheap),
Ray's transport and failure detection, pulls and pushes taking time, and compute
contention between workers sharing a host. Dead workers come back after ``restart``
virtual seconds (as a Ray actor with ``max_restarts`` would; the embedded carrier loses
them for good).

Step latency: shift + Exp(scale) (Chen et al. 2016, "Revisiting Distributed Synchronous
SGD"). Each step attempt dies with probability ``death`` at a uniform point of it: half
of the deaths during the compute (nothing pushed), half during the push, cut after a
uniform number of its shard calls (possibly all of them, before the step reported).

Every run checks the exactly-once invariant: every push id applied at most once on each
shard (the ledger's applied count rising twice for one id on one shard fails), ledger
counts add up, every shard applied the same ids (token-gated: with shard 0's decisions),
and each shard's parameters equal the sum of the updates it applied (async: ``-lr``
times each applied gradient; token-gated: ``-lr`` times the mean of each completed
step's accepted gradients).

    python bench/ps_scale_sim.py [--scale 1.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jreplicate as jr  # noqa: E402
from jreplicate.ps.client import ShardClient  # noqa: E402
from jreplicate.ps.scheduler import Scheduler, Step  # noqa: E402
from jreplicate.ps.shard import PSShard, TokenTimeoutError  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

MODES = ("async", "bounded", "ssp", "gated")
LR = 0.5
DIM = 4
STARVED_AFTER = 1.0  # virtual seconds (Coordinator.STARVED_AFTER's)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One simulated job.

    Attributes:
      workers: simulated workers.
      shards: PS shards (one leaf of ``DIM`` floats each).
      mode: ``"async"``, ``"bounded"`` (``max_staleness=tau``), ``"ssp"``
        (``max_clock_lead=tau``) or ``"gated"``
        (``sync_replicas`` with ``replicas_to_aggregate = ceil(backup_frac * workers)``
        of ``workers``).
      steps: step closures scheduled at virtual time 0.
      tau: the staleness bound of ``"bounded"``; the clock lead s of ``"ssp"``.
      backup_frac: ``"gated"``: the fraction of workers aggregated per step.
      shift, scale: step latency ``shift + Exp(scale)`` (virtual seconds).
      death: probability that a step attempt's worker dies.
      restart: virtual seconds before a dead worker is back.
      seed: the random seed.
      num_tokens: ``"gated"``: initial tokens (``sync_replicas``'s; None: TensorFlow's
        default of ``replicas_to_aggregate`` tokens of step 0, which turns the second
        round of every worker into stale gradients; 0: workers wait for step 1's).
    """

    workers: int
    shards: int
    mode: str
    steps: int
    tau: int = 4
    backup_frac: float = 0.9
    shift: float = 1.0
    scale: float = 0.5
    death: float = 0.05
    restart: float = 1.0
    seed: int = 0
    num_tokens: int | None = 0


@dataclasses.dataclass
class _Worker:
    alive: bool = True
    local_step: int | None = None  # token-gated: the token of its last push
    min_step: int = 0


def grad(pid: int, attempt: int, shard: int) -> np.ndarray:
    """The gradient piece run ``attempt`` of step ``pid`` pushes to ``shard`` (small
    integers: sums are exact in float32)."""
    v = (pid * 7 + attempt * 3 + shard) % 11 - 5
    return np.arange(1, DIM + 1, dtype=np.float32) * np.float32(v)


class Sim:
    """The discrete-event simulation of one :class:`SimConfig` (see the module doc)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.k = max(1, int(np.ceil(cfg.backup_frac * cfg.workers)))
        tx = jr.sync_replicas(optax.sgd(LR), self.k, cfg.workers, num_tokens=cfg.num_tokens) \
            if cfg.mode == "gated" else optax.sgd(LR)
        tau = cfg.tau if cfg.mode == "bounded" else None
        self.shards = [PSShard(i, {"p": np.zeros(DIM, np.float32)}, tx,
                               num_shards=cfg.shards, max_staleness=tau)
                       for i in range(cfg.shards)]
        self.gated = cfg.mode == "gated"
        self.client = ShardClient(self.shards, None, self.gated)
        self.workers = [_Worker() for _ in range(cfg.workers)]
        self.live = cfg.workers
        # The coordinator's scheduling: the real Scheduler (queue, admission, starvation).
        self.sched = Scheduler(cfg.workers, max_staleness=tau,
                               max_clock_lead=cfg.tau if cfg.mode == "ssp" else None,
                               starved_after=STARVED_AFTER)
        self.closures = [Step(i) for i in range(cfg.steps)]
        for c in self.closures:
            self.sched.submit(c)
        for w in range(cfg.workers):  # every worker's thread starts idle, in order
            self.sched.arrive(w)
        self.attempts = [0] * cfg.steps
        self.events: list = []
        self.seq = 0
        self.waiting: list[tuple[int, int]] = []  # token-gated: (worker, push id)
        self.applied: list[dict[int, int]] = [{} for _ in self.shards]  # pid -> attempt
        self.now = 0.0
        self.completed = self.deaths = self.half_pushes = self.cancelled = 0
        self.relaxed = 0  # times every running step waited and the waits were relaxed
        self._last_pass: tuple | None = None
        self.returned = 0  # tokens given back (shard 0 may have one again)
        self.update_times: list[float] = []  # virtual time of each shard-0 update

    # -- events --------------------------------------------------------------------
    def _at(self, t: float, kind: str, w: int, pid: int, *extra: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, w, pid, extra))

    def run(self) -> dict[str, Any]:
        self._dispatch()
        while True:
            while self.events:
                t, _, kind, w, pid, extra = heapq.heappop(self.events)
                self.now = t
                getattr(self, "_on_" + kind)(w, pid, *extra)
                self._dispatch()
            if not self.waiting or not self._unstick():
                break
        self.cancelled = len(self.waiting) + self.sched.queued
        return self._result()

    def _unstick(self) -> bool:
        """Nothing left to happen but token waits: the coordinator's starvation check
        (join's), in virtual time. False: the waits are cancelled."""
        due = self.sched.starvation_due(self.now)
        if due is None:  # not every running step waits: cannot happen with no events
            raise RuntimeError(f"simulation stuck at {self.now}: {self.waiting[:5]}")
        self.now += due
        due = self.sched.starvation_due(self.now)  # the grace passed without progress
        progress = self.sched.starvation.progress
        if due == 0.0 and self.sched.starved(progress, not self.shards[0].takeable()):
            return False
        self._dispatch()
        return bool(self.events)

    # -- scheduling: the real Scheduler, and what the coordinator's threads do ---------
    def _relax(self, relax: bool) -> None:
        """The executor's ``on_relax``: shard 0 counts no live workers while relaxed."""
        if relax:
            self.relaxed += 1
            self.shards[0].set_live_workers(0)

    def _token_wait(self, w: int, waiting: bool) -> None:
        self._relax(self.sched.token_wait(w, waiting))

    def _dispatch(self) -> None:
        if self.gated:
            self._retry_tokens()
        while (took := self.sched.take_next()) is not None:
            w, c = took
            pid = c.step_id
            self.attempts[pid] += 1
            if self.gated and self.workers[w].local_step is not None:
                self.waiting.append((w, pid))
                self._token_wait(w, True)
                self._retry_tokens(only_new=True)
            else:
                self._begin(w, pid, None)

    def _token_state(self) -> tuple:
        """What decides whether a waiter may take a token (a pass over the waiters is
        needed only when it changed, or for a new waiter)."""
        s0 = self.shards[0]
        return (s0.step, self.returned, min(s0.release.acked[1:], default=0),
                self._live() >= self.k, self.relaxed)

    def _retry_tokens(self, only_new: bool = False) -> None:
        """Token waits: every waiter tries (in arrival order) when the token state
        changed since the last pass; otherwise only a new waiter (``only_new``)."""
        unchanged = self._token_state() == self._last_pass
        if unchanged and not only_new:
            return
        first = len(self.waiting) - 1 if unchanged else 0
        s0 = self.shards[0]
        still = self.waiting[:first]
        for i, (w, pid) in enumerate(self.waiting[first:], first):
            if not s0.takeable():
                still.extend(self.waiting[i:])
                break
            try:
                token = s0.take_token(0.0, min_step=self.workers[w].min_step,
                                      live_workers=self._live())
            except TokenTimeoutError:
                still.append((w, pid))
                continue
            self._token_wait(w, False)
            self._begin(w, pid, token)
        self.waiting = still
        self._last_pass = self._token_state()

    def _live(self) -> int:
        return self.live

    def _begin(self, w: int, pid: int, token: int | None) -> None:
        steps = [s.pull()[0] for s in self.shards]
        latency = self.cfg.shift + self.rng.exponential(self.cfg.scale)
        end = self.now + latency
        if self.rng.random() < self.cfg.death:
            if self.rng.random() < 0.5:
                self._at(self.now + self.rng.random() * latency, "death", w, pid, token, -1)
            else:
                self._at(end, "push", w, pid, token, steps, True)
            return
        self._at(end, "push", w, pid, token, steps, False)

    # -- pushes --------------------------------------------------------------------
    def _calls(self, w: int, pid: int, token: int | None, steps: list[int]) -> list:
        """The shard calls of ``ShardClient.push``, in order, as ``(shard, fn)``."""
        a = self.attempts[pid]
        if not self.gated:
            return [(i, lambda i=i, s=s: s.push(pid, w, steps[i], {"p": grad(pid, a, i)}))
                    for i, s in enumerate(self.shards)]
        fetched = min(steps[0] if token is None else token, *steps)
        calls = [(i, lambda i=i, s=s: s.stage(pid, a, {"p": grad(pid, a, i)}))
                 for i, s in enumerate(self.shards) if i]
        box: dict[str, Any] = {}

        def first():
            box["d"] = self.shards[0].push(pid, w, fetched, {"p": grad(pid, a, 0)}, None, a)
            return box["d"]
        calls.append((0, first))
        calls += [(i, lambda s=s: s.commit(pid, box["d"]))
                  for i, s in enumerate(self.shards) if i]
        if len(self.shards) > 1:
            calls.append((None, lambda: self._ack(pid, box["d"])))
        return calls

    def _ack(self, pid: int, d: Any) -> None:
        """The end of ``ShardClient.settle``: shard 0 learns the others' steps."""
        steps = [s.step for s in self.shards[1:]]
        if d.kind == "applied" and max(steps) > d.step:
            self.shards[0].ack(steps)

    def _call(self, pid: int, shard: int | None, fn) -> Any:
        """Runs one shard call; records ``pid`` as applied on ``shard`` when the shard's
        ledger counted an application (a second one is a violation)."""
        if shard is None:
            return fn()
        led = self.shards[shard].ledger
        before = led.counts["applied"]
        out = fn()
        if led.counts["applied"] != before:
            if led.counts["applied"] != before + 1 or pid in self.applied[shard]:
                raise RuntimeError(f"exactly-once violated: push {pid} applied again on "
                                   f"shard {shard}")
            self.applied[shard][pid] = self.shards[0].ledger.decisions[pid].attempt \
                if self.gated else self.attempts[pid]
        return out

    def _on_push(self, w: int, pid: int, token: int | None, steps: list[int],
                 dies: bool) -> None:
        calls = self._calls(w, pid, token, steps)
        cut = int(self.rng.integers(0, len(calls) + 1)) if dies else len(calls)
        d = None
        for shard, fn in calls[:cut]:
            before = self.shards[0].step
            out = self._call(pid, shard, fn)
            d = out if shard == 0 else d
            self.update_times += [self.now] * (self.shards[0].step - before)
        if dies:
            self.half_pushes += 0 < cut
            self._on_death(w, pid, token, cut)
            return
        wk = self.workers[w]
        if self.gated:
            if d.duplicate and token is not None:
                self.shards[0].return_token(token)
                self.returned += 1
            wk.local_step = steps[0] if token is None else token
            wk.min_step = d.step + 1 if d.kind == "applied" else 0
        self.completed += 1
        self.sched.finish(w, self.closures[pid])  # the coordinator's _finish
        self.sched.arrive(w)  # its thread takes the next step
        self._relax(self.sched.maybe_relax())

    def _on_death(self, w: int, pid: int, token: int | None, cut: int) -> None:
        self.deaths += 1
        if self.gated:
            if token is not None:
                self.shards[0].return_token(token)
                self.returned += 1
            if len(self.shards) > 1:  # the coordinator settles a decided push
                before = [s.ledger.counts["applied"] for s in self.shards]
                self.client.settle(pid)
                for i, s in enumerate(self.shards):
                    if s.ledger.counts["applied"] > before[i]:
                        if pid in self.applied[i]:
                            raise RuntimeError(f"exactly-once violated: push {pid} "
                                               f"settled twice on shard {i}")
                        self.applied[i][pid] = s.ledger.decisions[pid].attempt
        self.workers[w] = _Worker(alive=False)
        self.live -= 1
        self.sched.worker_lost(w)  # the coordinator's _worker_lost
        self.sched.put_back(self.closures[pid])  # back at the front, same id
        if self.gated:
            self.shards[0].set_live_workers(self._live())
        self._at(self.now + self.cfg.restart, "restart", w, pid)

    def _on_restart(self, w: int, pid: int) -> None:
        self.workers[w] = _Worker()
        self.live += 1
        self.sched.worker_back(w)  # the coordinator's _revive
        self.sched.arrive(w)  # on a new thread
        if self.gated:
            self.shards[0].set_live_workers(self._live())

    # -- results -------------------------------------------------------------------
    def _result(self) -> dict[str, Any]:
        summaries = [s.ledger.summary() for s in self.shards]
        check_invariant(self, summaries)
        hist = summaries[0]["staleness"]
        n = sum(hist.values())
        updates = self.shards[0].step
        return {"mode": self.cfg.mode, "workers": self.cfg.workers,
                "shards": self.cfg.shards, "steps": self.completed,
                "updates": updates, "vtime": self.now,
                "updates_per_s": steady_rate(self.update_times),
                # accepted gradients at the steady rate (token-gated: k per update)
                "grads_per_s": steady_rate(self.update_times) * (self.k if self.gated
                                                                 else 1),
                "staleness_mean": sum(k * v for k, v in hist.items()) / n if n else 0.0,
                "staleness_max": max(hist, default=0),
                "dropped": summaries[0]["stale"] + summaries[0]["backup"],
                "deaths": self.deaths, "half_pushes": self.half_pushes,
                "cancelled": self.cancelled}


def steady_rate(times: list[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Updates per virtual second between the ``lo`` and ``hi`` quantiles of the update
    times (leaves out the ramp-up and the tail of the last steps); over the whole run
    when there are too few updates for that."""
    n = len(times)
    if n < 10:  # the mean interval between updates (the first one from time 0)
        if n >= 2 and times[-1] > times[0]:
            return (n - 1) / (times[-1] - times[0])
        return n / times[-1] if n and times[-1] > 0 else 0.0
    i, j = int(lo * n), int(hi * n)
    return (j - i) / (times[j] - times[i]) if times[j] > times[i] else float("inf")


def check_invariant(sim: Sim, summaries: list[dict[str, Any]]) -> None:
    """Raises RuntimeError unless the run was exactly-once (see the module doc)."""
    def fail(msg: str):
        raise RuntimeError(f"exactly-once invariant ({sim.cfg}): {msg}")

    for i, (s, summ) in enumerate(zip(sim.shards, summaries)):
        kinds = summ["applied"] + summ["stale"] + summ["backup"] + summ["duplicate"]
        if summ["pushes"] != kinds:
            fail(f"shard {i}: {summ['pushes']} pushes but {kinds} outcomes")
        if summ["applied"] != len(sim.applied[i]):
            fail(f"shard {i}: ledger applied {summ['applied']}, seen {len(sim.applied[i])}")
        if set(sim.applied[i]) != set(sim.applied[0]):
            fail(f"shard {i} applied other ids than shard 0: "
                 f"{sorted(set(sim.applied[i]) ^ set(sim.applied[0]))[:10]}")
        if s.step != sim.shards[0].step:
            fail(f"shard {i} at step {s.step}, shard 0 at {sim.shards[0].step}")
        got = s.pull()[1]["p"]
        want = _expected(sim, i)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            fail(f"shard {i}: parameters {got} != the sum of its applied updates {want}")
    if sim.gated:
        dec = sim.shards[0].ledger.decisions
        for i, s in enumerate(sim.shards[1:], 1):
            for pid in sim.applied[i]:
                if s.ledger.decisions[pid] != dec[pid]:
                    fail(f"shard {i}: decision of push {pid} differs from shard 0's")


def _expected(sim: Sim, i: int) -> np.ndarray:
    """Shard ``i``'s parameters from its applied pushes (float64)."""
    if not sim.gated:
        total = sum((grad(p, a, i).astype(np.float64) for p, a in sim.applied[i].items()),
                    np.zeros(DIM))
        return -LR * total
    dec = sim.shards[0].ledger.decisions
    by_step: dict[int, list] = {}
    for p, a in sim.applied[i].items():
        by_step.setdefault(dec[p].step, []).append(grad(p, a, i).astype(np.float64))
    total = np.zeros(DIM)
    for st, gs in by_step.items():
        if st < sim.shards[0].step:
            total += sum(gs) / sim.k
    return -LR * total


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Runs ``cfg``; returns its row (the invariant checked) with its wall time."""
    t0 = time.perf_counter()
    row = Sim(cfg).run()
    row["wall_s"] = time.perf_counter() - t0
    return row


def steps_for(mode: str, workers: int, shards: int, scale: float = 1.0) -> int:
    """Steps per configuration, to fit the whole table in under a minute: bounded mode
    runs at most tau + 1 steps at once whatever the workers, so a few hundred steps
    show it; token-gated mode makes about one update per round of every worker."""
    if mode == "bounded":
        base = 200
    elif mode == "ssp":  # ten rounds of every worker: the slowest clock binds
        base = 10 * workers if workers >= 100 else 200
    elif mode == "gated":
        base = {10: 200, 100: 400, 1000: 2000}.get(workers, 2 * workers)
    else:
        base = {10: 200, 100: 400, 1000: 1500}.get(workers, 2 * workers)
    if shards >= 16 and workers >= 1000 and mode != "gated":
        base = base * 3 // 4
    return max(1, int(base * scale))


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| mode | workers | shards | steps | updates | updates / virtual s | "
            "gradients / virtual s | staleness mean | max | dropped | deaths (half-pushed) "
            "| wall s |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['workers']} | {r['shards']} | {r['steps']} | "
            f"{r['updates']} | {r['updates_per_s']:.2f} | {r['grads_per_s']:.1f} | "
            f"{r['staleness_mean']:.1f} | "
            f"{r['staleness_max']} | {r['dropped']} | {r['deaths']} ({r['half_pushes']}) | "
            f"{r['wall_s']:.2f} |")
    return "\n".join(lines)


def share_compiles() -> str:
    """Points JAX's persistent compilation cache at a fresh temporary folder, so that
    the shards' identical updates compile once per run of this file, not once per
    shard (XLA's compile is most of the wall time otherwise). Returns the folder."""
    import jax
    folder = tempfile.mkdtemp(prefix="ps_scale_sim_")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="steps per configuration x")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, nargs="*", default=[10, 100, 1000])
    ap.add_argument("--shards", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--tau", type=int, default=4,
                    help="bounded: the staleness bound; ssp: the clock lead")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    folder = share_compiles()
    rows = []
    for mode in args.modes:
        for w in args.workers:
            for s in args.shards:
                rows.append(simulate(SimConfig(w, s, mode, steps_for(mode, w, s, args.scale),
                                               tau=args.tau, seed=args.seed)))
                print(f"  {mode} {w}x{s}: {rows[-1]['wall_s']:.2f} s", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)
    print(table(rows))
    print(f"\n{len(rows)} runs, invariant checked on each, {time.perf_counter() - t0:.1f} s "
          f"wall ({time.strftime('%Y-%m-%d', time.gmtime())}); latency 1 + Exp(0.5), "
          f"5 % deaths, tau (and ssp's s) {args.tau}, token-gated 0.9 x workers of workers.")
    keys = ["mode", "workers", "shards", "steps", "updates", "updates_per_s", "grads_per_s",
            "staleness_mean", "staleness_max", "dropped", "deaths", "half_pushes", "wall_s"]
    _record.write(args.json, "ps_scale_sim",
                  "Parameter server at 10-1,000 simulated workers (virtual time)", keys,
                  [[r[k] for k in keys] for r in rows], scale=args.scale, seed=args.seed)


if __name__ == "__main__":
    main()
