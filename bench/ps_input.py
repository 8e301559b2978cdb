"""ParameterServerStrategy input: read on the workers (PER_WORKER) vs on the driver (SINGLE).

A slow source (each element: ``--sleep`` ms of waiting, as on a remote store, plus some
NumPy decoding work) feeds an MLP 64-256-256-10 with sgd, 4 workers, 2 shards, 8
simulated CPU devices:

* ``PER_WORKER``: ``input_fn`` runs on each worker (its thread, or its Ray actor); a
  scheduled step carries no batch;
* ``SINGLE``: the driver reads every batch and ships it with the step (default
  prefetch, and ``prefetch_on_device=True``).

Reported per mode: steps/s (scheduled steps over the wall time until ``join``), the
driver thread's CPU per step (``time.thread_time`` of the thread that calls
``rep.run``; embedded carrier) and the whole process's CPU per step
(``time.process_time``: with the embedded carrier the workers' threads are in it).
Modes are interleaved over ``--rounds`` rounds; medians.

    python bench/ps_input.py [--steps 200] [--rounds 3] [--sleep 5] [--ray]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jreplicate as jr  # noqa: E402
from bench.parameter_server import forward, init  # noqa: E402

BATCH = 64


def slow_source(sleep_s: float):
    def input_fn(ctx):
        rng = np.random.default_rng(ctx.input_pipeline_id)
        b = ctx.get_per_replica_batch_size(BATCH)
        m = rng.normal(size=(64, 64)).astype(np.float32)

        def gen():
            while True:
                time.sleep(sleep_s)  # waiting on storage
                x = rng.normal(size=(b, 64)).astype(np.float32)
                for _ in range(4):  # decoding work
                    x = np.tanh(x @ m)
                yield x, rng.integers(0, 10, size=(b,)).astype(np.int32)
        return gen()
    return input_fn


def measure(mode: str, steps: int, sleep_s: float, carrier: str) -> dict[str, float]:
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=4, carrier=carrier)
    rep = jr.Replicator(s)
    with rep.scope():
        p = init(jax.random.key(0))
        tx = jr.ps.pushable(optax.sgd(1e-2))
        o = tx.init(p)

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y), BATCH))(p)
        u, o = tx.update(g, o, p)
        return jnp.zeros(())  # outputs kept small: the input path is what is timed

    if mode == "PER_WORKER":
        it = rep.prepare_input(slow_source(sleep_s))
    else:
        it = rep.prepare_input(slow_source(sleep_s), jr.InputReplicationMode.SINGLE,
                               prefetch_on_device=True if mode == "SINGLE+prefetch" else None)
    for _ in range(16):  # compile on every worker
        rep.run(step, it, p, o)
    rep.join()
    t0, c0, pc0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        rep.run(step, it, p, o)
    c_sched = time.thread_time() - c0
    rep.join()
    wall = time.perf_counter() - t0
    out = {"steps/s": steps / wall,
           "driver CPU ms/step": 1e3 * (time.thread_time() - c0) / steps,
           "driver CPU ms/step (scheduling only)": 1e3 * c_sched / steps,
           "process CPU ms/step": 1e3 * (time.process_time() - pc0) / steps}
    it.close()
    s.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=5.0, help="ms per element")
    ap.add_argument("--ray", action="store_true", help="also the Ray carrier")
    a = ap.parse_args()
    modes = ["PER_WORKER", "SINGLE", "SINGLE+prefetch"]
    carriers = ["embedded"] + (["ray"] if a.ray else [])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; 4 workers, 2 shards, "
          f"source {a.sleep} ms/element + numpy work, {a.steps} steps x {a.rounds} rounds")
    for carrier in carriers:
        got: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(a.rounds):
            for m in modes[r % 3:] + modes[:r % 3]:
                got[m].append(measure(m, a.steps, a.sleep / 1e3, carrier))
        keys = list(got[modes[0]][0])
        print(f"\n{carrier}: | mode | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for m in modes:
            med = [statistics.median(x[k] for x in got[m]) for k in keys]
            print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in med) + " |")


if __name__ == "__main__":
    main()
