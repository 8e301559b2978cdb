"""Device loops: steps/s of ``run(..., steps=K)`` for K = 1, 10, 100, input included.

Two dispatch-bound models on 8 simulated CPU devices, where one step's compute is
small next to the host's per-call work: logistic regression on scikit-learn's digits
(64 -> 10, global batch 64) and the MLP 16-32-32-10 (global batch 128, synthetic data).
Every K reads its batches through ``prepare_input`` (a PER_WORKER generator) and trains
with Adam; K = 1 is one ``run`` per step. Each round runs 200 steps per K, interleaved;
the table gives median steps/s and the paired ratio to K = 1 (median of per-round ratios).

Run: ``python bench/steps_per_run.py`` (about a minute on 2 cores) or ``--quick``;
``--models`` picks the models (without scikit-learn, the digits model is left out).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

KS = (1, 10, 100)
STEPS_PER_ROUND = 200
MODELS = ("logreg-digits", "mlp-16-32-32-10")


def _data(model: str):
    if model == "logreg-digits":
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        return (x / 16.0).astype(np.float32), y.astype(np.int32), (64, 10), 64
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16)).astype(np.float32)
    return x, rng.integers(0, 10, 4096).astype(np.int32), (16, 32, 32, 10), 128


def build(model: str, k: int):
    """A ``run`` that trains ``STEPS_PER_ROUND`` steps as device loops of ``k`` steps."""
    x, y, sizes, gb = _data(model)
    rep = jr.Replicator(jr.MirroredStrategy())
    tx = optax.adam(1e-2)
    with rep.scope():
        keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
        params = [{"w": jax.random.normal(kk, (a, b)) * 0.1, "b": jnp.zeros(b)}
                  for kk, a, b in zip(keys, sizes[:-1], sizes[1:])]
        state = [params, tx.init(params)]

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(gb)
        for i in itertools.count():
            j = (i * b) % (len(x) - b)
            yield x[j:j + b], y[j:j + b]

    inputs = rep.prepare_input(input_fn)

    def step(ctx, batch, p, o):
        xb, yb = batch
        loss, g = jax.value_and_grad(lambda p: jr.compute_average_loss(
            optax.softmax_cross_entropy_with_integer_labels(_timing.mlp(p, xb), yb), gb))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss)

    def run():
        loss = None
        for _ in range(STEPS_PER_ROUND // k):
            if k == 1:
                state[0], state[1], loss = rep.run(step, inputs, *state)
            else:
                state[0], state[1], loss = rep.run(step, inputs, *state, steps=k)
        return loss

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    models = list(args.models)
    if "logreg-digits" in models and importlib.util.find_spec("sklearn") is None:
        print("scikit-learn is not installed: the logreg-digits model is left out")
        models.remove("logreg-digits")
    rows = []
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices; {rounds} rounds of "
          f"{STEPS_PER_ROUND} steps per K")
    print(f"{'model':16s} {'K':>4s} {'steps/s':>9s} {'vs K=1':>7s}")
    for model in models:
        impls = {f"K={k}": (build(model, k), 1) for k in KS}
        times = _timing.interleaved(impls, rounds, warmup=1)
        for k in KS:
            sps = STEPS_PER_ROUND / statistics.median(times[f"K={k}"])
            ratio = _timing.paired_ratio(times, "K=1", f"K={k}")
            print(f"{model:16s} {k:4d} {sps:9.0f} {ratio:7.2f}")
            rows.append([model, k, sps, ratio])
    _record.write(args.json, "steps_per_run", "Device loops: steps/s of run(..., steps=K)",
                  ["model", "K", "steps/s", "speed-up vs K=1"], rows, rounds=rounds,
                  steps_per_round=STEPS_PER_ROUND, devices=jax.device_count(),
                  platform=jax.devices()[0].platform)


if __name__ == "__main__":
    main()
