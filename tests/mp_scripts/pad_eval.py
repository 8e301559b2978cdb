"""Padded evaluation across processes: every example of an uneven split counts once.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2``. Process p
holds ``40 + 23 * p`` examples (PER_WORKER input, per-replica batch 4), so the processes
run out at different steps; the chief prints the counts of two sweeps.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

strategy = jr.MultiWorkerStrategy()
rep = jr.Replicator(strategy)
per_process = [40 + 23 * p for p in range(strategy.num_workers)]


def input_fn(ctx):
    me = ctx.input_pipeline_id
    start = sum(per_process[:me])
    values = np.arange(start, start + per_process[me], dtype=np.float32)
    b = ctx.get_per_replica_batch_size(8)
    return [values[i:i + b] for i in range(0, len(values), b)]


def step(ctx, batch):
    m = ctx.batch_mask
    return ctx.all_sum(m.sum()), ctx.all_sum((batch * m).sum())


inputs = rep.prepare_input(input_fn, partial_batch="pad")
for sweep in range(2):
    count = total = 0.0
    for batch in inputs:
        c, t = rep.run(step, batch)
        count += float(c)
        total += float(t)
    n = sum(per_process)
    print(f"SWEEP {sweep} count={count:.0f} total={total:.0f} want={n} {n * (n - 1) // 2}",
          flush=True)
    inputs.reinitialize()
