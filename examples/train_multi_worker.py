"""Multi-worker training with checkpoints and restarts, run by jreplicate's launcher.

Every process runs this same script::

    python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 4 --max-restarts 2 \\
        examples/train_multi_worker.py --steps 200 --ckpt /tmp/jreplicate_mw_ckpt

* ``jr.MultiWorkerStrategy()`` joins the cluster the launcher describes in the
  ``JREPLICATE_*`` variables: 2 processes x 4 simulated CPU devices = 8 replicas in one
  synchronous data-parallel job (run alone, without the launcher, it is one process
  with all local devices).
* ``rep.prepare_input(..., PER_WORKER)``: each process reads the rows of scikit-learn's
  bundled digits that its own replicas need; the global batch of step ``s`` is fixed by
  ``s``, so a resumed job reads exactly the batches it would have read.
* ``jr.CheckpointManager``: the chief writes a checkpoint every ``--save-every`` steps;
  on start every process restores the latest complete one. Under ``--max-restarts`` a
  failed group is started again and resumes there. ``--fail-at STEP`` makes the last
  process exit at that step on the first attempt, to see it happen.

Prints the global-batch loss every ``--log-every`` steps and the held-out accuracy at the
end (on the chief). Delete the ``--ckpt`` directory to start from scratch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax  # importing JAX is fine; computing must wait for the strategy
import jax.numpy as jnp
import numpy as np
import optax

import jreplicate as jr
from jreplicate.demo import load_digits_split

GLOBAL_BATCH = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="total training steps")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    ap.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "jreplicate_mw_ckpt"),
                    help="checkpoint directory (on the chief's file system)")
    ap.add_argument("--save-every", type=int, default=20, help="checkpoint interval in steps")
    ap.add_argument("--log-every", type=int, default=20, help="loss printing interval")
    ap.add_argument("--fail-at", type=int, default=None,
                    help="make the last process exit at this step on the first attempt "
                         "(JREPLICATE_RESTART_COUNT=0), to demonstrate --max-restarts")
    args = ap.parse_args(argv)
    for name in ("steps", "save_every", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def init_params(key: jax.Array) -> dict:
    """An MLP 64-128-10 for the 8x8 digits."""
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (64, 128)) * (2 / 64) ** 0.5, "b1": jnp.zeros(128),
            "w2": jax.random.normal(k2, (128, 10)) * (1 / 128) ** 0.5, "b2": jnp.zeros(10)}


def logits(p: dict, x: jax.Array) -> jax.Array:
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def global_batch_rows(step: int, num_examples: int) -> np.ndarray:
    """The training rows of step ``step``: the same on every process and every attempt."""
    return np.random.default_rng(step).choice(num_examples, GLOBAL_BATCH, replace=False)


def main(argv: list[str] | None = None) -> dict:
    """Trains; returns ``{"step", "losses", "accuracy"}`` (accuracy on the chief only)."""
    args = parse_args(argv)
    strategy = jr.MultiWorkerStrategy()  # first: it starts JAX's distributed runtime
    rep = jr.Replicator(strategy)
    me, restart = strategy.worker_index, int(os.environ.get("JREPLICATE_RESTART_COUNT", "0"))
    x_train, x_test, y_train, y_test = load_digits_split()
    tx = optax.adam(args.lr)

    def init():
        params = init_params(jax.random.key(0))
        return params, tx.init(params)

    with rep.scope():
        mngr = jr.CheckpointManager(args.ckpt, rep, max_to_keep=2,
                                    save_interval_steps=args.save_every)
        start, (params, opt) = mngr.restore_or_initialize(init)
    print(f"process {me}/{strategy.num_workers} (attempt {restart}): "
          f"{len(strategy.local_replica_ids)} of {strategy.num_replicas} replicas; "
          f"{'resuming from checkpoint at step' if start else 'starting at step'} {start}",
          flush=True)

    def input_fn(ctx: jr.InputContext):
        # PER_WORKER: one pipeline per process, yielding one per-replica batch for each
        # of this process's replicas, step after step, from the step restored.
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        per = ctx.num_replicas // ctx.num_input_pipelines
        mine = range(ctx.input_pipeline_id * per, (ctx.input_pipeline_id + 1) * per)
        for s in range(start, args.steps):
            rows = global_batch_rows(s, len(x_train))
            for r in mine:
                idx = rows[r * b:(r + 1) * b]
                yield x_train[idx], y_train[idx]

    def train_step(ctx: jr.ReplicaContext, batch, params, opt):
        x, y = batch

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y)
            return jr.compute_average_loss(per_example, GLOBAL_BATCH)

        loss, grads = jax.value_and_grad(loss_fn)(params)  # summed over all replicas
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, ctx.all_sum(loss)

    inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_WORKER)
    losses = {}
    step = start
    for step in range(start + 1, args.steps + 1):
        if args.fail_at == step and restart == 0 and me == strategy.num_workers - 1:
            print(f"process {me}: failing on purpose at step {step} (--fail-at)", flush=True)
            sys.stderr.flush()
            os._exit(3)  # at once, like a crash (no exit handlers waiting for the others)
        params, opt, loss = rep.run(train_step, inputs, params, opt)
        if step % args.log_every == 0 or step == args.steps:
            losses[step] = float(loss)
            if strategy.is_chief:
                print(f"step {step}/{args.steps}  loss {losses[step]:.4f}", flush=True)
        mngr.save(step, (params, opt))  # writes every --save-every steps
    mngr.close()
    accuracy = None
    if strategy.is_chief:
        # The parameters are one replicated global array per leaf: any local copy is it.
        host = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
        accuracy = float((np.asarray(logits(host, x_test)).argmax(-1) == y_test).mean())
        print(f"done: step {step}, held-out accuracy {accuracy:.4f}; checkpoints in "
              f"{mngr.directory}", flush=True)
    rep.finalize()
    return {"step": step, "losses": losses, "accuracy": accuracy}


if __name__ == "__main__":
    main()
