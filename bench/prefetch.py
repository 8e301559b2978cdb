"""Prefetch: does it hide an input source as slow as the step?

8 simulated CPU devices; an MLP step (Adam) whose time S is measured first; an input
source whose latency is set to S (a sleep, as for I/O: the data is ready after S):

* ``per-worker``: one pipeline for the 8 replicas, S per step (S/8 per element);
* ``per-replica``: 8 pipelines, each S per element, read concurrently;
* ``fast``: no latency (the source costs only the copy to the devices).

For each, the time per step with ``prefetch_on_device`` off, on, and left to its
default (``auto``: reads on the calling thread until they are seen to take more than a
tenth of the step cycle, then prefetch), against the ideal ``max(step alone, input
alone)`` ("input alone" reads and places batches without running steps). Interleaved
rounds; medians. Target: prefetch on (and auto, on a slow source) <= 1.1x the ideal.

Run: ``python bench/prefetch.py`` (about a minute on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

SIZES = (512, 512, 512, 10)
GLOBAL_BATCH = 256
STEPS = 20
TX = optax.adam(1e-3)


step = _timing.classifier_step(TX, GLOBAL_BATCH)


def make_input_fn(mode: str, latency: float):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(GLOBAL_BATCH, SIZES[0])).astype(np.float32)
    ys = rng.integers(0, 10, GLOBAL_BATCH).astype(np.int32)

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        per_element = latency / (ctx.num_replicas if mode == "per-worker" else 1)
        while True:
            if per_element:
                time.sleep(per_element)
            yield xs[:b], ys[:b]
    return input_fn


def fresh_state(rep):
    with rep.scope():
        keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
        p = [{"w": jax.random.normal(k, (a, b)) * 0.05, "b": jnp.zeros(b)}
             for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])]
        return [p, TX.init(p)]


def build(rep, mode, latency, prefetch):
    replication = (jr.InputReplicationMode.PER_REPLICA if mode == "per-replica"
                   else jr.InputReplicationMode.PER_WORKER)
    inputs = rep.prepare_input(make_input_fn(mode, latency), replication,
                               prefetch_on_device=prefetch)
    state = fresh_state(rep)

    def train():
        for _ in range(STEPS):
            state[0], state[1] = rep.run(step, inputs, *state)
        return state[0]

    def input_only():
        b = None
        for _ in range(STEPS):
            b = inputs.get_next()
        return b

    return train, input_only, inputs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    rep = jr.Replicator(jr.MirroredStrategy())
    it = rep.prepare_input(make_input_fn("fast", 0.0))
    batch = it.get_next()
    st = fresh_state(rep)

    def step_alone():
        for _ in range(STEPS):
            st[0], st[1] = rep.run(step, batch, *st)
        return st[0]

    s = _timing.time_block(step_alone, 3) / STEPS  # warm-up included
    s = statistics.median(_timing.time_block(step_alone, 1) / STEPS for _ in range(3))
    print(f"{jax.device_count()} cpu devices; step alone {s * 1e3:.1f} ms; source latency "
          f"set to the step's; {rounds} rounds of {STEPS} steps")
    print(f"{'source':12s} {'input alone':>11s} {'ideal':>7s} {'off':>7s} {'on':>7s} "
          f"{'auto':>7s} {'off/ideal':>9s} {'on/ideal':>9s} {'auto/ideal':>10s}")
    rows = []
    for mode in ("per-worker", "per-replica", "fast"):
        latency = 0.0 if mode == "fast" else s
        off_train, off_input, _ = build(rep, mode, latency, False)
        on_train, _, _ = build(rep, mode, latency, True)
        auto_train, _, auto_inputs = build(rep, mode, latency, None)
        times = _timing.interleaved({"step": (step_alone, 1), "input": (off_input, 1),
                                     "off": (off_train, 1), "on": (on_train, 1),
                                     "auto": (auto_train, 1)}, rounds)
        med = {k: statistics.median(v) / STEPS for k, v in times.items()}
        ideal = max(med["step"], med["input"])
        print(f"{mode:12s} {med['input'] * 1e3:9.1f}ms {ideal * 1e3:5.1f}ms "
              f"{med['off'] * 1e3:5.1f}ms {med['on'] * 1e3:5.1f}ms "
              f"{med['auto'] * 1e3:5.1f}ms {med['off'] / ideal:9.2f} "
              f"{med['on'] / ideal:9.2f} {med['auto'] / ideal:10.2f}"
              f"  (auto {'prefetches' if auto_inputs.prefetching else 'reads in line'})")
        rows.append([mode, med["input"] * 1e3, ideal * 1e3, med["off"] * 1e3, med["on"] * 1e3,
                     med["auto"] * 1e3, med["off"] / ideal, med["on"] / ideal,
                     med["auto"] / ideal, bool(auto_inputs.prefetching)])
    _record.write(args.json, "prefetch", "Input prefetch: ms per step against the ideal",
                  ["source", "input alone ms", "ideal ms", "off ms", "on ms", "auto ms",
                   "off/ideal", "on/ideal", "auto/ideal", "auto prefetches"], rows,
                  rounds=rounds, steps=STEPS, step_alone_ms=s * 1e3)


if __name__ == "__main__":
    main()
