"""ParameterServerStrategy throughput: applied updates per second, side by side.

An MLP 64-256-256-10 (the digits' input size) with adam, global batch 64 per step, on
8 simulated CPU devices (2 shards + up to 6 workers, embedded carrier), in one process:

* asynchronous, 1 / 2 / 4 / 6 workers;
* 4 workers with and without one worker 5x slower (extra sleep of 4 step times);
* 4 workers with the straggler: asynchronous, token-gated 4 of 4 (no backup) and
  3 of 4 (one backup);
* embedded vs Ray (4 workers, asynchronous; skipped without Ray).

    python bench/parameter_server.py [--steps 120] [--no-ray] [--hidden 256]
    python bench/parameter_server.py --ray-vs-handwritten [bench/ray_baseline.py's options]

``--ray-vs-handwritten`` runs ``bench/ray_baseline.py``: the Ray carrier against Ray's
parameter-server tutorial ported to JAX on this model, side by side (updates/s and CPU
per update at 1, 2 and 4 workers, the default MLP and a compute-bound one).

Updates/s counts the updates the shards applied (token-gated: aggregated updates,
``global_step``) over the wall time of ``steps`` scheduled steps after a warm-up that
compiles on every worker. CPU "devices" share the machine's cores, so more workers add
little here: the figures show overheads and the straggler effects, not GPU scaling.
"""

from __future__ import annotations

import argparse
import os
import subprocess
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
import jreplicate.testing as jrt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

SIZES = [64, 256, 256, 10]


def init(key, sizes=None):
    sizes = sizes or SIZES
    return [{"w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a),
             "b": jnp.zeros(b)} for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


def forward(p, x):
    for layer in p[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ p[-1]["w"] + p[-1]["b"]


def measure(workers: int, tx_fn, steps: int, *, straggler: float = 0.0,
            carrier: str = "embedded") -> tuple[float, float]:
    """Returns (updates/s, seconds per step of one worker)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=workers, carrier=carrier)
    rep = jr.Replicator(s)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=64).astype(np.int32)
    with rep.scope():
        params = init(jax.random.key(0))
        tx = jr.ps.pushable(tx_fn())
        opt = tx.init(params)

    def step(ctx, batch, p, o):
        xb, yb = batch

        def loss(p):
            logits = forward(p, xb)
            per = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1)[:, 0]
            return jr.compute_average_loss(per, 64)

        g = jax.grad(loss)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    batch = (x, y)
    for _ in range(3 * workers):
        rep.run(step, batch, params, opt)
    rep.join()
    t0 = time.monotonic()
    for _ in range(2 * workers):
        rep.run(step, batch, params, opt)
    rep.join()
    one = (time.monotonic() - t0) / 2  # about one step of every worker
    if straggler:
        jrt.set_worker_delay(s, workers - 1, straggler * one)
    g0 = s.global_step
    t0 = time.monotonic()
    for _ in range(steps):
        rep.run(step, batch, params, opt)
    rep.join()
    took = time.monotonic() - t0
    rate = (s.global_step - g0) / took
    s.shutdown()
    return rate, one


def main() -> int:
    if "--ray-vs-handwritten" in sys.argv[1:]:  # its own process: Ray's actors inherit
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no 8 devices
        rest = [a for a in sys.argv[1:] if a != "--ray-vs-handwritten"]
        return subprocess.call([sys.executable, os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "ray_baseline.py"), *rest], env=env)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--hidden", type=int, default=256,
                        help="hidden width of the MLP (a larger one makes compute dominate)")
    parser.add_argument("--ray-vs-handwritten", action="store_true",
                        help="run bench/ray_baseline.py (the Ray carrier against Ray's "
                             "tutorial parameter server) with the other options")
    _record.add_argument(parser)
    args = parser.parse_args()
    SIZES[1] = SIZES[2] = args.hidden
    adam = lambda: optax.adam(1e-3)  # noqa: E731
    rows, by_workers = [], []
    for n in (1, 2, 4, 6):
        rate = measure(n, adam, args.steps)[0]
        rows.append((f"async, {n} worker(s)", rate))
        by_workers.append([n, rate])
    base, one = measure(4, adam, args.steps)
    slow, _ = measure(4, adam, args.steps, straggler=4.0)
    rows += [("async, 4 workers (again, paired)", base),
             ("async, 4 workers, one 5x straggler", slow)]
    sync4 = lambda: jr.sync_replicas(optax.adam(1e-3), 4, 4)  # noqa: E731
    sync3 = lambda: jr.sync_replicas(optax.adam(1e-3), 3, 4)  # noqa: E731
    for name, fn in (("token-gated 4 of 4 (no backup)", sync4),
                     ("token-gated 3 of 4 (one backup)", sync3)):
        clean = measure(4, fn, args.steps)[0]
        strag = measure(4, fn, args.steps, straggler=4.0)[0]
        rows += [(f"{name}", clean), (f"{name}, one 5x straggler", strag)]
    ray_rate = None
    if not args.no_ray:
        try:
            import ray

            from jreplicate.ps.ray.carrier import ensure_ray
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ensure_ray()  # a private Ray on 127.0.0.1 only, no dashboard
            ray_rate = measure(4, adam, args.steps, carrier="ray")[0]
            rows.append(("Ray carrier, async, 4 workers", ray_rate))
            ray.shutdown()
        except ImportError:
            print("(Ray not installed: pip install 'jreplicate[ray]'; Ray row skipped)")
    print(f"\nupdates/s (MLP {'-'.join(map(str, SIZES))}, adam, batch 64; one step of one worker ~ "
          f"{one * 1e3:.1f} ms with 4 busy)\n")
    print(f"| {'configuration':<50} | updates/s |")
    print(f"|{'-' * 52}|-----------|")
    for name, r in rows:
        print(f"| {name:<50} | {r:9.1f} |")
    print(f"\nstraggler, async: {slow / base:.2f}x of no straggler")
    if ray_rate is not None:
        print(f"Ray / embedded (4 workers, async): {ray_rate / base:.2f}x")
    _record.write(args.json, "parameter_server",
                  "ParameterServerStrategy: applied updates per second",
                  ["configuration", "updates/s"], rows, steps=args.steps,
                  model="MLP " + "-".join(map(str, SIZES)), one_step_s=one,
                  async_by_workers=by_workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
