"""A PER_REPLICA input whose readers stall for 60 s at the third step.

``python stalled_reader.py prefetch|no-prefetch``: prints ``STEP i`` after each step;
tests/test_exit.py sends SIGINT during the stall. The process must exit at once (status
130, by SIGINT), not after the stall, and never abort.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

rep = jr.Replicator(jr.MirroredStrategy())


def input_fn(ctx):
    for i in range(100):
        if i == 2:
            time.sleep(60)
        yield np.ones((2, 3), np.float32)


def step(ctx, batch):
    return ctx.all_sum(batch.sum())


inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA,
                           prefetch_on_device=sys.argv[1] == "prefetch")
for i, batch in enumerate(inputs):
    rep.run(step, batch)
    print(f"STEP {i}", flush=True)
