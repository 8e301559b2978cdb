"""Mixed precision with TPUStrategy: bfloat16 compute, float32 parameters and optimizer.

The parameters and the Adam state stay float32; the step casts the parameters and the
batch to bfloat16 for the forward pass, and the loss back to float32. The gradient of
the float32 parameters (through the cast) comes back float32 and summed over the
replicas, so the update is done in full precision. On a TPU host it uses the TPUs; on
CPU it lays the CPU devices out as TPUStrategy would (``devices=jax.devices()``), with
device loops of ``--steps-per-run`` steps.

Run: ``python examples/mixed_precision.py`` (8 simulated CPU devices without a TPU).
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jreplicate as jr  # noqa: E402

GLOBAL_BATCH = 128


def init_params(key: jax.Array, sizes=(64, 128, 10)) -> list[dict]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b), jnp.float32) * np.sqrt(2.0 / a),
             "b": jnp.zeros(b, jnp.float32)} for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def forward(params: list[dict], x: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """The MLP computed in ``dtype``; logits returned in float32."""
    h = x.astype(dtype)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h.astype(jnp.float32)


def make_step(tx: optax.GradientTransformation, dtype=jnp.bfloat16):
    def step(ctx: jr.ReplicaContext, batch, params, opt_state):
        x, y = batch

        def loss_fn(p):
            losses = optax.softmax_cross_entropy_with_integer_labels(forward(p, x, dtype), y)
            return jr.compute_average_loss(losses, GLOBAL_BATCH)

        loss, grads = jax.value_and_grad(loss_fn)(params)  # float32, summed over replicas
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_sum(loss)
    return step


def train(steps: int = 200, steps_per_run: int = 10, dtype=jnp.bfloat16, seed: int = 0):
    """Trains on the digits; returns ``(params, opt_state, losses, test accuracy)``."""
    tpu = jax.devices()[0].platform == "tpu"
    strategy = jr.TPUStrategy(devices=None if tpu else jax.devices(),
                              steps_per_run=steps_per_run)
    rep = jr.Replicator(strategy)
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
    tx = optax.adam(3e-3)
    with rep.scope():
        params = init_params(jax.random.key(seed))
        opt_state = tx.init(params)

    def input_fn(ctx: jr.InputContext):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        rng = np.random.default_rng(seed + ctx.input_pipeline_id)
        for _ in range(steps * ctx.num_replicas // ctx.num_input_pipelines):
            i = rng.integers(0, len(x_train), b)
            yield x_train[i], y_train[i]

    inputs = rep.prepare_input(input_fn)
    step, losses = make_step(tx, dtype), []
    for _ in range(-(-steps // steps_per_run)):
        params, opt_state, loss = rep.run(step, inputs, params, opt_state)
        losses.extend(np.asarray(loss).tolist())
    logits = forward(params, jnp.asarray(x_test), dtype)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y_test))
    return params, opt_state, losses, accuracy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    ap.add_argument("--steps-per-run", type=int, default=10,
                    help="steps per device loop (default 10)")
    args = ap.parse_args(argv)
    params, opt_state, losses, acc = train(args.steps, args.steps_per_run)
    dtypes = {str(a.dtype) for a in jax.tree.leaves((params, opt_state))}
    print(f"bfloat16 compute, state dtypes {sorted(dtypes)}: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}, held-out accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
