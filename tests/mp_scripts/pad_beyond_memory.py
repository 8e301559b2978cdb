"""Padding that one process has no memory for (issue 28, item 8): an error on every
process, never on that one alone.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2``.
Process 0's element is a 256 MiB broadcast view (it holds no memory); process 1 has no
input, so it pads from process 0's spec, under an address-space limit that leaves it no
room for 256 MiB. Every process prints the error it raised.
"""

import os
import resource
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

strategy = jr.MultiWorkerStrategy()
rep = jr.Replicator(strategy)


def input_fn(ctx):
    if ctx.input_pipeline_id:
        return []
    b = ctx.get_per_replica_batch_size(4)
    return [{"x": np.broadcast_to(np.float32(0), (b, 2**26))}]


inputs = rep.prepare_input(input_fn, partial_batch="pad")
if strategy.process_index == 1:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + 128 * 2**20, resource.RLIM_INFINITY))
try:
    for batch in inputs:
        rep.run(lambda ctx, b: ctx.all_sum(b["x"].sum()), batch)
    print(f"FINISHED {strategy.process_index}", flush=True)
except ValueError as e:
    print(f"RAISED {strategy.process_index} {type(e).__name__}: {e}", flush=True)
