"""Step time of a shard_map train step with ``sync_replicas`` vs the same step with plain adam.

Runs on 8 simulated CPU devices (or the first 8 devices of the default backend with
``--backend default``), in one process, with the variants interleaved in every repeat,
and prints the ratio of median step times (target: <= 1.05 for ``sync 8/0``).

    python bench/sync_replicas.py [--repeats 30] [--steps 20] [--backend default --replicas N]

``--replicas`` sets the replica count N (default 8; with ``--backend default`` every
device up to 8); the variants are then ``sync N/0``
and, from 4 replicas on, ``sync N-2/2`` with and without the schedule (one GPU: N = 1,
``plain`` against ``sync 1/0``: the accumulator's own cost).

Variants (all ``jax.jit(jax.shard_map(...))`` over a 1-D ``"replica"`` mesh):

* ``plain``: ``jax.grad`` of the replicated params (JAX sums it over replicas), divided
  by the replica count, through ``optax.adam``: hand-written synchronous data parallelism.
* ``sync 8/0``: each replica's own gradient (``replica_grad``) through
  ``sync_replicas(adam, replicas_to_aggregate=8)``.
* ``sync 6/2``: the same with 2 backup replicas and per-replica arrival times (one
  extra small all-reduce gathers them).
* ``sync 6/2 sched``: the same, with the arrival schedule passed as one replicated
  vector of every replica's time (no gather needed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--backend" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jreplicate.sync import replica_grad, sync_replicas  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

N = 8


def init_mlp(key, sizes):
    return [
        {
            "w": jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a),
            "b": jnp.zeros(b),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    ]


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def variants_for(n: int) -> list[str]:
    """The variants timed with ``n`` replicas (backups need at least 4)."""
    out = ["plain", f"sync {n}/0"]
    if n >= 4:
        out += [f"sync {n - 2}/2", f"sync {n - 2}/2 sched"]
    return out


def build(mesh, variant, inner):
    if variant == "plain":
        tx = inner

        def step(p, s, x, y, t):
            g = jax.grad(loss_fn)(p, x, y)  # summed over replicas by shard_map's AD
            g = jax.tree.map(lambda a: a / N, g)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

    else:
        k = int(variant.split()[1].split("/")[0])
        tx = sync_replicas(inner, replicas_to_aggregate=k)
        sched = variant.endswith("sched")

        def step(p, s, x, y, t):
            g = replica_grad(loss_fn)(p, x, y)
            arrival = None if k == N else (t if sched else t[0])
            u, s = tx.update(g, s, p, arrival_time=arrival)
            return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("replica"), P("replica"),
                      P() if variant.endswith("sched") else P("replica")),
            out_specs=(P(), P()),
        ),
        donate_argnums=(0, 1),
    )
    return tx, run


def main(argv=None):
    global N
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20, help="steps timed per repeat")
    ap.add_argument("--batch", type=int, default=32, help="per-replica batch")
    ap.add_argument("--sizes", default="64,512,512,10", help="MLP layer sizes")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "default"])
    ap.add_argument("--replicas", type=int, default=None,
                    help="replicas (default 8 on cpu, else every device up to 8)")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    found = jax.devices("cpu" if args.backend == "cpu" else None)
    N = args.replicas or (8 if args.backend == "cpu" else min(8, len(found)))
    devices = found[:N]
    if len(devices) < N:
        raise SystemExit(f"needs {N} devices, found {len(devices)}")
    mesh = jax.make_mesh((N,), ("replica",), devices=devices)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rng = np.random.default_rng(0)
    shard = NamedSharding(mesh, P("replica"))
    x = jax.device_put(rng.normal(size=(N * args.batch, sizes[0])).astype(np.float32), shard)
    y = jax.device_put(rng.integers(0, sizes[-1], size=N * args.batch).astype(np.int32), shard)
    t_host = rng.exponential(size=N).astype(np.float32)
    t = jax.device_put(t_host, shard)
    t_sched = jax.device_put(t_host, NamedSharding(mesh, P()))

    variants = variants_for(N)
    inner = optax.adam(1e-3)
    state = {}
    for v in variants:
        tx, run = build(mesh, v, inner)
        params = init_mlp(jax.random.key(0), sizes)
        opt = tx.init(params)
        tv = t_sched if v.endswith("sched") else t
        params, opt = run(params, opt, x, y, tv)  # compile + warm up
        jax.block_until_ready(params)
        state[v] = [run, params, opt, tv]

    times = {v: [] for v in variants}
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            run, params, opt, tv = state[v]
            start = time.perf_counter()
            for _ in range(args.steps):
                params, opt = run(params, opt, x, y, tv)
            jax.block_until_ready((params, opt))
            times[v].append((time.perf_counter() - start) / args.steps)
            state[v][1:3] = [params, opt]

    n_params = sum(p.size for p in jax.tree.leaves(state["plain"][1]))
    print(
        f"# {N} replicas on {devices[0].platform}, MLP {sizes} ({n_params} params), "
        f"per-replica batch {args.batch}, {args.repeats} repeats x {args.steps} steps"
    )
    base, base_min = statistics.median(times["plain"]), min(times["plain"])
    print(f"{'variant':<15} {'median ms/step':>15} {'ratio vs plain':>15} {'ratio of mins':>14}")
    for v in variants:
        med = statistics.median(times[v])
        print(f"{v:<15} {med * 1e3:>15.3f} {med / base:>15.3f} {min(times[v]) / base_min:>14.3f}")
    _record.write(args.json, "sync_replicas", "Step time of sync_replicas against plain adam",
                  ["variant", "ms/step", "ratio vs plain", "ratio of mins"],
                  [[v, statistics.median(times[v]) * 1e3, statistics.median(times[v]) / base,
                    min(times[v]) / base_min] for v in variants],
                  replicas=N, sizes=list(sizes), batch=args.batch, repeats=args.repeats,
                  steps=args.steps, platform=devices[0].platform)
    return {v: statistics.median(times[v]) / base for v in variants}


if __name__ == "__main__":
    main()
