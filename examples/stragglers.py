"""Backup workers beat stragglers: Chen et al. 2016, "Revisiting Distributed Synchronous SGD".

Trains a small MLP on scikit-learn's digits with 8 simulated replicas whose gradient
latencies follow a shifted exponential (a long tail of stragglers), and compares, on a
virtual wall clock:

* synchronous SGD with ``N`` aggregated replicas and ``b = 8 - N`` backups (8/0, 7/1,
  6/2, 5/3): ``jreplicate.sync_replicas(sgd, replicas_to_aggregate=N)`` inside
  ``jax.shard_map`` over 8 CPU devices, each replica passing its latency as
  ``arrival_time``. A step ends when the N-th fastest gradient arrives; the slowest ``b``
  are dropped (and counted in ``state.dropped_backup``), and every replica starts the
  next step with the new params;
* fully asynchronous SGD: each replica's gradient, computed on the params it last read,
  is applied the moment it arrives, and that replica restarts from the current params.

Prints time-to-target accuracy and final accuracy (mean +- std over seeds) and saves a
plot of test accuracy against virtual time.

    python examples/stragglers.py [--seeds 5] [--out stragglers.png]

The README's table is this script's output with the defaults, which run in about
30-60 s on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import heapq
import os
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jreplicate.sync import replica_grad, sync_replicas  # noqa: E402

REPLICAS = 8
SYNC_CONFIGS = ("8/0", "7/1", "6/2", "5/3")


# -- data and model -----------------------------------------------------------------
def load_data(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(
        x, y.astype(np.int32), test_size=0.25, random_state=seed, stratify=y
    )
    return jnp.asarray(xtr), jnp.asarray(ytr), jnp.asarray(xte), jnp.asarray(yte)


def init_mlp(key, hidden: int):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (64, hidden)) / 8.0,
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden),
        "b2": jnp.zeros(10),
    }


def logits_fn(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(p, x, y):
    logp = jax.nn.log_softmax(logits_fn(p, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def accuracy(p, x, y):
    return jnp.mean(jnp.argmax(logits_fn(p, x), axis=1) == y)


# -- latencies ------------------------------------------------------------------------
def latencies(rng: np.random.Generator, shape, shift: float, scale: float) -> np.ndarray:
    """Gradient computation times: shift + Exponential(scale), a long right tail."""
    return (shift + rng.exponential(scale, size=shape)).astype(np.float32)


# -- synchronous SGD with backups (the SPMD driver of sync_replicas) -----------------
def make_sync_run(mesh, n_aggregate: int, lr: float, batch: int, steps: int):
    tx = sync_replicas(optax.sgd(lr), replicas_to_aggregate=n_aggregate)

    def run(params, key, lat, data):
        xtr, ytr, xte, yte = data
        state = tx.init(params)
        me = jax.lax.axis_index("replica")

        def step(carry, inputs):
            params, state = carry
            t, arrival = inputs
            k = jax.random.fold_in(jax.random.fold_in(key, t), me)
            idx = jax.random.randint(k, (batch,), 0, xtr.shape[0])
            grads = replica_grad(loss_fn)(params, xtr[idx], ytr[idx])
            updates, state = tx.update(grads, state, params, arrival_time=arrival)
            params = optax.apply_updates(params, updates)
            return (params, state), accuracy(params, xte, yte)

        (params, state), accs = jax.lax.scan(step, (params, state), (jnp.arange(steps), lat[:, 0]))
        return accs, state.dropped_backup

    return jax.jit(
        jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(P(), P(), P(None, "replica"), P()),
            out_specs=(P(), P()),
        )
    )


def run_sync(n_aggregate, seed, args, mesh, data, cache):
    rng = np.random.default_rng([seed, n_aggregate])
    mean_step = args.shift + args.scale * np.sum(1.0 / np.arange(REPLICAS - n_aggregate + 1, 9))
    steps = int(np.ceil(args.time_budget / mean_step * 1.25)) + 5
    lat = latencies(rng, (steps, REPLICAS), args.shift, args.scale)
    step_time = np.sort(lat, axis=1)[:, n_aggregate - 1]  # the N-th fastest arrival
    clock = np.cumsum(step_time)
    key = (n_aggregate, steps)
    if key not in cache:
        cache[key] = make_sync_run(mesh, n_aggregate, args.lr, args.batch, steps)
    params = init_mlp(jax.random.key(seed), args.hidden)
    lat_dev = jax.device_put(lat, NamedSharding(mesh, P(None, "replica")))
    accs, dropped = cache[key](params, jax.random.key(10_000 + seed), lat_dev, data)
    assert int(dropped) == (REPLICAS - n_aggregate) * steps
    keep = clock <= args.time_budget
    return clock[keep], np.asarray(accs)[keep]


# -- fully asynchronous SGD -------------------------------------------------------------
def async_events(rng, args):
    """(worker, finish time) of every gradient arrival before the time budget."""
    heap = [(float(latencies(rng, (), args.shift, args.scale)), w) for w in range(REPLICAS)]
    heapq.heapify(heap)
    events = []
    while heap[0][0] <= args.time_budget:
        t, w = heapq.heappop(heap)
        events.append((w, t))
        heapq.heappush(heap, (t + float(latencies(rng, (), args.shift, args.scale)), w))
    return events


def make_async_run(lr: float, batch: int):
    tx = optax.sgd(lr)

    @jax.jit
    def run(params, key, workers, data):
        xtr, ytr, xte, yte = data
        snapshots = jax.tree.map(lambda p: jnp.broadcast_to(p, (REPLICAS, *p.shape)), params)

        def event(carry, inputs):
            params, opt, snaps = carry
            e, w = inputs
            stale = jax.tree.map(lambda s: s[w], snaps)  # params this worker read
            idx = jax.random.randint(jax.random.fold_in(key, e), (batch,), 0, xtr.shape[0])
            grads = jax.grad(loss_fn)(stale, xtr[idx], ytr[idx])
            updates, opt = tx.update(grads, opt, params)
            params = optax.apply_updates(params, updates)
            snaps = jax.tree.map(lambda s, p: s.at[w].set(p), snaps, params)
            return (params, opt, snaps), accuracy(params, xte, yte)

        carry = (params, tx.init(params), snapshots)
        _, accs = jax.lax.scan(event, carry, (jnp.arange(workers.shape[0]), workers))
        return accs

    return run


def run_async(lr, seed, args, data, cache):
    rng = np.random.default_rng([seed, 99])
    events = async_events(rng, args)
    workers = np.array([w for w, _ in events], np.int32)
    clock = np.array([t for _, t in events])
    # pad to a fixed length so one compiled program serves every seed
    n = int(np.ceil(args.time_budget * REPLICAS / (args.shift + args.scale) * 1.3)) + 8
    if len(workers) > n:
        raise RuntimeError(f"async simulation needs {len(workers)} events > {n}")
    padded = np.zeros(n, np.int32)
    padded[: len(workers)] = workers
    if ("async", lr) not in cache:
        cache["async", lr] = make_async_run(lr, args.batch)
    params = init_mlp(jax.random.key(seed), args.hidden)
    run = cache["async", lr]
    accs = np.asarray(run(params, jax.random.key(20_000 + seed), padded, data))
    return clock, accs[: len(workers)]


# -- report -----------------------------------------------------------------------------
def time_to_target(clock, accs, target):
    hit = np.nonzero(accs >= target)[0]
    return float(clock[hit[0]]) if hit.size else float("nan")


def final_accuracy(clock, accs, budget, window=0.1):
    """Mean and std (jitter) of test accuracy over the last ``window`` of the budget."""
    last = accs[clock >= (1 - window) * budget]
    return float(np.mean(last)), float(np.std(last))


def plot(curves, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, args.time_budget, 400)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in curves:
        runs = [
            np.interp(grid, c, a, left=np.nan) if len(c) else np.full_like(grid, np.nan)
            for c, a in curves[name]
        ]
        with warnings.catch_warnings():  # all-NaN columns before the first update
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(np.stack(runs), axis=0)
        is_async = name.startswith("async")
        label = name if is_async else f"sync N/b = {name}"
        ax.plot(grid, mean, label=label, lw=1.5, ls="--" if is_async else "-")
    ax.axhline(args.target, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("virtual wall-clock time (units of the latency shift)")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_ylim(max(0.0, args.target - 0.35), 1.0)
    ax.set_title(f"digits MLP, {REPLICAS} replicas, latency {args.shift} + Exp({args.scale})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument(
        "--configs",
        default=",".join(SYNC_CONFIGS),
        help="synchronous N/b configurations, comma separated (N + b = 8)",
    )
    ap.add_argument("--out", default="stragglers.png", help="where to save the plot")
    ap.add_argument("--time-budget", type=float, default=600.0, help="virtual time units")
    ap.add_argument("--target", type=float, default=0.96, help="target test accuracy")
    ap.add_argument("--lr", type=float, default=1.0, help="sgd learning rate, synchronous")
    ap.add_argument(
        "--async-lr",
        type=float,
        nargs="*",
        default=None,
        help="sgd learning rates of asynchronous runs (default: --lr, and --lr / 8 for "
        "its 8x more frequent updates)",
    )
    ap.add_argument("--batch", type=int, default=16, help="per-replica batch")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--shift", type=float, default=1.0, help="latency shift")
    ap.add_argument("--scale", type=float, default=1.0, help="mean of the exponential tail")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the table as JSON to PATH (bench/report.py reads it)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        n, _, b = c.partition("/")
        if not (n.isdigit() and b.isdigit() and int(n) >= 1 and int(n) + int(b) == REPLICAS):
            ap.error(f"--configs: {c!r} is not N/b with N >= 1 and N + b = {REPLICAS}")
    args.configs = configs
    if args.async_lr is None:
        args.async_lr = [args.lr, args.lr / REPLICAS]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        jax.config.update("jax_num_cpu_devices", REPLICAS)
    except RuntimeError:  # backend already initialised (e.g. under pytest)
        pass
    devices = jax.devices("cpu")
    if len(devices) < REPLICAS:
        raise SystemExit(
            f"needs {REPLICAS} CPU devices, found {len(devices)}: run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    mesh = jax.make_mesh((REPLICAS,), ("replica",), devices=devices[:REPLICAS])
    start = time.perf_counter()
    async_names = {f"async lr {lr:g}": lr for lr in args.async_lr}
    curves = {name: [] for name in (*args.configs, *async_names)}
    cache: dict = {}
    for seed in range(args.seeds):
        data = load_data(seed)
        for name in args.configs:
            n = int(name.split("/")[0])
            curves[name].append(run_sync(n, seed, args, mesh, data, cache))
        for name, lr in async_names.items():
            curves[name].append(run_async(lr, seed, args, data, cache))

    results = {}
    print(
        f"{REPLICAS} replicas, latency {args.shift} + Exp({args.scale}), per-replica batch "
        f"{args.batch}, sgd lr {args.lr}, {args.seeds} seeds, "
        f"time budget {args.time_budget:g}"
    )
    print(
        f"{'N/b':>14} {'updates':>8} {'time to ' + format(args.target, '.0%'):>17} "
        f"{'reached':>8} {'final accuracy':>17} {'jitter':>7}"
    )
    for name in curves:
        ttt = np.array([time_to_target(c, a, args.target) for c, a in curves[name]])
        fin = np.array([final_accuracy(c, a, args.time_budget) for c, a in curves[name]])
        updates = np.mean([len(c) for c, _ in curves[name]])
        reached = int(np.sum(~np.isnan(ttt)))
        t_mean = float(np.nanmean(ttt)) if reached else float("nan")
        t_std = float(np.nanstd(ttt)) if reached else float("nan")
        results[name] = {
            "updates": float(updates),
            "time_to_target": t_mean,
            "time_to_target_std": t_std,
            "reached": reached,
            "final_accuracy": float(np.mean(fin[:, 0])),
            "final_accuracy_std": float(np.std(fin[:, 0])),
            "jitter": float(np.mean(fin[:, 1])),
        }
        r = results[name]
        print(
            f"{name:>14} {updates:>8.0f} {t_mean:>9.1f} +- {t_std:<5.1f}"
            f"{reached:>5}/{args.seeds:<3} {r['final_accuracy']:>9.4f} +- "
            f"{r['final_accuracy_std']:.4f} {r['jitter']:>7.4f}"
        )
    plot(curves, args)
    print(f"plot saved to {args.out} ({time.perf_counter() - start:.0f} s)")
    if args.json:
        write_json(args, results)
    return results


def write_json(args, results: dict) -> None:
    """The table as a ``bench/_record.py`` record (written here: examples/ stands alone)."""
    import json

    columns = ["configuration", "updates", "time to target", "time to target std",
               "reached", "final accuracy", "final accuracy std", "jitter"]
    rows = [[name, r["updates"], r["time_to_target"], r["time_to_target_std"], r["reached"],
             r["final_accuracy"], r["final_accuracy_std"], r["jitter"]]
            for name, r in results.items()]
    rows = [[None if isinstance(v, float) and np.isnan(v) else v for v in row] for row in rows]
    record = {"bench": "stragglers", "title": "Backup replicas against stragglers: time to "
              f"{args.target:.0%} test accuracy", "columns": columns, "rows": rows,
              "meta": {"seeds": args.seeds, "target": args.target, "budget": args.time_budget,
                       "shift": args.shift, "scale": args.scale}}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
