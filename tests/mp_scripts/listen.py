"""A job that opens every socket a multi-worker job opens, then waits to be inspected.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2 listen.py FILE``:
the coordination service, gloo collectives and input agreements all run (padded input
where process 1 has no element at all, SINGLE-mode namedtuples built on process 1 from
process 0's description); each process prints its results and ``READY``, then waits
(at most 60 s) until ``FILE`` exists.
"""

import collections
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

Pair = collections.namedtuple("Pair", "x y")
strategy = jr.MultiWorkerStrategy()
rep = jr.Replicator(strategy)


def padded_fn(ctx):  # 20 examples on process 0, none on the others
    n = 20 if ctx.input_pipeline_id == 0 else 0
    b = ctx.get_per_replica_batch_size(8)
    v = np.arange(n, dtype=np.float32)
    return [{"v": v[i:i + b]} for i in range(0, n, b)]


def single_fn(ctx):  # worker 0 reads every replica's element
    b = ctx.get_per_replica_batch_size(8)
    return [Pair(np.full(b, i, np.float32), np.ones(b, np.int32)) for i in range(8)]


def count(ctx, batch):
    return ctx.all_sum(ctx.batch_mask.sum()), ctx.all_sum((batch["v"] * ctx.batch_mask).sum())


def total(ctx, batch):
    assert type(batch) is Pair, type(batch)
    return ctx.all_sum(batch.x.sum() + batch.y.sum())


n = s = 0.0
for batch in rep.prepare_input(padded_fn, partial_batch="pad"):
    c, t = rep.run(count, batch)
    n, s = n + float(c), s + float(t)
single = sum(float(rep.run(total, batch)) for batch in rep.prepare_input(
    single_fn, replication_mode=jr.InputReplicationMode.SINGLE))
print(f"PAD count={n:.0f} sum={s:.0f} SINGLE total={single:.0f}", flush=True)
print("READY", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
