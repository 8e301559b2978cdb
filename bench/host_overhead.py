"""Host overhead of a dispatch-bound step: jreplicate vs hand-written, plain and NNX.

The tiny MLP 16-32-32-10 (global batch 256, SGD with momentum) on 8 simulated CPU
devices, where a step is mostly host work. Eight ways, interleaved rounds of 500 steps:

* ``hand``: ``jax.jit(jax.shard_map(...))``, batch already on the devices;
* ``hand+put``: the same plus one sharded ``jax.device_put`` of the stacked global batch
  per step (the fair reference for input read every step);
* ``run``: ``rep.run(step, batch, params, opt)`` with a batch of ``PerReplica``;
* ``run+input``: ``rep.run(step, iterator, ...)``, the batch read through
  ``prepare_input`` every step with the default ``prefetch_on_device=None`` (which
  stays on the calling thread here: a read is a small share of the step), and
  ``run+input(prefetch)`` with ``prefetch_on_device=True``;
* ``run nnx``: a Flax NNX model and ``nnx.Optimizer`` passed to ``run``;
* ``hand no-op`` / ``run no-op``: a step that returns its arguments: their difference is
  the host time ``run`` adds per call; ``run no-op donated`` donates them
  (``donate_argnums=(0, 1)``: the steady-state path's donation checks).

Prints median microseconds per step and the ratios the project tracks:
run / hand (target <= 1.03), run+input / hand+put (<= 1.05), run nnx / run (<= 1.10).

The comparisons are four groups, each interleaved on its own (the input iterators'
threads exist only while their group runs). Run: ``python
bench/host_overhead.py`` (about two minutes on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

SIZES = (16, 32, 32, 10)
GB = 256
TX = optax.sgd(0.05, momentum=0.9)
CALLS = 500


def loss_of(logits, y):
    return jr.compute_average_loss(
        optax.softmax_cross_entropy_with_integer_labels(logits, y), GB)


def init(rng):
    return [{"w": (rng.normal(size=(a, b)) * 0.1).astype(np.float32),
             "b": np.zeros(b, np.float32)} for a, b in zip(SIZES[:-1], SIZES[1:])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    rep = jr.Replicator(jr.MirroredStrategy())
    n, mesh = rep.num_replicas, rep.mesh
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, GB // n, SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, (n, GB // n)).astype(np.int32)
    per = NamedSharding(mesh, P("replica"))
    xd, yd = jax.device_put(x, per), jax.device_put(y, per)

    def step(ctx, batch, p, o):
        xb, yb = batch
        g = jax.grad(lambda p: loss_of(_timing.mlp(p, xb), yb))(p)
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o

    body = jax.shard_map(lambda p, o, xb, yb: step(None, (xb[0], yb[0]), p, o), mesh=mesh,
                         in_specs=(P(), P(), P("replica"), P("replica")),
                         out_specs=(P(), P()))
    hand_step = jax.jit(body)

    def state():
        with rep.scope():
            p = jax.tree.map(jnp.asarray, init(np.random.default_rng(1)))
            return [p, TX.init(p)]

    s_hand, s_put, s_run, s_in, s_in0 = state(), state(), state(), state(), state()

    def hand():
        for _ in range(CALLS):
            s_hand[0], s_hand[1] = hand_step(*s_hand, xd, yd)
        return s_hand[0]

    def hand_put():
        for _ in range(CALLS):
            xb, yb = jax.device_put((x, y), per)
            s_put[0], s_put[1] = hand_step(*s_put, xb, yb)
        return s_put[0]

    batch = (jr.PerReplica(xd, mesh), jr.PerReplica(yd, mesh))

    def run():
        for _ in range(CALLS):
            s_run[0], s_run[1] = rep.run(step, batch, *s_run)
        return s_run[0]

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        while True:
            yield x[0, :b], y[0, :b]

    it_auto = rep.prepare_input(input_fn)
    it_pre = rep.prepare_input(input_fn, prefetch_on_device=True)

    def run_input():
        for _ in range(CALLS):
            s_in[0], s_in[1] = rep.run(step, it_auto, *s_in)
        return s_in[0]

    def run_input_pre():
        for _ in range(CALLS):
            s_in0[0], s_in0[1] = rep.run(step, it_pre, *s_in0)
        return s_in0[0]

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                    for a, b in zip(SIZES[:-1], SIZES[1:])])

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    with rep.scope():
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    def nnx_step(ctx, batch, model, opt):
        xb, yb = batch
        g = nnx.grad(lambda m: loss_of(m(xb), yb))(model)
        opt.update(model, g)

    def run_nnx():
        for _ in range(CALLS):
            rep.run(nnx_step, batch, model, opt)
        return model.layers[0].kernel[...]

    # The host time run adds, alone: a step that does nothing but return its arguments.
    hand_noop = jax.jit(jax.shard_map(lambda p, o, xb, yb: (p, o), mesh=mesh,
                                      in_specs=(P(), P(), P("replica"), P("replica")),
                                      out_specs=(P(), P())))
    s_noop, s_noop_run = state(), state()

    def noop(ctx, batch, p, o):
        return p, o

    def hand_nothing():
        for _ in range(CALLS):
            s_noop[0], s_noop[1] = hand_noop(*s_noop, xd, yd)
        return s_noop[0]

    def run_nothing():
        for _ in range(CALLS):
            s_noop_run[0], s_noop_run[1] = rep.run(noop, batch, *s_noop_run)
        return s_noop_run[0]

    s_noop_don = state()

    def run_nothing_donated():  # the donation checks: 3 + 5 containers, 12 leaves
        # (Held by locals only: a list passed as *s_noop_don would hold them too, and
        # run would donate copies.)
        p, o = s_noop_don
        s_noop_don.clear()
        for _ in range(CALLS):
            p, o = rep.run(noop, batch, p, o, donate_argnums=(0, 1))
        s_noop_don[:] = [p, o]
        return p

    # Four groups, each interleaved on its own, so that one group's background threads
    # (the input iterators') never run beside another group's steps.
    groups = {
        "dispatch": {"hand": (hand, 1), "run": (run, 1)},
        "host time": {"hand no-op": (hand_nothing, 1), "run no-op": (run_nothing, 1),
                      "run no-op donated": (run_nothing_donated, 1)},
        "input": {"hand+put": (hand_put, 1), "run+input": (run_input, 1),
                  "run+input(prefetch)": (run_input_pre, 1)},
        "nnx": {"run": (run, 1), "run nnx": (run_nnx, 1)},
    }
    times = {}
    for name, impls in groups.items():
        got = _timing.interleaved(impls, rounds, warmup=1)
        times.update({k if name != "nnx" or k != "run" else "run (nnx group)": v
                      for k, v in got.items()})
        if name == "input":
            choice = it_auto.prefetching
            it_auto.close()
            it_pre.close()
    print(f"tiny MLP {'-'.join(map(str, SIZES))}, {n} cpu devices, {rounds} rounds of "
          f"{CALLS} steps per group")
    print("the default prefetch_on_device=None "
          + ("prefetches" if choice else "reads on the calling thread"))
    for name, t in times.items():
        print(f"{name:24s} {statistics.median(t) / CALLS * 1e6:8.0f} us/step")
    rows = []
    for a, b, target in (("run", "hand", 1.03), ("run no-op", "hand no-op", None),
                         ("run no-op donated", "run no-op", None),
                         ("run+input", "hand+put", 1.05),
                         ("run+input(prefetch)", "hand+put", 1.05),
                         ("run nnx", "run (nnx group)", 1.10)):
        ratio = _timing.paired_ratio(times, a, b)
        rows.append([a, b, statistics.median(times[a]) / CALLS * 1e6,
                     statistics.median(times[b]) / CALLS * 1e6, ratio, target])
        if target is not None:
            print(f"{a:24s} / {b:15s} {ratio:6.3f}  (target <= {target})")
    added = statistics.median(r - h for r, h in zip(times["run no-op"], times["hand no-op"]))
    print(f"host time run adds per call (no-op step, run - hand): {added / CALLS * 1e6:.0f} us")
    donated = statistics.median(
        d - r for d, r in zip(times["run no-op donated"], times["run no-op"]))
    print(f"with donate_argnums=(0, 1) (no-op step, donated - not): "
          f"{donated / CALLS * 1e6:.0f} us")
    _record.write(args.json, "host_overhead",
                  "Host overhead of a dispatch-bound step: jreplicate vs hand-written JAX",
                  ["jreplicate", "reference", "jreplicate us/step", "reference us/step",
                   "paired ratio", "target"], rows, rounds=rounds, calls=CALLS,
                  model="MLP " + "-".join(map(str, SIZES)), devices=n,
                  added_us_per_call=added / CALLS * 1e6,
                  donation_us_per_call=donated / CALLS * 1e6,
                  default_prefetch="prefetches" if choice else "calling thread")


if __name__ == "__main__":
    main()
