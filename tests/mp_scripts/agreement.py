"""Cross-process agreement: direct cases (``--case``) for tests/test_cross_process_agreement.py.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2``. Prints
``RESULT <name> <outcome>`` lines, then ``END <time.time()>`` as its last act.

* ``exit_after_error``: PER_WORKER input, ``partial_batch="pad"``, elements holding a
  custom pytree node whose aux data changes at ``reinitialize()``; process 1's second
  sweep is empty, process 0's raises the change. The results of the last steps are never
  read (they may still run when the script ends). Both processes must raise the same
  ValueError and then exit at once (one waited for a collective its peer had left).
* ``numpy_vs_jax``: the same replicated argument as a NumPy array on process 0 and a
  ``jax.Array`` on process 1 (uncommitted, then committed to a device): it runs, alike
  (gloo aborted the job: the two kinds took different collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tagged:
    x: np.ndarray
    tag: str = dataclasses.field(metadata=dict(static=True))


def result(name: str, fn) -> None:
    try:
        out = fn()
        print(f"RESULT {name} ok {out}", flush=True)
    except Exception as e:  # recorded: the test compares the processes' outcomes
        print(f"RESULT {name} {type(e).__name__} {str(e).splitlines()[0][:400]}", flush=True)


def exit_after_error(rep: jr.Replicator, me: int) -> None:
    sweep = [0]
    counts = [(3, 3), (3, 0)]  # elements of (process 0, process 1) in each sweep

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(8)
        n = counts[sweep[0]][ctx.input_pipeline_id]
        return (Tagged(np.ones((b, 64), np.float32), f"epoch{sweep[0]}") for _ in range(n))

    def step(ctx, batch):  # some work before the collective: the last step runs late
        x = batch.x * ctx.batch_mask[:, None]
        w = jnp.ones((64, 64), jnp.float32) / 64
        x = jax.lax.fori_loop(0, 200, lambda i, x: jnp.tanh(x @ w), x)
        return ctx.all_sum(x.sum())

    it = rep.prepare_input(input_fn, partial_batch="pad")
    for s in range(2):
        def sweep_once():
            n = 0
            for batch in it:
                rep.run(step, batch)  # its result never read
                n += 1
            return n
        result(f"sweep{s}", sweep_once)
        if s == 0:
            sweep[0] = 1
            it.reinitialize()


def numpy_vs_jax(rep: jr.Replicator, me: int) -> None:
    x = np.arange(3, dtype=np.float32) + 1

    def step(ctx, a):
        return ctx.all_sum(a * 2.0)

    def echo(arg):
        return lambda: np.asarray(rep.run(step, None, arg).addressable_data(0)).tolist()
    result("uncommitted", echo(x if me == 0 else jnp.asarray(x)))
    result("committed", echo(x if me == 0 else jax.device_put(x, jax.local_devices()[1])))
    result("committed_both", echo(jax.device_put(x, jax.local_devices()[me])))
    # Different values: the same named error on every process, then still in step.
    result("differ", echo(x if me == 0 else jnp.asarray(x + 1)))
    result("after", echo(x))
    # State placed by replicate() (as scope() does): the same agreement.
    result("replicate", lambda: np.asarray(rep.replicate(
        {"w": x if me == 0 else jnp.asarray(x)})["w"].addressable_data(0)).tolist())
    result("replicate_differ", lambda: rep.replicate({"w": x * (1 + me)}))
    # A Python number is weakly typed, as on one process: bfloat16 * 0.5 stays bfloat16.
    h = jnp.ones(3, jnp.bfloat16)
    result("weak_float", lambda: str(rep.run(lambda ctx, h, lr: h * lr, None, h, 0.5).dtype))
    result("weak_int", lambda: str(rep.run(lambda ctx, h, k: h * k, None, h, 3).dtype))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, choices=["exit_after_error", "numpy_vs_jax"])
    args = p.parse_args()
    strategy = jr.MultiWorkerStrategy()
    rep = jr.Replicator(strategy)
    globals()[args.case](rep, strategy.worker_index)
    print(f"END {time.time()}", flush=True)


if __name__ == "__main__":
    main()
