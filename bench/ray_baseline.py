"""The Ray carrier against a parameter server written the way Ray's documentation teaches.

The baseline is Ray's ``plot_parameter_server`` tutorial (asynchronous version) ported
to JAX on ``bench/parameter_server.py``'s model (MLP 64-H-H-10, adam 1e-3, batch 64):

* one ``ParameterServer`` actor whose ``apply_gradients(*gradients)`` sums the
  gradients, applies them with a jit-compiled optax update and returns the weights;
* ``DataWorker`` actors whose ``compute_gradients(weights)`` runs a jit-compiled
  ``jax.grad`` on the worker's own batch;
* the driver's loop passes refs, not values::

      ready, _ = ray.wait(list(gradients))
      worker = gradients.pop(ready[0])
      current_weights = ps.apply_gradients.remote(*[ready[0]])
      gradients[worker.compute_gradients.remote(current_weights)] = worker

The carrier runs the same model with ``jr.ParameterServerStrategy(carrier="ray")``,
``num_ps=1`` (the tutorial's one PS; ``--num-ps 1 2`` adds 2 shards), the batch read
on each worker (``PER_WORKER`` input, as the tutorial's workers hold their data), and the
non-pinning pattern (``rep.run(...)`` without keeping the values). Every actor asks for
``num_cpus=0`` in both, on a private loopback Ray (:func:`ensure_ray`).

Measured side by side in one run: for each model size and number of workers, every
system is built and warmed once, then timed in ``--rounds`` interleaved rounds (the
order rotated each round) of ``--updates`` applied updates; medians. Reported:
updates/s and CPU milliseconds per update summed over the driver and every process of
the Ray session (the driver's descendants: GCS, raylet, agents, actors), read with psutil
before and after each timed run; "vs hand-written" is the median over rounds of each
round's ratio to the tutorial (paired, so that drift between rounds cancels), with the
least and greatest of those ratios beside it. Before
each timed run the session is left to go idle (:func:`quiesce`), so that no run pays
for the previous one's clean-up.

    python bench/ray_baseline.py [--updates 120] [--rounds 5] [--workers 1 2 4]
        [--hidden 256 1024] [--num-ps 1 2]
    python bench/parameter_server.py --ray-vs-handwritten   (the same, default arguments)
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's worker processes import this module and bench.parameter_server by name.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

import jreplicate as jr  # noqa: E402
from bench import _record  # noqa: E402
from bench._timing import mlp as forward  # noqa: E402 (bench/parameter_server.py's MLP)
from jreplicate.ps.ray.carrier import ensure_ray  # noqa: E402

SIZES = [64, 256, 256, 10]  # bench/parameter_server.py's MLP (hidden sizes varied)
BATCH = 64
LR = 1e-3
ACTOR_ENV = {"env_vars": {"JAX_PLATFORMS": "cpu",
                          "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}}


def init(key, sizes):
    """bench/parameter_server.py's initialisation (not imported: that module sets
    XLA_FLAGS for 8 devices, which Ray's processes would inherit)."""
    return [{"w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a),
             "b": jnp.zeros(b)} for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


def sizes_for(hidden: int) -> list[int]:
    return [SIZES[0], hidden, hidden, SIZES[-1]]


def the_batch(worker: int):
    """Worker ``worker``'s batch (each worker reads its own, as the tutorial's)."""
    rng = np.random.default_rng(worker)
    return (rng.normal(size=(BATCH, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], size=BATCH).astype(np.int32))


def loss_fn(p, x, y):
    per = -jnp.take_along_axis(jax.nn.log_softmax(forward(p, x)), y[:, None], 1)[:, 0]
    return jnp.sum(per) / BATCH


# -- the tutorial, ported to JAX ---------------------------------------------------------
@ray.remote(num_cpus=0)
class ParameterServer:
    def __init__(self, sizes):
        self.params = init(jax.random.key(0), sizes)
        self.tx = optax.adam(LR)
        self.opt = self.tx.init(self.params)

        def update(p, o, g):
            u, o = self.tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        self.update = jax.jit(update)

    def apply_gradients(self, *gradients):
        summed = jax.tree.map(lambda *g: np.sum(g, axis=0), *gradients)
        self.params, self.opt = self.update(self.params, self.opt, summed)
        return jax.tree.map(np.asarray, self.params)

    def get_weights(self):
        return jax.tree.map(np.asarray, self.params)


@ray.remote(num_cpus=0)
class DataWorker:
    def __init__(self, worker):
        self.x, self.y = the_batch(worker)
        self.grad = jax.jit(jax.grad(loss_fn))

    def compute_gradients(self, weights):
        return jax.tree.map(np.asarray, self.grad(weights, self.x, self.y))


class Tutorial:
    """The tutorial's asynchronous parameter server with ``n`` workers."""

    name = "hand-written (tutorial)"

    def __init__(self, n: int, sizes: list[int]):
        opts = {"runtime_env": ACTOR_ENV}
        self.ps = ParameterServer.options(**opts).remote(sizes)
        self.workers = [DataWorker.options(**opts).remote(i) for i in range(n)]

    def run(self, updates: int) -> int:
        current_weights = self.ps.get_weights.remote()
        gradients = {w.compute_gradients.remote(current_weights): w for w in self.workers}
        for _ in range(updates):
            ready, _ = ray.wait(list(gradients))
            worker = gradients.pop(ready[0])
            current_weights = self.ps.apply_gradients.remote(*[ready[0]])
            gradients[worker.compute_gradients.remote(current_weights)] = worker
        ray.get(current_weights, timeout=600)
        self._left = list(gradients)  # computed, not applied: drained outside the timing
        return updates

    def drain(self) -> None:
        ray.get(self._left, timeout=600)

    def close(self) -> None:
        for a in [self.ps, *self.workers]:
            ray.kill(a)


# -- the carrier ----------------------------------------------------------------------
def input_fn(ctx):
    batch = the_batch(ctx.input_pipeline_id)
    return lambda: batch


class Carrier:
    """``ParameterServerStrategy(carrier="ray")`` on the same model."""

    def __init__(self, n: int, sizes: list[int], num_ps: int):
        self.name = f"Ray carrier, num_ps={num_ps}"
        self.s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=n, carrier="ray")
        self.rep = jr.Replicator(self.s)
        with self.rep.scope():
            self.params = init(jax.random.key(0), sizes)
            self.tx = jr.ps.pushable(optax.adam(LR))
            self.opt = self.tx.init(self.params)
        self.inputs = self.rep.prepare_input(input_fn)
        tx = self.tx

        def step(ctx, batch, p, o):
            g = jax.grad(loss_fn)(p, *batch)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        self.step = step

    def run(self, updates: int) -> int:
        g0 = self.s.global_step
        for _ in range(updates):
            self.rep.run(self.step, self.inputs, self.params, self.opt)
        self.rep.join()
        return self.s.global_step - g0

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.s.shutdown()


