"""The driver's CPU per ``rep.run`` under ParameterServerStrategy (embedded carrier).

A tiny step (MLP 16-32-32-10, adam, batch 64 as NumPy arrays, 2 shards, 2 workers) so
that the driver's own work per call shows: the thread CPU time (``time.thread_time``)
of the calling thread over ``--runs`` calls of ``rep.run`` (scheduling only: the steps
run on the workers' threads, and ``join`` is outside the timing), the median over
``--rounds``; beside it the same with the driver-side argument check
(:func:`jreplicate.ps.run_arguments.check_run_arguments`) replaced by a no-op, and that
check alone on the step's arguments.

    python bench/ps_driver_cost.py [--runs 300] [--rounds 7]
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jreplicate as jr  # noqa: E402
import jreplicate.ps.executor as ps_executor  # noqa: E402
from jreplicate.ps.run_arguments import check_run_arguments  # noqa: E402

SIZES = [16, 32, 32, 10]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2)
    rep = jr.Replicator(s)
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(64, SIZES[0])).astype(np.float32),
             rng.integers(0, SIZES[-1], size=64).astype(np.int32))
    with rep.scope():
        params = [{"w": jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (m, n))
                   / np.sqrt(m), "b": jnp.zeros(n)}
                  for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:]))]
        tx = jr.ps.pushable(optax.adam(1e-3))
        opt = tx.init(params)

    def step(ctx, batch, p, o):
        x, y = batch

        def loss(p):
            h = x
            for layer in p[:-1]:
                h = jax.nn.relu(h @ layer["w"] + layer["b"])
            logits = h @ p[-1]["w"] + p[-1]["b"]
            per = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]
            return jr.compute_average_loss(per, 64)

        u, o = tx.update(jax.grad(loss)(p), o, p)
        return optax.apply_updates(p, u), o

    def runs() -> float:
        c0 = time.thread_time()
        for _ in range(a.runs):
            rep.run(step, batch, params, opt)
        took = time.thread_time() - c0
        rep.join()
        return 1e6 * took / a.runs

    def check_alone() -> float:
        c0 = time.thread_time()
        for _ in range(10 * a.runs):
            check_run_arguments(batch, (params, opt))
        return 1e6 * (time.thread_time() - c0) / (10 * a.runs)

    try:
        runs()  # compiled on every worker
        real = ps_executor.check_run_arguments
        got: dict[str, list[float]] = {"run": [], "run, no argument check": [],
                                       "argument check alone": []}
        for _ in range(a.rounds):
            ps_executor.check_run_arguments = real
            got["run"].append(runs())
            ps_executor.check_run_arguments = lambda *args, **kw: None
            got["run, no argument check"].append(runs())
            got["argument check alone"].append(check_alone())
    finally:
        ps_executor.check_run_arguments = real
        s.shutdown()
    print(f"driver thread CPU, us per call (median, least-greatest of {a.rounds} rounds of "
          f"{a.runs}; load average {os.getloadavg()[0]:.1f})")
    for name, v in got.items():
        print(f"  {name:26s} {statistics.median(v):6.1f} ({min(v):.1f}-{max(v):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
