"""Validation across processes: every process must raise the same error, none may hang.

Run under ``python -m jreplicate.cluster.launch --nproc 2``. Each scenario is set up so that it
would pass on one process and fail on the other; the script prints one
``RESULT <scenario> <exception type> <message>`` line per scenario and ``DONE``; with
``ERRORS_RESULTS`` set, the RESULT lines also go to ``$ERRORS_RESULTS/p<process>.txt``
(a line read from that file cannot be cut by a C++ library's log written into stdout).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

from jreplicate.checkpoint import CheckpointManager  # noqa: E402
from jreplicate.input.context import InputReplicationMode as Mode  # noqa: E402
from jreplicate.replicator import Replicator  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402


def main() -> None:
    # The cluster from explicit arguments (here read from the launcher's variables).
    strategy = MultiWorkerStrategy(os.environ["JREPLICATE_COORDINATOR"],
                                   int(os.environ["JREPLICATE_NUM_PROCESSES"]),
                                   int(os.environ["JREPLICATE_PROCESS_ID"]),
                                   heartbeat_timeout=5, collective_timeout=20)
    print(f"CLUSTER {strategy.cluster.source}", flush=True)
    rep = Replicator(strategy)
    me = strategy.worker_index

    def result(line: str) -> None:
        print(line, flush=True)
        if os.environ.get("ERRORS_RESULTS"):
            with open(os.path.join(os.environ["ERRORS_RESULTS"], f"p{me}.txt"), "a") as f:
                f.write(line + "\n")
    per_worker = strategy.devices_per_worker

    def step(ctx, batch):
        return ctx.all_sum(batch.sum())

    def consume(it):
        n = 0
        for batch in it:
            rep.run(step, batch)
            n += 1
        return n

    def batch_differs(ctx):  # process 1 batches 5 examples per replica, process 0 4
        b = ctx.get_per_replica_batch_size(4 * ctx.num_replicas) + ctx.input_pipeline_id
        return (np.ones((b, 2), np.float32) for _ in range(3 * per_worker))

    def fails_on_one(ctx):  # process 1's pipeline raises at its second step
        for i in range(3 * per_worker):
            if ctx.input_pipeline_id == 1 and i == per_worker:
                raise ValueError("corrupt record in shard 1")
            yield np.ones((2, 2), np.float32)

    def shorter_on_one(ctx):  # process 1 has one step less
        steps = 3 - ctx.input_pipeline_id
        return (np.ones((2, 2), np.float32) for _ in range(steps * per_worker))

    def indivisible(ctx):
        b = ctx.get_per_replica_batch_size(30)
        return (np.ones((b, 2), np.float32) for _ in range(3))

    def single_bad(ctx):  # worker 0 reads everything; its 2nd step changes shape
        for i in range(3 * ctx.num_replicas):
            yield np.ones((2 if i < ctx.num_replicas else 3, 2), np.float32)

    def short_mid_stream_on_one(ctx):  # process 1: a shorter element more elements follow
        for i in range(3 * per_worker):
            short = ctx.input_pipeline_id == 1 and i == 2 * per_worker - 1
            yield np.ones((1 if short else 2, 2), np.float32)

    def short_final_on_one(ctx):  # process 1's last element (its 3rd step) is shorter
        for i in range(3 * per_worker):
            short = ctx.input_pipeline_id == 1 and i == 3 * per_worker - 1
            yield np.ones((1 if short else 2, 2), np.float32)
        if ctx.input_pipeline_id == 0:
            yield from (np.ones((2, 2), np.float32) for _ in range(per_worker))

    scenarios = [
        ("short_mid_stream", lambda: consume(rep.prepare_input(short_mid_stream_on_one))),
        ("short_final", lambda: consume(rep.prepare_input(short_final_on_one))),
        ("batch_differs", lambda: consume(rep.prepare_input(batch_differs))),
        ("input_error", lambda: consume(rep.prepare_input(fails_on_one))),
        ("shorter", lambda: consume(rep.prepare_input(shorter_on_one))),
        ("indivisible", lambda: consume(rep.prepare_input(indivisible))),
        ("single_shape", lambda: consume(rep.prepare_input(single_bad, Mode.SINGLE))),
    ]
    for name, fn in scenarios:
        try:
            out = fn()
            result(f"RESULT {name} ok {out}")
        except Exception as e:  # report, and carry on with the next scenario
            result(f"RESULT {name} {type(e).__name__} {str(e).splitlines()[0]}")

    def echo(ctx, x, s):
        return x * 1.0, s * 1.0

    def arg_bits():  # the same NaN / -0.0 / 0-d arguments everywhere: placed, bit for bit
        x = np.array([np.nan, -0.0, 1.0], np.float32)
        got, s = rep.run(echo, None, x, np.float32(-0.0))
        out = np.asarray(got.addressable_data(0))
        return (f"{out.tobytes() == x.tobytes()}"
                f"/{np.asarray(s.addressable_data(0)).tobytes() == np.float32(-0.0).tobytes()}"
                f"/{s.shape}")

    def arg_differs():  # each process passes its own value as a replicated argument
        return rep.run(echo, None, np.full(2, me, np.float32), np.float32(0))

    scenarios = [("arg_bits", arg_bits), ("arg_differs", arg_differs)]
    for name, fn in scenarios:
        try:
            fn_out = fn()
            result(f"RESULT {name} ok {fn_out}")
        except Exception as e:
            result(f"RESULT {name} {type(e).__name__} {str(e).splitlines()[0]}")

    per_replica = rep.run(lambda ctx: ctx.replica_id * 1.0)
    with tempfile.TemporaryDirectory() as d:
        mngr = CheckpointManager(os.path.join(d, f"ck{me}"), rep)
        try:
            mngr.save(1, {"loss": per_replica})
            result("RESULT save_per_replica ok")
        except Exception as e:
            result(f"RESULT save_per_replica {type(e).__name__} {str(e).splitlines()[0]}")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
