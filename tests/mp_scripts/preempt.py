"""Preemption under the launcher, for tests/test_preemption.py.

``python preempt.py train --ckpt D --report F --out D [--steps N] [--save-every S]
[--steps-per-run K] [--sleep T]``: trains the MLP of tests/_models with adam on 2
processes, calling ``CheckpointManager.save`` after every run of K steps; each process
appends ``<rank> <pid> <step> <restart>`` to F after every run (the test picks its
moment to send SIGTERM from it), and ``P <rank> <step> <restart>`` when it is preempted.
On the first attempt each run sleeps T seconds first, so that the test can aim, and
with ``--slow-writes W`` each background save takes W seconds more to commit, so that
one is being written when the notice arrives ("under load"); the state carries 4 MiB of
ballast that changes every step. The
chief writes the final parameters to ``D/final_k<K>.npz``. ``reference`` runs the same
training uninterrupted for K = 1 and K = 4, one after the other (the second manager
shares the process's count of save calls with the first).

JAX-free modes for the launcher's own tests (no cluster is joined):
With ``--no-preemption-service`` JAX's preemption service is off: the manager's own
SIGTERM handler and an all-gather at every save call take its place.

``exit42-once`` (every process exits 42 on the first attempt, 0 after),
``exit42-always``, ``term42`` (SIGTERM makes a process exit 42, after printing
READY), ``one42`` (process 1 exits 42, process 0 sleeps), ``mixed42`` (process 1 exits
42, process 0 exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

RANK = int(os.environ.get("JREPLICATE_PROCESS_ID", "0"))
RESTART = int(os.environ.get("JREPLICATE_RESTART_COUNT", "0"))
GLOBAL_BATCH = 32


def plain(mode: str) -> None:
    """The JAX-free modes (see the module docstring)."""
    if mode == "exit42-once":
        sys.exit(42 if RESTART == 0 else 0)
    if mode == "exit42-always":
        sys.exit(42)
    if mode == "term42":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
        print(f"READY rank={RANK} restart={RESTART}", flush=True)
        time.sleep(60)
        sys.exit(3)  # never reached in the test: stopped long before
    if mode == "one42":
        if RANK == 1:
            sys.exit(42)
        time.sleep(60)
    if mode == "mixed42":
        sys.exit(42 if RANK == 1 else 0)
    raise SystemExit(f"unknown mode {mode}")


def train(args: argparse.Namespace, k: int, ckpt: str, report) -> None:
    import jax
    import numpy as np
    import optax

    from jreplicate.checkpoint import CheckpointManager, Preempted
    from jreplicate.input.context import InputReplicationMode
    from jreplicate.losses import compute_average_loss
    from jreplicate.replicator import Replicator
    from jreplicate.testing import delay_checkpoint_write
    from tests._models import init_mlp, make_data, mlp, per_example_loss

    rep = Replicator(STRATEGY)
    x, y = make_data(args.steps, GLOBAL_BATCH, seed=3)
    tx = optax.adam(1e-2)

    def init():
        params = init_mlp(jax.random.key(0))
        # Ballast that changes every step, so that each background save writes MiBs.
        return params, (tx.init(params), jax.numpy.zeros(args.ballast, "float32"))

    def step_fn(ctx, batch, params, state):
        opt, ballast = state
        xb, yb = batch

        def loss_fn(p):
            return compute_average_loss(per_example_loss(mlp(p, xb), yb), GLOBAL_BATCH)

        g = jax.grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), (opt, ballast + 1.0)

    def input_fn(start):
        def fn(ctx):
            b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
            per = ctx.num_replicas // ctx.num_input_pipelines
            mine = range(ctx.input_pipeline_id * per, (ctx.input_pipeline_id + 1) * per)
            return ((x[s, r * b:(r + 1) * b], y[s, r * b:(r + 1) * b])
                    for s in range(start, args.steps) for r in mine)
        return fn

    with rep.scope():
        mngr = CheckpointManager(ckpt, rep, max_to_keep=2, save_interval_steps=args.save_every)
        step, (params, opt) = mngr.restore_or_initialize(init)
    print(f"START k={k} at step {step} (restart {RESTART}; preemption watched by "
          f"{mngr._preempt.mechanism})", flush=True)
    inputs = rep.prepare_input(input_fn(step),
                               replication_mode=InputReplicationMode.PER_WORKER)
    try:
        while step < args.steps:
            if RESTART == 0 and args.sleep:
                time.sleep(args.sleep)
            if k == 1:
                params, opt = rep.run(step_fn, next(inputs), params, opt)
            else:
                params, opt = rep.run(step_fn, inputs, params, opt, steps=k)
            step += k
            report.write(f"{RANK} {os.getpid()} {step} {RESTART}\n")
            report.flush()
            if RESTART == 0 and args.slow_writes and mngr.should_save(step):
                delay_checkpoint_write(mngr, args.slow_writes)  # still writing at the next
            mngr.save(step, lambda p=params, o=opt: (p, o))
    except Preempted as e:
        report.write(f"P {RANK} {e.step} {RESTART}\n")
        report.flush()
        print(f"PREEMPTED rank={RANK} step={e.step} code={e.code}", flush=True)
        raise
    mngr.close()
    if RANK == 0:
        leaves = [np.asarray(v) for v in jax.tree.leaves((params, opt))]
        np.savez(os.path.join(args.out, f"final_k{k}.npz"), *leaves)
    print(f"DONE k={k}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--report", default=os.devnull)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--steps-per-run", type=int, default=1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--ballast", type=int, default=1 << 20)
    ap.add_argument("--slow-writes", type=float, default=0.0)
    ap.add_argument("--no-preemption-service", action="store_true")
    args = ap.parse_args()
    if args.mode not in ("train", "reference"):
        plain(args.mode)
    global STRATEGY
    import jax
    if args.no_preemption_service:  # the fallback: a Python handler, flags all-gathered
        jax.config.update("jax_enable_preemption_service", False)
    from jreplicate.strategies.multi_worker import MultiWorkerStrategy
    STRATEGY = MultiWorkerStrategy()  # joins the cluster before any computation
    with open(args.report, "a") as report:
        if args.mode == "train":
            train(args, args.steps_per_run, args.ckpt, report)
        else:
            for k in (1, 4):
                train(args, k, os.path.join(args.ckpt, f"k{k}"), report)


STRATEGY = None

if __name__ == "__main__":
    main()
