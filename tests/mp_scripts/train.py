"""Multi-worker training job used by tests/test_multi_worker_processes.py.

Run under ``python -m jreplicate.cluster.launch`` (or with the JREPLICATE_* variables set). Trains
the MLP of tests/_models with Adam on a fixed data set, with input in one or more
replication modes, optionally checkpointing through jreplicate.checkpoint and failing on
purpose; the chief writes the final parameters to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402  (importing JAX is fine; computing must wait for the strategy)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jreplicate.checkpoint import CheckpointManager  # noqa: E402
from jreplicate.input.context import InputReplicationMode  # noqa: E402
from jreplicate.losses import compute_average_loss  # noqa: E402
from jreplicate.replicator import Replicator  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402
from tests._models import init_mlp, make_data, mlp, per_example_loss  # noqa: E402

GLOBAL_BATCH = 64
MODES = {"per_worker": InputReplicationMode.PER_WORKER,
         "per_replica": InputReplicationMode.PER_REPLICA,
         "single": InputReplicationMode.SINGLE,
         "loop": InputReplicationMode.PER_WORKER}  # device loops of LOOP_STEPS steps
LOOP_STEPS = 3


def input_fn_for(x, y, mode, start):
    """Every mode feeds replica r the rows [r*b, (r+1)*b) of each step's global batch."""
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        if mode is InputReplicationMode.PER_REPLICA:
            replicas = [ctx.input_pipeline_id]
        elif mode is InputReplicationMode.PER_WORKER:
            per = ctx.num_replicas // ctx.num_input_pipelines
            replicas = range(ctx.input_pipeline_id * per, (ctx.input_pipeline_id + 1) * per)
        else:
            replicas = range(ctx.num_replicas)
        return ((x[s, r * b:(r + 1) * b], y[s, r * b:(r + 1) * b])
                for s in range(start, len(x)) for r in replicas)
    return input_fn


def fail(how: str, step: int) -> None:
    print(f"FAILING {how} at step {step} t={time.time():.3f}", flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "hang":
        time.sleep(3600)
    elif how == "raise":  # an uncaught exception while the others enter the next step
        raise ValueError(f"bad batch at step {step}")
    raise SystemExit(f"unknown --fail-how {how}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="per_worker")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--fail-at", type=int, default=-1)
    ap.add_argument("--fail-process", type=int, default=1)
    ap.add_argument("--fail-how", default="kill")
    return ap.parse_args(argv)


def train(strategy, args: argparse.Namespace) -> dict:
    """Trains in each of ``args.modes``; returns {mode: (params leaves, losses)}."""
    results = {}
    restart = int(os.environ.get("JREPLICATE_RESTART_COUNT", "0"))
    me = strategy.worker_index
    rep = Replicator(strategy)
    x, y = make_data(args.steps, GLOBAL_BATCH)
    tx = optax.adam(1e-2)

    def init():
        params = init_mlp(jax.random.key(0))
        return params, tx.init(params)

    def step_fn(ctx, batch, params, opt):
        xb, yb = batch

        def loss_fn(p):
            return compute_average_loss(per_example_loss(mlp(p, xb), yb), GLOBAL_BATCH)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, ctx.all_sum(loss), loss

    for name in args.modes.split(","):
        mode = MODES[name]
        mngr = None
        with rep.scope():
            if args.ckpt and name == "per_worker":
                mngr = CheckpointManager(args.ckpt, rep, max_to_keep=2,
                                         save_interval_steps=args.save_every)
                step, (params, opt) = mngr.restore_or_initialize(init)
            else:
                step, (params, opt) = 0, init()
        print(f"START {name} at step {step} (restart {restart})", flush=True)
        inputs = rep.prepare_input(input_fn_for(x, y, mode, step), replication_mode=mode)
        losses = []
        while name == "loop" and step < args.steps:
            params, opt, loss, per_replica = rep.run(step_fn, inputs, params, opt,
                                                     steps=LOOP_STEPS)
            losses.extend(float(v) for v in np.asarray(loss))
            step += len(loss)
        while step < args.steps:
            batch = next(inputs)
            if (step == args.fail_at and me == args.fail_process and restart == 0
                    and name == "per_worker"):
                fail(args.fail_how, step)
            params, opt, loss, per_replica = rep.run(step_fn, batch, params, opt)
            step += 1
            losses.append(float(loss))
            if mngr is not None:
                mngr.save(step, (params, opt))
        if mngr is not None:
            mngr.close()
        # Outputs stay global: per-replica values of other processes are not local.
        local = rep.local_results(per_replica)
        assert len(per_replica) == strategy.num_replicas
        assert len(local) == len(strategy.local_replica_ids)
        print(f"LOCAL {name} replicas={list(strategy.local_replica_ids)} "
              f"n_local={len(local)}", flush=True)
        results[name] = ([np.asarray(v) for v in jax.tree.leaves(params)], losses)
        if me == 0 and args.out:
            np.savez(os.path.join(args.out, f"{name}.npz"), *results[name][0],
                     losses=np.asarray(losses))
    print("DONE", flush=True)
    return results


if __name__ == "__main__":
    # The strategy starts jax.distributed, so it comes before any JAX computation.
    train(MultiWorkerStrategy(), parse_args())
