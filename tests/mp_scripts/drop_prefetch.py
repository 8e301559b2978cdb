"""Drops prefetching input iterators while their threads copy batches, then exits.

Used by tests/test_exit.py and bench/exit_soak.py: the process must exit with status 0
every time (a prefetch thread still inside a JAX call at interpreter exit used to abort
it: "terminate called after throwing an instance of ...", status 134).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

rep = jr.Replicator(jr.MirroredStrategy())


def input_fn(ctx):
    b = ctx.get_per_replica_batch_size(64)
    return (np.full((b, 4096), i, np.float32) for i in range(10_000))


def step(ctx, x):
    return ctx.all_sum(x.sum())


iterators = [rep.prepare_input(input_fn, prefetch_on_device=True, prefetch_buffer_size=2)
             for _ in range(4)]
for it in iterators:
    rep.run(step, next(it))
del it, iterators  # dropped, never closed: their threads are mid-copy at exit
print("EXITING", flush=True)
