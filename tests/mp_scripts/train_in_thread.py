"""Training in a non-daemon thread that outlives the main thread (the main thread
returns at once; the interpreter joins the thread before it exits).

``python train_in_thread.py prefetch|no-prefetch|per-replica``: prints ``DONE n`` when
the thread has run its 6 steps, or ``FAILED <error>``. The process is not exiting while
the thread runs: its input must not be closed under it.
"""

import os
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

mode = sys.argv[1]
rep = jr.Replicator(jr.MirroredStrategy())


def input_fn(ctx):
    for i in range(6):
        time.sleep(0.1)
        yield np.full((2,), i, np.float32)


def step(ctx, batch):
    return ctx.all_sum(batch.sum())


inputs = rep.prepare_input(
    input_fn,
    jr.InputReplicationMode.PER_REPLICA if mode == "per-replica"
    else jr.InputReplicationMode.PER_WORKER,
    prefetch_on_device=mode == "prefetch")


def train():
    n = 0
    try:
        time.sleep(0.5)  # the main thread has returned by now
        for batch in inputs:
            rep.run(step, batch)
            n += 1
        print(f"DONE {n}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"FAILED {type(e).__name__}: {e}", flush=True)


threading.Thread(target=train).start()
