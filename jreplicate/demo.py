"""The main job: train an MLP on scikit-learn's digits across 8 replicas.

Run it with ``python -m jreplicate.demo`` (or the ``jreplicate-demo`` script). On a
machine without accelerators it simulates 8 CPU devices. It shows a progress bar with
the loss and prints the held-out accuracy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _simulate_devices(n: int) -> None:
    """Asks XLA for ``n`` CPU devices; must run before JAX initialises its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def load_digits_split(seed: int = 0):
    """scikit-learn's bundled 8x8 digits (1797 images), scaled and split 80/20."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed,
                            stratify=y)


def train(*, steps: int = 600, global_batch: int = 128, lr: float = 3e-3, hidden: int = 256,
          seed: int = 0, progress: bool = True) -> dict:
    """Trains the MLP with MirroredStrategy on all local devices; returns metrics."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm.auto import tqdm

    import jreplicate as jr

    x_train, x_test, y_train, y_test = load_digits_split(seed)
    rep = jr.Replicator(jr.MirroredStrategy())

    def input_fn(ctx: jr.InputContext):
        b = ctx.get_per_replica_batch_size(global_batch)
        rng = np.random.default_rng(seed + ctx.input_pipeline_id)
        while True:  # an endless shuffled stream, one per-replica batch per element
            idx = rng.choice(len(x_train), size=b, replace=False)
            yield x_train[idx], y_train[idx]

    with rep.scope():
        k1, k2 = jax.random.split(jax.random.key(seed))
        params = {
            "w1": jax.random.normal(k1, (64, hidden)) * (2 / 64) ** 0.5,
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 10)) * (1 / hidden) ** 0.5,
            "b2": jnp.zeros(10),
        }
        tx = optax.adam(lr)
        opt_state = tx.init(params)

    def logits_fn(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def train_step(ctx: jr.ReplicaContext, batch, params, opt_state):
        x, y = batch

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, x), y)
            return jr.compute_average_loss(per_example, global_batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)  # grads: summed over replicas
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_sum(loss)

    inputs = rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.PER_REPLICA,
                               prefetch_on_device=True)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"training on {rep.num_replicas} replicas",
               disable=not progress, file=sys.stdout, mininterval=0.5)
    loss = None
    for i in bar:
        params, opt_state, loss = rep.run(train_step, inputs, params, opt_state)
        if i % 20 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.4f}")
    rep.finalize()
    train_time = time.perf_counter() - start
    predictions = np.asarray(jax.jit(logits_fn)(params, x_test)).argmax(-1)
    return {"accuracy": float((predictions == y_test).mean()), "final_loss": float(loss),
            "train_seconds": train_time, "num_replicas": rep.num_replicas,
            "test_examples": int(len(y_test))}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8,
                        help="CPU devices to simulate when no accelerator is present")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _simulate_devices(args.devices)
    import jax

    print(f"jreplicate demo: {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"global batch {args.global_batch}, {args.steps} steps")
    m = train(steps=args.steps, global_batch=args.global_batch, lr=args.lr, seed=args.seed)
    print(f"held-out accuracy: {m['accuracy']:.4f} on {m['test_examples']} digits "
          f"(final loss {m['final_loss']:.4f}, {m['train_seconds']:.1f}s on "
          f"{m['num_replicas']} replicas)")
    return 0 if m["accuracy"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
