"""Tensor parallelism: jreplicate vs hand-written ``jit(shard_map(..., axis_names={"replica"}))``.

An MLP 512-2048-2048-10 on 8 simulated CPU devices laid out as 4 replicas x 2 logical
devices. Both implementations hold the same shardings: the first layer's kernel split
over the ``"model"`` axis by columns (``P(None, "model")``), the second's by rows
(``P("model", None)``), biases and the last layer replicated; the batch (global 256) is
split over ``"replica"``. One SGD-with-momentum step each; the losses of the first steps
are checked to agree, then both are timed in interleaved rounds. The table gives median
step times and the paired ratio (median of per-round ratios).

Run: ``python bench/tensor_parallel.py`` (about a minute on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

SIZES = (512, 2048, 2048, 10)
GLOBAL_BATCH = 256
SPECS = [{"w": P(None, "model"), "b": P("model")}, {"w": P("model", None), "b": P()},
         {"w": P(), "b": P()}]
TX = optax.sgd(0.01, momentum=0.9)


def loss_of(p, x, y):
    losses = optax.softmax_cross_entropy_with_integer_labels(_timing.mlp(p, x), y)
    return jr.compute_average_loss(losses, GLOBAL_BATCH)


def setup(mesh):
    rng = np.random.default_rng(0)
    params = [{"w": (rng.normal(size=(a, b)) * np.sqrt(2 / a)).astype(np.float32),
               "b": np.zeros(b, np.float32)} for a, b in zip(SIZES[:-1], SIZES[1:])]
    params = [{k: jax.device_put(v, NamedSharding(mesh, s[k])) for k, v in layer.items()}
              for layer, s in zip(params, SPECS)]
    x = rng.normal(size=(4, GLOBAL_BATCH // 4, SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, size=(4, GLOBAL_BATCH // 4)).astype(np.int32)
    return params, x, y


def build_jreplicate():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    params, x, y = setup(rep.mesh)
    state = [params, TX.init(params)]
    xb = jr.PerReplica(jax.device_put(x, NamedSharding(rep.mesh, P("replica"))), rep.mesh)
    yb = jr.PerReplica(jax.device_put(y, NamedSharding(rep.mesh, P("replica"))), rep.mesh)

    def step(ctx, batch, p, o):
        loss, g = jax.value_and_grad(loss_of)(p, *batch)
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss)

    def run():
        state[0], state[1], loss = rep.run(step, (xb, yb), *state)
        return loss
    return run, rep.mesh


def build_hand_written(mesh):
    params, x, y = setup(mesh)
    state = [params, TX.init(params)]
    xb = jax.device_put(x, NamedSharding(mesh, P("replica")))
    yb = jax.device_put(y, NamedSharding(mesh, P("replica")))

    def body(p, o, xb, yb):
        loss, g = jax.value_and_grad(loss_of)(p, xb[0], yb[0])
        u, o = TX.update(g, o, p)
        return optax.apply_updates(p, u), o, jax.lax.psum(loss, "replica")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("replica"), P("replica")),
                                 out_specs=(P(), P(), P()), axis_names={"replica"}))

    def run():
        state[0], state[1], loss = step(*state, xb, yb)
        return loss
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    ours, mesh = build_jreplicate()
    hand = build_hand_written(mesh)
    a = [float(ours()) for _ in range(3)]
    b = [float(hand()) for _ in range(3)]
    np.testing.assert_allclose(a, b, rtol=1e-5)
    print(f"MLP {'-'.join(map(str, SIZES))}, global batch {GLOBAL_BATCH}, mesh "
          f"{dict(mesh.shape)}; losses agree ({a[0]:.4f}, {a[1]:.4f}, {a[2]:.4f})")
    times = _timing.interleaved({"jreplicate": (ours, args.steps),
                                 "hand-written": (hand, args.steps)}, rounds)
    for name, t in times.items():
        print(f"{name:13s} {statistics.median(t) * 1e3:8.2f} ms/step")
    ratio = _timing.paired_ratio(times, "jreplicate", "hand-written")
    print(f"jreplicate / hand-written (paired, {rounds} rounds): {ratio:.3f}")
    _record.write(args.json, "tensor_parallel",
                  "Tensor-parallel MLP: jreplicate against hand-written shard_map",
                  ["implementation", "ms/step", "paired ratio"],
                  [[name, statistics.median(t) * 1e3,
                    _timing.paired_ratio(times, name, "hand-written")]
                   for name, t in times.items()],
                  rounds=rounds, steps=args.steps, mesh=dict(mesh.shape),
                  model="MLP " + "-".join(map(str, SIZES)))


if __name__ == "__main__":
    main()
