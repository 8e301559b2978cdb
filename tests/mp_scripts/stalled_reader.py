"""An input whose read stalls for 60 s at the third step.

``python stalled_reader.py prefetch|no-prefetch|prefetch-one-pipeline``: prints ``STEP
i`` after each step; tests/test_exit.py sends SIGINT during the stall. The process must
exit at once (by SIGINT), not after the stall, and never abort. With ``prefetch`` and
``no-prefetch`` each replica has its own pipeline (PER_REPLICA), read by reader threads;
with ``prefetch-one-pipeline`` (PER_WORKER) the prefetch thread itself is stalled in the
source.
"""

import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# A shell starts a background job (`pytest ... &`) with SIGINT ignored, and Python then
# leaves it ignored: Ctrl-C reaches a foreground program, whose SIGINT raises
# KeyboardInterrupt. This is what the test means to send.
signal.signal(signal.SIGINT, signal.default_int_handler)

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

mode = sys.argv[1]
one_pipeline = mode == "prefetch-one-pipeline"
rep = jr.Replicator(jr.MirroredStrategy())
stall_at = 2 * rep.num_replicas_in_sync if one_pipeline else 2  # the third step's read


def input_fn(ctx):
    for i in range(1000):
        if i == stall_at:
            time.sleep(60)
        yield np.ones((2, 3), np.float32)


def step(ctx, batch):
    return ctx.all_sum(batch.sum())


inputs = rep.prepare_input(
    input_fn,
    jr.InputReplicationMode.PER_WORKER if one_pipeline else jr.InputReplicationMode.PER_REPLICA,
    prefetch_on_device=mode != "no-prefetch")
for i, batch in enumerate(inputs):
    rep.run(step, batch)
    print(f"STEP {i}", flush=True)