# -- measurement -------------------------------------------------------------------------
def session_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of this process and each of its descendants, with
    the process's name (an actor's process ``ray::Class``: :func:`_process_name`)."""
    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = "driver" if p.pid == me.pid else _process_name(p.name())
            out[p.pid] = (name, t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _process_name(name: str) -> str:
    """An actor's process by its class: Ray names it ``ray::Class`` while idle and
    ``ray::Class.method`` while it runs a method (one process, two names)."""
    return name.split(".", 1)[0] if name.startswith("ray::") else name


def cpu_between(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two readings, by process name."""
    out: dict[str, float] = {}
    for pid, (name, t) in after.items():
        out[name] = out.get(name, 0.0) + t - before.get(pid, (name, 0.0))[1]
    return out


BREAKDOWN: dict[str, dict[str, list[float]]] = {}  # system -> process -> ms/update


def quiesce(limit: float = 3.0, window: float = 0.2, idle: float = 0.1) -> None:
    """Waits (at most ``limit`` seconds) until the session's processes use under
    ``idle`` of a core over ``window`` seconds: the previous run's clean-up (objects
    freed, outputs let go) then lands in no other system's timing."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        c0 = session_cpu()
        time.sleep(window)
        if sum(cpu_between(c0, session_cpu()).values()) < idle * window:
            return


def timed(system, updates: int) -> tuple[float, float]:
    """(updates/s, CPU ms per update) of one run."""
    quiesce()
    c0, t0 = session_cpu(), time.perf_counter()
    done = system.run(updates)
    took, c1 = time.perf_counter() - t0, session_cpu()
    system.drain()
    by_name = cpu_between(c0, c1)
    for name, sec in by_name.items():
        BREAKDOWN.setdefault(system.name, {}).setdefault(name, []).append(1e3 * sec / done)
    return done / took, 1e3 * sum(by_name.values()) / done


def compare(n: int, hidden: int, num_ps: list[int], updates: int, rounds: int):
    sizes = sizes_for(hidden)
    systems = [Tutorial(n, sizes)] + [Carrier(n, sizes, k) for k in num_ps]
    try:
        for s in systems:  # compile everywhere, fill caches
            s.run(max(4 * n, 8))
            s.drain()
        got = {s.name: [] for s in systems}
        for r in range(rounds):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for s in order:
                got[s.name].append(timed(s, updates))
    finally:
        for s in systems:
            s.close()
    # Each system's rate against the tutorial's in the same round (adjacent runs), so
    # that the machine's drift between rounds cancels; the median of those ratios, and
    # their least and greatest (how far one round can stray).
    base = got[Tutorial.name]
    out = {}
    for name, v in got.items():
        ratios = [x[0] / b[0] for x, b in zip(v, base)]
        out[name] = (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
                     statistics.median(ratios), min(ratios), max(ratios))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=120,
                    help="applied updates per timed run, at every model size (a run of "
                         "the compute-bound model then lasts about 2 s: shorter runs, "
                         "such as the 40 used before 2026-11-26, moved its ratio by "
                         "about 0.1 between runs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--num-ps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--breakdown", action="store_true",
                    help="also CPU ms per update by process (last configuration)")
    _record.add_argument(ap)
    a = ap.parse_args(argv)
    ensure_ray()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    rows = []
    for hidden in a.hidden:
        for n in a.workers:
            res = compare(n, hidden, a.num_ps, a.updates, a.rounds)
            for name, (rate, cpu, paired, lo, hi) in res.items():
                rows.append((hidden, n, name, rate, cpu, paired, lo, hi))
            if a.breakdown:
                for system, procs in BREAKDOWN.items():
                    print(f"    {system}: " + ", ".join(
                        f"{p} {statistics.median(v):.1f}" for p, v in sorted(
                            procs.items(), key=lambda kv: -statistics.median(kv[1]))
                        if statistics.median(v) >= 0.05))
            BREAKDOWN.clear()
            print(f"  done: hidden {hidden}, {n} workers ({a.updates} updates x {a.rounds} "
                  f"rounds; load {os.getloadavg()[0]:.2f})", flush=True)
    print("\n| MLP | workers | system | updates/s | CPU ms/update | vs hand-written "
          "(rounds: least-greatest) |")
    print("|---|---|---|---|---|---|")
    for hidden, n, name, rate, cpu, ratio, lo, hi in rows:
        print(f"| 64-{hidden}-{hidden}-10 | {n} | {name} | {rate:.1f} | {cpu:.1f} | "
              f"{ratio:.2f}x ({lo:.2f}-{hi:.2f}) |")
    print(f"\nload average at the end: {os.getloadavg()}")
    _record.write(a.json, "ray_baseline",
                  "The Ray carrier against a parameter server written as Ray's docs teach",
                  ["hidden", "workers", "system", "updates/s", "CPU ms/update",
                   "vs hand-written", "least round", "greatest round"], rows,
                  updates=a.updates, rounds=a.rounds, num_ps=a.num_ps,
                  load_average_end=os.getloadavg()[0])
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
